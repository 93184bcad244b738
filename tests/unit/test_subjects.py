"""Every NATS subject comes from shared/subjects.py, validated."""
import pytest

from shared import subjects

# ---- subjects --------------------------------------------------------------------------------------------

def test_subjects():
    assert subjects.GENERATE == "di.v1.generate" and subjects.CANCEL == "di.v1.cancel"
    assert subjects.KV_EVENTS == "di.v1.kv.*.events" and subjects.kv_events("w") == "di.v1.kv.w.events" and subjects.LOAD_ALL == "di.v1.*.*.load"
    assert subjects.prefill("p-0") == "di.v1.prefill.p-0.work" and subjects.decode("d_1") == "di.v1.decode.d_1.work"
    assert subjects.load("w", "decode") == "di.v1.decode.w.load" and subjects.kv_pull("w", "t1") == "di.v1.kv.w.pull.t1"
    assert subjects.load_role("cache_tier") == "di.v1.cache_tier.*.load"
    assert subjects.load_origin(subjects.load("w", "decode")) == ("decode", "w")
    assert subjects.kv_events_origin(subjects.kv_events("w")) == "w"
    assert subjects.ctl("router", "status") == "di.v1.ctl.router.status"
    assert subjects.draft("tiny") == "di.v1.draft.tiny.propose" and subjects.cache("get", "tier-0") == "di.v1.cache.tier-0.get"
    assert subjects.stats("router-1") == "di.v1.ctl.router-1.stats"
    assert "." not in subjects.REGISTRY_BUCKET


def test_a_cache_put_names_its_writer():
    put = subjects.cache_put("cache-0", "decode-1")
    assert put == "di.v1.cache.cache-0.put.decode-1" and subjects.cache_put_writer(put) == "decode-1"
    assert subjects.cache_puts("cache-0") == "di.v1.cache.cache-0.put.*" == put.rsplit(".", 1)[0] + ".*"
    assert subjects.cache_puts_by("decode-1") == "di.v1.cache.*.put.decode-1"
    assert subjects.cache_all("put") == "di.v1.cache.*.put.*" and subjects.cache_all("get") == "di.v1.cache.*.get"
    with pytest.raises(ValueError):
        subjects.cache("put", "cache-0")  # a put without its writer
    for bad in ("di.v1.cache.cache-0.get", "di.v1.cache.cache-0.put", "di.v1.cache.a.put.b.c"):
        with pytest.raises(ValueError):
            subjects.cache_put_writer(bad)


@pytest.mark.parametrize("token", ["", "a.b", "a*", ">", "a b", "a\tb", "a\nb", "\x00", None, 5, "x" * 200])
def test_subject_tokens_are_validated(token):
    for build_subject in (subjects.prefill, subjects.decode, subjects.draft, subjects.load_role, subjects.kv_pulls_of,
                          lambda t: subjects.kv_pull(t, "x"), lambda t: subjects.kv_pull("w", t),
                          lambda t: subjects.load(t, "decode"), lambda t: subjects.load("w", t),
                          lambda t: subjects.cache("get", t), lambda t: subjects.cache(t, "tier"),
                          lambda t: subjects.cache_put(t, "w"), lambda t: subjects.cache_put("tier", t),
                          lambda t: subjects.ctl("svc", t), lambda t: subjects.ctl(t, "op")):
        with pytest.raises(ValueError):
            build_subject(token)


def test_safe_token():
    assert subjects.safe_token("tiny-llama") == "tiny-llama"
    a, b = subjects.safe_token("Qwen/Qwen2.5-0.5B"), subjects.safe_token("Qwen/Qwen2_5-0_5B")
    assert a != b and subjects.draft(a).startswith("di.v1.draft.Qwen/Qwen2_5-0_5B-")
    assert subjects.safe_token("Qwen/Qwen2.5-0.5B") == a
    with pytest.raises(ValueError):
        subjects.safe_token("")


def test_is_kv_pull_accepts_only_one_pull_subject():
    assert subjects.is_kv_pull(subjects.kv_pull("w-1", "t-1"))
    for bad in ("di.v1.kv.a.pull.", "di.v1.kv.a.pull", "di.v1.kv.a.pull.b.c", "di.v1.kv.a.events", "di.v1.kv.*.pull.b",
                "di.v1.kv.a.pull.>", "_INBOX.x", "di.v1.kv." + "a" * 5000 + ".pull.b", "di.v1.kv.a.pull." + "b" * 129,
                None):
        assert not subjects.is_kv_pull(bad)
