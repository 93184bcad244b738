"""``lm-eval`` against the served path: its ``local-completions`` model (token-id prompts, ``echo`` +
``logprobs`` + ``max_tokens`` as it sends them) runs a multiple-choice loglikelihood task whose data and YAML the
test writes to disk (the ``lm_eval`` CLI in a subprocess, as users run it), through the router's HTTP API, a
prefill and a decode worker on a tiny random model. Every choice's loglikelihood lm-eval computed equals HF
transformers' on the same model and the same token ids within 1e-4, and so does its accuracy."""
import asyncio
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.integration.services_harness import InProcessCluster
from tests.model_factory import write_tiny_hf_folder

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

DOCS = [{"question": "The sky is", "choices": ["blue", "green", "loud"], "answer": 0},
        {"question": "Two plus two is", "choices": ["four", "five", "fish"], "answer": 0},
        {"question": "Paris is in", "choices": ["Spain", "France", "the sea"], "answer": 1},
        {"question": "Ice is", "choices": ["hot", "cold"], "answer": 1}]
TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def hf_loglikelihood(model, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].double(), dim=-1)   # [T, V]
    return sum(float(logprobs[len(context) + i - 1, tok]) for i, tok in enumerate(continuation))


async def test_lm_eval_loglikelihoods_equal_transformers(nats_server, tmp_path):
    folder = write_tiny_hf_folder(tmp_path / "tiny", seed=5, max_position_embeddings=1024)
    data = tmp_path / "tiny_mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_mc.yaml").write_text(TASK.format(data=data))
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    out = tmp_path / "out"
    async with InProcessCluster(nats_server.url, folder, router_kw={"http_port": 0}) as cluster:
        url = f"http://127.0.0.1:{cluster.router.http.port}/v1/completions"
        proc = await asyncio.create_subprocess_exec(   # the lm_eval CLI, as users run it
            sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
            f"base_url={url},model=default,tokenizer={folder},tokenizer_backend=huggingface,num_concurrent=1,"
            "max_retries=1,timeout=60", "--tasks", "tiny_mc", "--include_path", str(tasks), "--log_samples",
            "--output_path", str(out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={**os.environ, "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
        log, _ = await asyncio.wait_for(proc.communicate(), timeout=300)
    assert proc.returncode == 0, log.decode()[-3000:]
    [samples_file] = out.rglob("samples_tiny_mc_*.jsonl")
    [results_file] = out.rglob("results_*.json")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    results = json.loads(results_file.read_text())
    lm = LocalCompletionsAPI(base_url="http://unused/v1/completions", model="default", tokenizer=str(folder),
                             tokenizer_backend="huggingface")   # only its encoder: the ids lm-eval sent
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert len(samples) == len(DOCS)
    correct = 0
    for sample in samples:
        doc, pairs = sample["doc"], list(sample["arguments"].values())   # (context, continuation) as lm-eval built
        assert len(pairs) == len(doc["choices"]) and all(p["arg_0"] == doc["question"] for p in pairs)
        ours = [float(resp[0][0]) for resp in sample["resps"]]
        theirs = [hf_loglikelihood(hf, *lm._encode_pair(p["arg_0"], p["arg_1"])) for p in pairs]
        assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-4, (ours, theirs)
        correct += max(range(len(theirs)), key=theirs.__getitem__) == doc["answer"]
    assert results["results"]["tiny_mc"]["acc,none"] == pytest.approx(correct / len(DOCS))
