"""GGUF ``deepseek2`` (llama.cpp's DeepSeek V2 / V3 architecture): a tiny random V3 and a tiny V2-Lite-shaped
checkpoint made by transformers, converted as llama.cpp's converter does (tests/deepseek_factory.write_v3_gguf:
stacked experts, ``kv_b_proj`` split into ``attn_k_b`` / ``attn_v_b`` or kept whole, MLA lengths, YaRN's log
multiplier), load into the same config and weights as the HF folder and give transformers' logits (fp32, 1e-5)."""
import pytest
import torch

from shared.model.loader import build_model, load_model_files
from tests.deepseek_factory import VOCAB, write_v3_folder, write_v3_gguf
from tests.tiny_model import all_logits

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("version,split", [(3, True), (3, False), (2, True)])
def test_a_deepseek2_gguf_equals_its_hf_folder_and_transformers(tmp_path, version, split):
    folder = write_v3_folder(tmp_path / "hf", seed=4, version=version)
    path = write_v3_gguf(folder, tmp_path / "model.gguf", split_kv_b=split)
    hf_config, hf_weights, _ = load_model_files(folder)
    config, weights, tokenizer = load_model_files(path)
    assert (config.mla, config.moe) == (hf_config.mla, hf_config.moe)
    assert config.rope_scaling["mscale_all_dim"] == pytest.approx(hf_config.rope_scaling["mscale_all_dim"])
    assert config.architecture == hf_config.architecture and tokenizer.vocab_size == VOCAB
    assert sorted(weights) == sorted(hf_weights)
    assert all(torch.equal(weights[n], hf_weights[n]) for n in weights)
    ids = [(37 * i + 11) % (VOCAB - 10) + 5 for i in range(300)]
    ours = all_logits(build_model(config, weights, torch.float32, torch.device("cpu")), ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-5
