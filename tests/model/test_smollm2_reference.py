"""deepinfer's SmolLM2 equals HF transformers' LlamaForCausalLM loaded from the same GGUF (fp32)."""
import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from shared.model.llama import LlamaModel
from shared.model.loader import load_model_files
from shared.model.locate import default_model_path
from tests.tiny_model import all_logits

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


def test_logprobs_match_hf_transformers(ours, hf_model):
    """``logprobs`` and ``prompt_logprobs`` (the raw model distribution) equal HF's log_softmax within 1e-4."""
    model, tokenizer = ours
    engine = LLMEngine(model, EngineConfig(max_num_batched_tokens=16), tokenizer)   # chunked prompt scoring
    ids = tokenizer.encode(PROMPTS[1])
    rid = engine.add_request(ids, SamplingParams(max_tokens=6, temperature=0, logprobs=5, prompt_logprobs=5))
    tokens, lps, prompt_lps = [], [], None
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == rid
            tokens += out.new_token_ids
            lps += out.logprobs.token_logprobs
            prompt_lps = prompt_lps or out.prompt_logprobs
    with torch.inference_mode():
        expected = torch.log_softmax(hf_model(torch.tensor([ids + tokens])).logits[0].float(), -1)   # [T, V]
    want = [expected[i, t].item() for i, t in enumerate((ids + tokens)[1:])]
    got = prompt_lps.token_logprobs + lps           # every token after the first, from the position before it
    assert len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    assert prompt_lps.top_ids[0] == expected[0].topk(5).indices.tolist()
