#!/usr/bin/env bash
# `docker compose up` for real on a host like this one (make compose-check; not in CI): Debian's podman with runc and
# cgroupfs, no registry (the base image is built with debootstrap and `podman import`; torch's CPU wheel comes from
# the host's /opt/wheels or $TORCH_WHEEL), podman-compose from PyPI, every service on the host's loopback
# (scripts/compose_for_podman.py). Builds the image, starts the compose file with decode scaled to 2, waits for the
# router, asks one chat question through the OpenAI API, shows `deepinfer status`, and takes it all down. Prints
# how long each part took.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${COMPOSE_CHECK_DIR:-/var/tmp/deepinfer-compose-check}
BASE=localhost/deepinfer-base:bookworm
PROJECT=deepinfer-check
mkdir -p "$WORK"
t0=$(date +%s)
stamp() { echo "[compose-check] $(( $(date +%s) - t0 )) s: $*"; }

if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v debootstrap >/dev/null \
    || [ ! -x /usr/libexec/podman/catatonit ]; then
  apt-get install -y podman runc debootstrap catatonit >/dev/null   # catatonit: compose's `init: true`
fi
# crun and limits above the shell's are refused here (nproc even at the shell's own: 8192 at most works)
nproc=$(ulimit -u); [ "$nproc" = unlimited ] || [ "$nproc" -gt 8192 ] && nproc=8192
mkdir -p /etc/containers
cat > /etc/containers/containers.conf <<EOF
[containers]
default_ulimits = ["nofile=$(ulimit -n):$(ulimit -n)", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
EOF
if [ ! -x "$WORK/venv/bin/podman-compose" ]; then
  python3 -m venv "$WORK/venv" && "$WORK/venv/bin/pip" install -q podman-compose==1.5.0
fi
stamp "podman $(podman --version | awk '{print $3}'), podman-compose ready"

if ! podman image exists "$BASE"; then
  rm -rf "$WORK/rootfs"
  debootstrap --variant=minbase --include=python3,python3-dev,python3-venv,python3-pip,python-is-python3,ca-certificates,g++ \
    bookworm "$WORK/rootfs" http://deb.debian.org/debian >/dev/null
  tar -C "$WORK/rootfs" -c . | podman import - "$BASE" >/dev/null
  rm -rf "$WORK/rootfs"
  stamp "base image $BASE built with debootstrap"
fi

wheel=${TORCH_WHEEL:-$(ls /opt/wheels/torch-2.13.0+cpu-*.whl 2>/dev/null | head -1)}
[ -n "$wheel" ] && cp -n "$wheel" "$ROOT/compose/wheels/"
tb=$(date +%s)
# the host's trust store in every RUN: a TLS proxy the host trusts (this sandbox's, a company's) is trusted there too
ca=${BUILD_CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
podman build --network host --runtime runc -f "$ROOT/compose/Dockerfile" -t deepinfer:latest \
  ${ca:+--volume "$ca:/etc/ssl/certs/ca-certificates.crt:ro"} \
  --build-arg PYTHON_IMAGE="$BASE" --build-arg TORCH_INDEX= "$ROOT" > "$WORK/build.log" 2>&1 \
  || { tail -30 "$WORK/build.log"; exit 1; }
stamp "image deepinfer:latest built in $(( $(date +%s) - tb )) s (log: $WORK/build.log)"

"$ROOT/.venv/bin/python" "$ROOT/scripts/compose_for_podman.py" "$WORK/compose"
env_file="$WORK/compose/.env"
: > "$env_file"
for role in ROUTER PREFILL DECODE DRAFT CACHE_TIER CLIENT MONITOR; do
  echo "NATS_PASSWORD_$role=$(python3 -c 'import secrets; print(secrets.token_hex(16))')" >> "$env_file"
done
set -a; . "$env_file"; set +a
compose() { "$WORK/venv/bin/podman-compose" -p "$PROJECT" -f "$WORK/compose/docker-compose.yml" "$@"; }
cleanup() {
  compose down -v >/dev/null 2>&1 || true
  podman ps -aq --filter "label=com.docker.compose.project=$PROJECT" | xargs -r podman rm -f -t 5 >/dev/null 2>&1 || true
  podman volume ls -q --filter "label=com.docker.compose.project=$PROJECT" | xargs -r podman volume rm -f >/dev/null 2>&1 || true
}
trap cleanup EXIT
tu=$(date +%s)
compose up -d --no-build --scale decode=2 > "$WORK/up.log" 2>&1 || { tail -30 "$WORK/up.log"; exit 1; }
for _ in $(seq 1 120); do
  curl -sf http://127.0.0.1:8000/health >/dev/null && break
  sleep 3
done
curl -sf http://127.0.0.1:8000/health >/dev/null || { compose logs --tail 30 > "$WORK/logs.txt" 2>&1; tail -60 "$WORK/logs.txt"; exit 1; }
stamp "cluster healthy $(( $(date +%s) - tu )) s after compose up"
answer=$(curl -sf http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"model": "default", "max_tokens": 24, "temperature": 0, "messages": [{"role": "user", "content": "What is the capital of France?"}]}')
echo "$answer" | python3 -c 'import json, sys; r = json.load(sys.stdin); print("[compose-check] chat:", repr(r["choices"][0]["message"]["content"]))'
"$ROOT/.venv/bin/python" -m cli status --nats-url nats://127.0.0.1:4222 --user monitor --password "$NATS_PASSWORD_MONITOR" \
  | tee "$WORK/status.txt"
decodes=$(grep -c '^ *decode' "$WORK/status.txt" || true)
stamp "status lists $decodes decode workers (want 2)"
[ "$decodes" -ge 2 ]
stamp "compose-check passed"
