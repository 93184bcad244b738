"""deepinfer serving the real Gemma 3 270M (``--model gemma3-270m``: the GGUF joined from its PyPI chunk wheels)
equals HF transformers' Gemma3ForCausalLM loaded from the same GGUF (float32, dequantised) on a 2,100-token prompt,
four times the 512-token sliding window: prefill logits at positions on both sides of window boundaries, and the
greedy continuation produced by the engine with chunked prefill (1,024-token chunks). Our tokenizer equals
transformers' for the same GGUF. The HF reference is computed once and cached in pytest's tmp dir only."""
import gc
import random

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from shared.model import kv_cache
from shared.model.attention import AttentionMetadata, PrefillChunk
from shared.model.locate import resolve_model

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

MODEL = "gemma3-270m"
PROMPT_TOKENS = 2100
NEW_TOKENS = 16
POSITIONS = [0, 1, 255, 510, 511, 512, 513, 1023, 1024, 1535, 1536, 2047, 2048, PROMPT_TOKENS - 1]
TEXTS = ["The capital of France is", "  two  spaces\n\n\tand tabs\t\t", "def f(x):\n    return x ** 2  # square\n",
         "日本語のテキスト、中文, 한국어, Ελληνικά, русский, العربية, हिन्दी", "emoji 😀🎉👍🏽 👨‍👩‍👧 and ZWJ",
         "ünïcödé ß ﬁ \u00a0nbsp \u200bzero-width \ufffd", "<start_of_turn>user\nhi<end_of_turn>\n<table><td>x</td>",
         "1234567890 3.14159 1e-10 0xFF http://example.com/a?b=c#d {\"k\": [1, null]}", "   " * 30 + "x\n" * 7]


def long_text() -> str:
    """About 2,300 tokens of varied, deterministic prose; a fact stated at the start is asked about at the end."""
    rng = random.Random(7)
    names = ["Amira", "Bruno", "Chen", "Dagny", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun"]
    cities = ["Lisbon", "Nairobi", "Oslo", "Lima", "Hanoi", "Quebec", "Tbilisi", "Perth", "Cusco", "Riga"]
    items = ["lanterns", "maps", "violins", "teapots", "compasses", "notebooks", "kites", "lemons"]
    lines = ["The keeper of the lighthouse wrote down one fact before anything else: the password is "
             "'amber-falcon-42'. Then the log of the long journey began."]
    for day in range(1, 120):
        a, b = rng.sample(names, 2)
        lines.append(f"On day {day}, {a} travelled from {rng.choice(cities)} to {rng.choice(cities)} with "
                     f"{rng.randint(2, 97)} {rng.choice(items)}, and {b} counted {rng.randint(100, 999)} steps.")
    lines.append("At the end of the log, the keeper repeated the password, which was '")
    return " ".join(lines)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    config = EngineConfig(dtype="float32", device="cpu", block_size=16, num_kv_blocks=160,
                          max_num_batched_tokens=1024, enable_prefix_caching=False)
    return LLMEngine.from_path(MODEL, config)


@pytest.fixture(scope="module")
def prompt_ids(engine) -> list[int]:
    ids = engine.tokenizer.encode(long_text())
    assert ids[0] == engine.model.config.bos_token_id and ids[1] != ids[0] and len(ids) >= PROMPT_TOKENS
    return ids[:PROMPT_TOKENS - 20] + ids[-20:]  # keep the question at the end


@pytest.fixture(scope="module")
def reference(prompt_ids, tmp_path_factory) -> dict:
    """HF's logits at ``POSITIONS`` and greedy tokens (one prefill, then decode steps on its cache)."""
    cache = tmp_path_factory.getbasetemp() / "gemma3_270m_hf_reference.pt"
    if cache.exists():
        return torch.load(cache)
    path = resolve_model(MODEL)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf(torch.tensor([prompt_ids]), use_cache=True, logits_to_keep=torch.tensor(POSITIONS))
        logits, past = out.logits[0], out.past_key_values  # [len(POSITIONS), V]
        tokens = [int(logits[-1].argmax())]
        while len(tokens) < NEW_TOKENS:
            out = hf(torch.tensor([tokens[-1:]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
    result = {"logits": logits.clone(), "greedy": tokens}
    torch.save(result, cache)
    del hf, out, past
    gc.collect()
    return result


def one_shot_logits(model, ids: list[int], positions: list[int]) -> torch.Tensor:
    """Our logits at ``positions`` after prefilling ``ids`` in a single chunk: ``[len(positions), V]``."""
    n, bs = len(ids), 16
    blocks = -(-n // bs)
    kv = kv_cache.allocate(blocks, model.config, bs, model.dtype, model.device)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), num_decode=0,
                             decode_block_tables=torch.zeros(0, 0, dtype=torch.int32),
                             decode_context_lens=torch.zeros(0, dtype=torch.int32),
                             prefills=[PrefillChunk(0, n, n, torch.arange(blocks))], block_size=bs)
    return model.forward(torch.tensor(ids), torch.arange(n), meta, kv, torch.tensor(positions))


def test_config_read_from_the_gguf(engine):
    c = engine.model.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == \
        ("gemma3", 18, 640, 4, 1, 256)
    assert c.layer_sliding_windows == ((512,) * 5 + (None,)) * 3 and c.vocab_size == 262_144
    assert (c.rope_theta, c.rope_local_theta, c.rope_scaling, c.query_pre_attn_scalar) == (1e6, 1e4, None, 256.0)
    assert c.tie_word_embeddings and c.eos_token_ids == (1, 106)


def test_prefill_logits_match_hf(engine, prompt_ids, reference):
    got = one_shot_logits(engine.model, prompt_ids, POSITIONS)
    expected = reference["logits"]
    diff = (got - expected).abs().max().item()
    print(f"gemma3-270m prefill of {len(prompt_ids)} tokens: max-abs logit diff vs HF {diff:.3g} "
          f"(logits up to {expected.abs().max().item():.3g})")
    assert diff < 2e-3
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_greedy_with_chunked_prefill_matches_hf(engine, prompt_ids, reference):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    tokens = engine.generate([prompt_ids], params)[0]
    print(f"gemma3-270m greedy after {len(prompt_ids)} tokens: {engine.tokenizer.decode(tokens)!r}")
    assert tokens == reference["greedy"]


def test_generates_coherent_text(engine):
    """The base (pre-trained, not instruction-tuned) model continues a pattern; it also recalled the password
    from 2,000 tokens back in the greedy test above (printed with -s)."""
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompt = tok.encode("The capital of France is Paris. The capital of Germany is")
    text = tok.decode(engine.generate([prompt], params)[0])
    assert text.startswith(" Berlin. The capital of the United States is Washington"), text


def test_tokenizer_matches_hf(engine):
    path = resolve_model(MODEL)
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = engine.tokenizer
    for text in TEXTS + [long_text()]:
        ids = ref(text, add_special_tokens=False).input_ids
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.encode(text) == ref(text).input_ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
