"""deepinfer's SmolLM2 equals HF transformers' LlamaForCausalLM loaded from the same GGUF (fp32)."""
import pytest
import torch

from shared.engine.attention import AttentionMetadata, PrefillChunk
from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.model.llama import LlamaModel
from shared.model.loader import load_model_files
from shared.model.locate import default_model_path

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
    "Die Hauptstadt von Deutschland ist Berlin. " * 6,
]


@pytest.fixture(scope="module")
def ours():
    config, weights, tokenizer = load_model_files(None)
    model = LlamaModel(config, weights, torch.float32, torch.device("cpu"))
    return model, tokenizer


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32)
    return model.eval()


def all_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """Logits at every position, computed through the paged path in one chunk."""
    c, bs, n = model.config, 16, len(ids)
    num_blocks = -(-n // bs)
    kv = torch.zeros(num_blocks, c.num_layers, 2, bs, c.num_kv_heads, c.head_dim)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), num_decode=0,
                             decode_block_tables=torch.zeros(0, 0, dtype=torch.int32),
                             decode_context_lens=torch.zeros(0, dtype=torch.int32),
                             prefills=[PrefillChunk(0, n, n, torch.arange(num_blocks))], block_size=bs)
    return model.forward(torch.tensor(ids), torch.arange(n), meta, kv, torch.arange(n))


def test_logits_match_hf_transformers(ours, hf_model):
    model, tokenizer = ours
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        with torch.inference_mode():
            expected = hf_model(torch.tensor([ids])).logits[0]  # [T, V]
        got = all_logits(model, ids)
        diff = (got - expected).abs().max().item()
        assert diff < 1e-3, f"{prompt!r}: max-abs logit difference {diff}"


@pytest.mark.parametrize("prompt, continuation", [
    ("The capital of France is", " Paris."),
    ("Once upon a time, there was a little", " girl named Emma who loved to play in the sun."),
])
def test_greedy_continuations(ours, prompt, continuation):
    model, tokenizer = ours
    engine = LLMEngine(model, EngineConfig(), tokenizer)
    ids = engine.generate([tokenizer.encode(prompt)], SamplingParams(max_tokens=16, temperature=0))[0]
    assert tokenizer.decode(ids).startswith(continuation)
