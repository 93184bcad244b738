"""Every supported architecture variant matches HF transformers' own implementation on a tiny random
checkpoint written by the test (config.json + safetensors): logits within 1e-4 in fp32."""
import pytest
import torch

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
