"""A model build's fingerprint (shared/model/fingerprint.py): equal for the same weights, config, dtype, block size
and tokenizer (whatever the model is called, however often it is loaded); different when any of them changes."""
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.model.fingerprint import is_fingerprint, model_fingerprint, tensor_checksum, weights_digest
from shared.model.llama import LlamaModel
from shared.model.loader import load_model_files
from tests.model_factory import write_tiny_hf_folder
from tests.tiny_model import random_weights, tiny_config

CPU = torch.device("cpu")


def build(weights=None, dtype=torch.float64, **config):
    cfg = tiny_config(**config)
    return LlamaModel(cfg, weights if weights is not None else random_weights(cfg, seed=3), dtype, CPU)


def fp(model, tokenizer=None, block_size=16) -> str:
    return model_fingerprint(model, tokenizer, block_size)


def test_same_weights_same_fingerprint_whatever_the_name():
    a, b = build(), build(model_id="renamed")
    assert fp(a) == fp(b) and is_fingerprint(fp(a))
    assert LLMEngine(a, EngineConfig(block_size=16, num_kv_blocks=8)).fingerprint == fp(a)


def test_one_weight_changed_changes_it():
    weights = random_weights(tiny_config(), seed=3)
    before = fp(build(weights))
    weights["model.layers.1.mlp.down_proj.weight"][3, 5] += 1e-12   # one element, far below float64's noise
    assert fp(build(weights)) != before


def test_dtype_block_size_layout_and_tokenizer_change_it():
    base = fp(build())
    assert fp(build(dtype=torch.float32)) != base                    # same checkpoint, another run dtype
    assert fp(build(), block_size=8) != base                         # another block size
    assert fp(build(rope_theta=500000.0)) != base                    # another architecture setting, same tensors
    cfg = tiny_config(num_kv_heads=4)                                # another KV layout (and tensor shapes)
    assert fp(build(random_weights(cfg, seed=3), num_kv_heads=4)) != base


def test_checksum_sees_every_byte_and_the_digest_the_names():
    t = torch.arange(1000, dtype=torch.float32)
    c = tensor_checksum(t)
    t[999] += 1
    assert tensor_checksum(t) != c
    assert tensor_checksum(torch.arange(6.0).reshape(2, 3).t()) == tensor_checksum(torch.tensor([0., 3, 1, 4, 2, 5]))
    w = {"a": torch.zeros(2), "b": torch.ones(2)}
    assert weights_digest(w) == weights_digest(dict(reversed(w.items())))  # name order, not insertion order
    assert weights_digest(w) != weights_digest({"a": torch.ones(2), "b": torch.zeros(2)})


def test_checkpoint_files_give_the_same_fingerprint_until_a_tensor_changes(tmp_path):
    """Through the real loader: two writes of one checkpoint agree, a perturbed copy does not, and the
    tokenizer is part of it (same weights without the tokenizer differ)."""
    a = write_tiny_hf_folder(tmp_path / "a" / "tiny", seed=4)
    b = write_tiny_hf_folder(tmp_path / "b" / "tiny", seed=4)
    c = write_tiny_hf_folder(tmp_path / "c" / "tiny", seed=5)
    cfg = EngineConfig(dtype="float32", block_size=8, num_kv_blocks=8, num_threads=1)
    fa, fb, fc = (LLMEngine.from_path(str(p), cfg).fingerprint for p in (a, b, c))
    assert fa == fb != fc
    config, weights, tokenizer = load_model_files(a)
    model = LlamaModel(config, weights, torch.float32, CPU)
    assert model_fingerprint(model, tokenizer, 8) == fa != model_fingerprint(model, None, 8)
