"""Every supported architecture variant matches HF transformers' own implementation on a tiny random
checkpoint written by the test (config.json + safetensors): logits within 1e-4 in fp32."""
import dataclasses

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.model.config import with_rope_scaling
from shared.model.llama import LlamaModel
from shared.model.loader import load_model_files
from tests.model_factory import write_tiny_hf_folder
from tests.tiny_model import all_logits

transformers = pytest.importorskip("transformers")

VARIANTS = {
    "llama": dict(arch="llama"),
    "llama-tied-gqa1": dict(arch="llama", tie=True, kv_heads=1),
    "llama3-rope": dict(arch="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "linear-rope": dict(arch="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2": dict(arch="qwen2"),
    # Qwen2.5's documented long-context option: YaRN x4 over a 48-token original context (192), prompt 150 tokens
    "qwen2-yarn": dict(arch="qwen2", max_position_embeddings=48,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 48}),
    "qwen3": dict(arch="qwen3"),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(tmp_path, name):
    folder = write_tiny_hf_folder(tmp_path / name, seed=4, **VARIANTS[name])
    config, weights, _ = load_model_files(folder)
    ours = LlamaModel(config, weights, torch.float32, torch.device("cpu"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ids = [(17 * i + 5) % config.vocab_size for i in range(150)]  # long enough for scaled RoPE to matter
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    diff = (all_logits(ours, ids) - expected).abs().max().item()
    assert diff < 1e-4, f"{name}: max-abs logit difference {diff}"


def test_a_rope_scaling_override_is_the_config_json_edit_it_stands_for(tmp_path):
    """``--rope-scaling`` on a model whose files have none == transformers loading the same files with that
    ``rope_scaling`` added to config.json (what Qwen2.5's model card asks a long-context user to do)."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    plain = write_tiny_hf_folder(tmp_path / "plain", seed=4, arch="qwen2", max_position_embeddings=32)
    edited = write_tiny_hf_folder(tmp_path / "edited", seed=4, arch="qwen2", max_position_embeddings=32,
                                  rope_scaling=yarn)
    config, weights, _ = load_model_files(plain)
    extended = with_rope_scaling(config, {"type": "yarn", "factor": 4})  # vLLM's older spelling, original implied
    assert extended.rope_scaling == yarn and extended.max_position_embeddings == 128
    ids = [(17 * i + 5) % config.vocab_size for i in range(120)]  # past the original 32 positions
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(edited), dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    ours = all_logits(LlamaModel(extended, weights, torch.float32, torch.device("cpu")), ids)
    assert (ours - expected).abs().max().item() < 1e-4
    long_enough = dataclasses.replace(config, max_position_embeddings=128)  # the same RoPE, unscaled
    unscaled = all_logits(LlamaModel(long_enough, weights, torch.float32, torch.device("cpu")), ids)
    assert (unscaled - expected).abs().max().item() > 1e-2  # the override is what made them equal
    engine = LLMEngine.from_path(plain, EngineConfig(rope_scaling=yarn, num_kv_blocks=16))
    assert engine.max_model_len == 128 and engine.model.config.rope_scaling == yarn
    assert engine.fingerprint != LLMEngine.from_path(plain, EngineConfig(num_kv_blocks=16)).fingerprint
