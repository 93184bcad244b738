#!/usr/bin/env bash
# Runs the test suite. pytest's exit code 5 ("no tests were collected") is reported as its own failure:
# a test command that ran nothing has checked nothing.
set -u
py="${1:-.venv/bin/python}"
shift || true
# tests/unit/test_compose.py validates compose/docker-compose.yml with docker-compose (no Docker engine needed).
# Install it when missing; if that fails the test fails and says so.
if ! command -v docker-compose >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  echo "run_tests: installing docker-compose (apt-get) for tests/unit/test_compose.py" >&2
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
  apt_get() { $sudo env DEBIAN_FRONTEND=noninteractive apt-get -y -qq "$@" >/dev/null 2>&1; }
  apt_get install --no-install-recommends docker-compose \
    || { apt_get update && apt_get install --no-install-recommends docker-compose; } \
    || echo "run_tests: could not install docker-compose" >&2
fi
"$py" -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "run_tests: pytest collected no tests (exit 5) — treating as a broken test command" >&2
fi
exit "$rc"
