"""DeepSeek V3's MTP module as a drafter (``--drafter mtp``) on a tiny random checkpoint with one MTP layer
(tests/deepseek_factory.py): the loader reads it without changing the model's fingerprint; the drafter's
proposals, kept incrementally across calls, equal the module run one-shot over the target's hidden states; the
engine hands it exactly the target's hidden rows of the tokens that stand (partial acceptances, preemption
included); greedy output with it equals plain decoding; a model without MTP layers or a draft service refuses it."""
import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.speculator import SpecConfig, Speculator
from shared.errors import DeepinferError
from shared.model import kv_cache
from shared.model.attention import AttentionMetadata, PrefillChunk
from shared.model.loader import build_model, load_model_files
from shared.sampling import SamplingParams
from shared.spec.factory import make_drafter
from shared.spec.mtp_drafter import MtpDrafter
from shared.spec.types import DraftInput
from tests.deepseek_factory import VOCAB, write_v3_folder
from tests.model.test_deepseek_v3_tiny import prompt
from tests.tiny_model import all_logits
from tests.unit.test_spec_engine import OracleDrafter

pytest.importorskip("transformers")
CPU = torch.device("cpu")
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_v3_folder(tmp_path_factory.mktemp("dsv3mtp"), seed=1, mtp=True)


@pytest.fixture(scope="module")
def loaded(folder):
    return load_model_files(folder)


def target(loaded):
    config, weights, _ = loaded
    return build_model(config, weights, torch.float32, CPU)


def engine(loaded, spec=None, **kw) -> LLMEngine:
    kw = {"block_size": 16, "num_kv_blocks": 128, "max_num_batched_tokens": 2048, **kw}
    eng = LLMEngine(target(loaded), EngineConfig(**kw), loaded[2])
    eng.set_speculator(spec)
    return eng


def hidden_states(model, ids: list[int]) -> torch.Tensor:
    """The target's last hidden states ``[T, hidden]`` over ``ids`` in one chunk."""
    model.keep_hidden = True
    all_logits(model, ids)
    model.keep_hidden = False
    return model.last_hidden.clone()


def one_shot_draft(mtp, ids: list[int], h: torch.Tensor, k: int) -> tuple[list[int], list[float]]:
    """The MTP module over rows ``(h_j, ids[j + 1])`` for every ``j < n - 1`` in one chunk, then ``k - 1`` chained
    rows: the drafted tokens and their probabilities (the reference the incremental drafter must equal)."""
    n, bs = len(ids) - 1, 16
    blocks = -(-(n + k) // bs)
    kv = kv_cache.allocate(blocks, mtp.config, bs, mtp.dtype, CPU)
    table = torch.arange(blocks)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), num_decode=0,
                             decode_block_tables=torch.zeros(0, 0, dtype=torch.int32),
                             decode_context_lens=torch.zeros(0, dtype=torch.int32),
                             prefills=[PrefillChunk(0, n, n, table)], block_size=bs)
    logits, prev = mtp.forward(torch.tensor(ids[1:]), torch.arange(n), meta, kv, torch.tensor([n - 1]), h[:n])
    tokens, probs = [], []
    for j in range(k):
        probs.append(torch.softmax(logits[0], -1).max().item())
        tokens.append(int(logits[0].argmax()))
        if j == k - 1:
            break
        pos = torch.tensor([n + j])
        meta = AttentionMetadata(slot_mapping=pos, num_decode=1, decode_block_tables=table[None].to(torch.int32),
                                 decode_context_lens=(pos + 1).to(torch.int32), prefills=[], block_size=bs)
        logits, prev = mtp.forward(torch.tensor(tokens[-1:]), pos, meta, kv, torch.tensor([0]), prev)
    return tokens, probs


def test_the_loader_reads_the_mtp_layer_and_the_fingerprint_ignores_it(loaded, tmp_path):
    config, weights, _ = loaded
    assert config.nextn_layers == 1 and "model.layers.4.eh_proj.weight" in weights
    assert "model.layers.4.mlp.experts.7.down_proj.weight" in weights
    assert "model.layers.4.embed_tokens.weight" not in weights   # the model's own embedding and head are shared
    plain = load_model_files(write_v3_folder(tmp_path, seed=1))   # the same checkpoint without its MTP layer
    assert plain[0].nextn_layers == 0 and not any(".layers.4." in n for n in plain[1])
    assert engine(loaded).fingerprint == engine(plain).fingerprint
    with pytest.raises(DeepinferError, match="no MTP layer"):
        make_drafter("mtp", build_model(plain[0], plain[1], torch.float32, CPU))


