"""DeepSeek V3 (MLA latent KV, DeepSeekMoE) on a tiny random checkpoint made by transformers itself
(tests/deepseek_factory.py: 2 dense + 2 MoE layers, 8 routed experts in 2 groups, YaRN, interleaved RoPE): our
loader + model equal transformers' ``DeepseekV3ForCausalLM`` (fp32 logits within 1e-5 over a 1,000-token prompt,
greedy tokens equal, bf16 close); the engine over the paged latent cache gives the same greedy tokens one-shot,
chunked across block boundaries, on a prefix-cache hit and after preemption; the cache holds one latent row per
token and layer (576 numbers in V3 itself), not per-head K/V."""

import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.errors import DeepinferError
from shared.model.deepseek import DeepseekV3Model
from shared.model.loader import build_model, load_model_files
from shared.sampling import SamplingParams
from tests.deepseek_factory import VOCAB, write_v3_folder
from tests.tiny_model import all_logits

transformers = pytest.importorskip("transformers")
CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(37 * i + 11 + salt) % (VOCAB - 10) + 5 for i in range(n)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_v3_folder(tmp_path_factory.mktemp("dsv3"), seed=1)


@pytest.fixture(scope="module")
def hf_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def loaded(folder):
    return load_model_files(folder)


def engine(loaded, **kw) -> LLMEngine:
    config, weights, tokenizer = loaded
    kw = {"block_size": 16, "num_kv_blocks": 128, "max_num_batched_tokens": 2048, **kw}
    return LLMEngine(build_model(config, weights, torch.float32, CPU), EngineConfig(**kw), tokenizer)


def test_loader_reads_mla_and_moe_config(loaded):
    config, weights, _ = loaded
    assert config.architecture == "deepseek_v3" and config.mla.kv_lora_rank == 32 and config.mla.q_lora_rank == 48
    assert config.mla.latent_dim == 48 and config.kv_cache_heads == 1 and config.kv_cache_dim == 24
    assert config.moe.n_routed_experts == 8 and config.moe.n_group == 2 and config.moe.first_k_dense_replace == 2
    assert config.rope_scaling["rope_type"] == "yarn" and "model.layers.3.mlp.experts.7.down_proj.weight" in weights


def test_fp32_logits_equal_transformers_over_1000_tokens(loaded, hf_model):
    config, weights, _ = loaded
    model = build_model(config, weights, torch.float32, CPU)
    assert isinstance(model, DeepseekV3Model)
    ids = prompt(1000)
    ours = all_logits(model, ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-5, (ours - ref).abs().max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    counts = model.expert_counts()
    assert len(counts) == 2 and all(sum(c) == 1000 * 2 for c in counts) and all(min(c) < max(c) for c in counts)


def test_bf16_logits_close_to_transformers_bf16(folder, loaded):
    config, weights, _ = loaded
    ids = prompt(200)
    ours = all_logits(build_model(config, weights, torch.bfloat16, CPU), ids).float()
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() < 0.1 * ref.abs().max().item()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.9


def test_engine_greedy_equals_transformers_generate(loaded, hf_model):
    ids = prompt(300)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, min_new_tokens=16)[0]
    assert engine(loaded).generate([ids], GREEDY)[0] == ref[len(ids):].tolist()


def test_chunked_prefix_hit_and_preemption_equal_one_shot(loaded):
    ids, other = prompt(300), prompt(260, salt=3)
    expected = engine(loaded).generate([ids], GREEDY)[0]
    chunked = engine(loaded, max_num_batched_tokens=40)        # chunks cross 16-token block boundaries
    assert chunked.generate([ids], GREEDY)[0] == expected
    cached = engine(loaded)
    cached.generate([ids], GREEDY)
    rid = cached.add_request(ids, GREEDY)
    got, last = [], None
    while cached.has_unfinished():
        for out in cached.step():
            got += out.new_token_ids
            last = out
    assert got == expected and last.num_cached_tokens == 288    # the whole prompt but its last partial block
    tight = engine(loaded, num_kv_blocks=24, max_num_batched_tokens=64)   # two requests cannot both fit
    both = tight.generate([ids, other], GREEDY)
    assert both[0] == expected and both[1] == engine(loaded).generate([other], GREEDY)[0]
    assert tight.num_preemptions > 0


def test_the_cache_holds_latents_not_expanded_kv(loaded):
    config = loaded[0]
    eng = engine(loaded)
    block = eng.kv_port.block_shape   # [L, 2, 1, bs, latent / 2]
    assert block == [4, 2, 1, 16, 24]
    latent_bytes = 4 * 16 * 48 * 4
    expanded = 4 * 16 * config.num_heads * (config.mla.qk_nope_head_dim + config.mla.qk_rope_head_dim
                                            + config.mla.v_head_dim) * 4
    assert eng.kv_port.block_bytes == latent_bytes and expanded / latent_bytes == pytest.approx(5.0)


def test_a_checkpoint_missing_an_expert_is_refused(tmp_path, folder):
    from safetensors.torch import load_file, save_file
    import shutil
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DeepinferError, match="experts.5.up_proj"):
        load_model_files(broken)


def test_speculative_verification_over_latents_equals_plain_decoding(loaded):
    """Drafted tokens (an oracle wrong at every third position) verified by the V3 engine in one forward over
    the latent cache, rejected ones trimmed: the same greedy tokens as plain decoding."""
    from shared.engine.speculator import SpecConfig, Speculator
    from tests.unit.test_spec_engine import OracleDrafter

    prompts = [prompt(70), prompt(45, salt=5)]
    expected = engine(loaded).generate(prompts, GREEDY)
    spec = Speculator(OracleDrafter(prompts, expected, wrong_every=3), SpecConfig(k=4))
    eng = engine(loaded)
    eng.set_speculator(spec)
    assert eng.generate(prompts, GREEDY) == expected
    assert 0 < spec.counters.accepted < spec.counters.drafted


def test_deepseek_v2_lite_shape_equals_transformers(tmp_path):
    """DeepSeek V2 (``deepseek_v2``, V2-Lite's shape: no query bottleneck; softmax routing limited to the best
    group, no renormalisation, no correction bias; complex-number RoPE on interleaved pairs): fp32 logits within
    1e-5 of transformers' ``DeepseekV2ForCausalLM`` over 600 tokens, engine greedy equal to its generate."""
    folder = write_v3_folder(tmp_path / "dsv2", seed=4, version=2)
    config, weights, tokenizer = load_model_files(folder)
    assert config.architecture == "deepseek_v2" and config.mla.q_lora_rank is None
    assert config.moe.scoring == "softmax" and config.moe.topk_method == "group_limited_greedy"
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = prompt(600)
    ours = all_logits(build_model(config, weights, torch.float32, CPU), ids)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        generated = hf.generate(torch.tensor([ids[:200]]), max_new_tokens=16, do_sample=False, min_new_tokens=16)[0]
    assert (ours - ref).abs().max().item() < 1e-5, (ours - ref).abs().max()
    assert engine((config, weights, tokenizer)).generate([ids[:200]], GREEDY)[0] == generated[200:].tolist()