def test_incremental_proposals_equal_the_module_run_one_shot(loaded):
    """Prefill, then accepted drafts (the drafter's own tokens appended, their hidden rows the target's), then a
    rejection: each call's proposal equals the one-shot reference over the whole sequence, probabilities to 1e-5
    (a state that kept the chained rows' KV, or mis-aligned rows, would not)."""
    model = target(loaded)
    drafter = MtpDrafter(model, window=256, block_size=16)
    assert drafter.model.block.embed is model.embed and drafter.model.block.lm_head is model.lm_head  # shared
    ids = prompt(37)
    h = hidden_states(model, ids)
    drafter.observe("s", 0, h[:len(ids) - 1])
    for step in range(4):
        got = drafter.propose([DraftInput("s", ids)], 3)[0]
        want, probs = one_shot_draft(drafter.model, ids, h, 3)
        assert got.tokens == want, step
        assert max(abs(f.top1_prob - q) for f, q in zip(got.features, probs)) < 1e-5
        accepted = got.tokens[:2] if step % 2 == 0 else [(got.tokens[0] + 1) % VOCAB]  # accept 2, or reject
        n = len(ids)
        ids = ids + accepted + [int(all_logits(model, ids + accepted)[-1].argmax())]
        h = hidden_states(model, ids)
        drafter.observe("s", n - 1, h[n - 1:len(ids) - 1])
    assert drafter.stats()["rebuilds"] == 1 and drafter.stats()["fed_tokens"] < len(ids)


def test_nothing_is_drafted_before_the_engine_computed_the_rows(loaded):
    drafter = MtpDrafter(target(loaded), window=64)
    assert drafter.propose([DraftInput("new", prompt(20))], 3)[0].tokens == []


class WatchedMtp(MtpDrafter):
    """The real MTP drafter's bookkeeping, proposing an oracle's tokens (partly right) so verifications accept
    some drafts and reject others; records every ``observe``."""

    def __init__(self, model, oracle):
        super().__init__(model, window=256)
        self.oracle, self.seen = oracle, {}

    def observe(self, seq_id, start, rows):
        self.seen.setdefault(seq_id, []).append((start, rows.clone()))
        super().observe(seq_id, start, rows)

    def propose(self, sequences, k):
        return self.oracle.propose(sequences, k)


def test_the_engine_hands_over_exactly_the_hidden_rows_that_stand(loaded):
    prompts = [prompt(50), prompt(29, salt=3)]
    expected = engine(loaded).generate(prompts, GREEDY)
    model = target(loaded)
    watched = WatchedMtp(model, OracleDrafter(prompts, expected, wrong_every=3))
    spec = Speculator(watched, SpecConfig(k=4))
    eng = engine(loaded, spec, num_kv_blocks=7, max_num_batched_tokens=32)   # chunked, and preempted
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    got = {i: [] for i in ids}
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id] += out.new_token_ids
    assert [got[i] for i in ids] == expected
    assert eng.num_preemptions > 0 and 0 < spec.counters.accepted < spec.counters.drafted
    recomputed = False
    for rid, p, out in zip(ids, prompts, expected):
        full = p + out
        ref = hidden_states(target(loaded), full[:-1])
        calls = watched.seen[rid]   # every row handed over is the target's for the tokens that stood
        assert {start + i for start, rows in calls for i in range(len(rows))} == set(range(len(full) - 1))
        assert max((rows - ref[start:start + len(rows)]).abs().max().item() for start, rows in calls) < 1e-4
        ends = [start + len(rows) for start, rows in calls]
        recomputed |= any(start < max(ends[:i]) for i, (start, _) in enumerate(calls) if i)
    assert recomputed   # a preempted request's rows came again (and were the same)


def test_greedy_with_the_mtp_drafter_equals_plain_decoding(loaded):
    prompts = [prompt(70), prompt(45, salt=5), prompt(20, salt=9)]
    expected = engine(loaded).generate(prompts, GREEDY)
    eng = engine(loaded)
    spec = Speculator(make_drafter("mtp", eng.model), SpecConfig(k=3))
    eng.set_speculator(spec)
    assert eng.model.keep_hidden
    assert eng.generate(prompts, GREEDY) == expected
    assert spec.counters.proposals > 0 and spec.counters.drafter_errors == 0
    assert spec.drafter.stats()["states"] == 0 and not spec.drafter.hidden   # finished requests released


def test_a_draft_service_or_a_dense_model_refuses_mtp(loaded):
    from tests.tiny_model import tiny_model

    with pytest.raises(DeepinferError, match="inside the decode worker"):
        make_drafter("mtp", target(loaded), local=False)
    with pytest.raises(DeepinferError, match="DeepSeek V3 checkpoint"):
        make_drafter("mtp", tiny_model(seed=1))


def test_hidden_rows_kept_are_bounded_per_sequence_and_in_sequences(loaded):
    drafter = MtpDrafter(target(loaded), window=16, max_batch=2, max_states=3)   # keeps 16 + 8 + 2 = 26 rows
    hidden = torch.randn(1, 64)
    for pos in range(500):   # one decode row per step
        drafter.observe("s", pos, hidden)
    assert drafter.hidden["s"].rows.shape[0] <= 2 * 26 and drafter.hidden["s"].end == 500
    for i in range(5):
        drafter.observe(f"other{i}", 0, hidden)
    assert len(drafter.hidden) == 3 and "s" not in drafter.hidden   # least recently observed dropped


def test_an_incomplete_mtp_layer_is_left_out_and_the_model_still_loads(folder, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.4.eh_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    config, weights, _ = load_model_files(broken)
    assert config.nextn_layers == 0 and not any(n.startswith("model.layers.4.") for n in weights)
    assert build_model(config, weights, torch.float32, CPU).nextn_weights == {}
