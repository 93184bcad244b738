"""DeepSeek V4 (sliding-window + compressed sparse / heavily compressed attention, lightning indexer, attention
sinks, grouped output projection, mHC hyper-connections, hash and top-k MoE) on a tiny random checkpoint made by
transformers itself (tests/deepseek_factory.write_v4_folder: window 8, CSA groups of 4 with top-3 picks, HCA
groups of 16): our loader + model equal ``DeepseekV4ForCausalLM`` (fp32 logits within 1e-5 over a prompt 20x the
window and 7x the HCA group, greedy tokens equal to ``generate``), and the per-sequence state makes any split into
chunks — across group and window boundaries, token by token, beside another sequence — equal one forward."""
import pytest
import torch

from shared.model.deepseek_v4 import DeepseekV4Model, V4Chunk
from shared.model.loader import build_model, load_model_files
from shared.model.v4_state import context_bytes
from tests.deepseek_factory import VOCAB, write_v4_folder

transformers = pytest.importorskip("transformers")
CPU = torch.device("cpu")


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(37 * i + 11 + salt) % (VOCAB - 10) + 5 for i in range(n)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_v4_folder(tmp_path_factory.mktemp("dsv4"), seed=1)


@pytest.fixture(scope="module")
def loaded(folder):
    return load_model_files(folder)


@pytest.fixture(scope="module")
def hf_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def model_of(loaded) -> DeepseekV4Model:
    config, weights, _ = loaded
    return build_model(config, weights, torch.float32, CPU)


def run(model: DeepseekV4Model, pieces: list[list[list[int]]]) -> list[torch.Tensor]:
    """Feed each sequence its pieces, one piece of every sequence per forward; every row's logits per sequence."""
    states = [model.new_state() for _ in pieces]
    logits: list[list[torch.Tensor]] = [[] for _ in pieces]
    for step in range(max(len(p) for p in pieces)):
        ids, positions, chunks, owners = [], [], [], []
        for s, (state, seq) in enumerate(zip(states, pieces)):
            if step < len(seq):
                start = len(ids)
                ids += seq[step]
                positions += range(state.num_tokens, state.num_tokens + len(seq[step]))
                chunks.append(V4Chunk(state, start, len(ids)))
                owners.append(s)
        out = model.forward(torch.tensor(ids), torch.tensor(positions), chunks, torch.arange(len(ids)))
        for ch, s in zip(chunks, owners):
            logits[s].append(out[ch.start:ch.end])
    return [torch.cat(rows) for rows in logits]


def split(ids: list[int], sizes: list[int]) -> list[list[int]]:
    out, i = [], 0
    for n in sizes:
        out.append(ids[i:i + n])
        i += n
    return out + [[t] for t in ids[i:]]


def test_loader_reads_every_v4_knob(loaded):
    config, weights, _ = loaded
    v4 = config.v4
    assert config.architecture == "deepseek_v4" and config.num_kv_heads == 1 and config.head_dim == 32
    assert v4.layer_types[1:3] == ("compressed_sparse_attention", "heavily_compressed_attention")
    assert (v4.csa_ratio, v4.hca_ratio, v4.index_topk, v4.sliding_window, v4.hc_mult) == (4, 16, 3, 8, 2)
    assert v4.mlp_layer_types[0] == "hash_moe" and v4.rope_dim == 8 and v4.scoring_func == "sqrtsoftplus"
    assert "model.layers.1.attn.indexer.compressor.ape" in weights and "model.layers.0.ffn.gate.tid2eid" in weights


def test_fp32_logits_equal_transformers(loaded, hf_model):
    ids = prompt(160)
    ours = run(model_of(loaded), [[ids]])[0]
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-5, (ours - ref).abs().max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_chunks_tokens_and_batch_neighbours_equal_one_forward(loaded):
    """Chunks ending inside and on CSA / HCA groups and the window, then one token at a time, beside a second
    sequence of other chunking: every row's logits equal the one-shot forward's."""
    model = model_of(loaded)
    a, b = prompt(70), prompt(45, salt=7)
    whole = run(model, [[a], [b]])
    pieces = run(model, [split(a, [3, 5, 8, 1, 15, 16, 2]), split(b, [16, 4, 9])])
    for one, many in zip(whole, pieces):
        assert (one - many).abs().max().item() < 1e-5


def test_state_holds_compressed_entries_and_a_bounded_window(loaded):
    model = model_of(loaded)
    state = model.new_state()
    n = 150
    model.forward(torch.tensor(prompt(n)), torch.arange(n), [V4Chunk(state, 0, n)], torch.tensor([n - 1]))
    assert state.num_tokens == n
    for layer, kind in zip(state.layers, loaded[0].v4.layer_types):
        assert layer.window.shape[0] == 7   # sliding_window - 1
        if kind == "compressed_sparse_attention":
            assert layer.compressor.entries.shape[0] == n // 4 and layer.compressor.pending_kv.shape[0] == n % 4
            assert layer.indexer.entries.shape == (n // 4, 16)
        elif kind == "heavily_compressed_attention":
            assert layer.compressor.entries.shape[0] == n // 16 and layer.compressor.pending_kv.shape[0] == n % 16
    dense = n * 4 * 32 * 4   # what one K=V row per token and layer would take (fp32)
    assert state.nbytes() == context_bytes(loaded[0], n, 4) < dense / 2


def test_greedy_decode_equals_transformers_generate(loaded, hf_model):
    ids = prompt(60)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    model = model_of(loaded)
    state = model.new_state()
    tokens, feed = [], ids
    for _ in range(12):
        pos = torch.arange(state.num_tokens, state.num_tokens + len(feed))
        logits = model.forward(torch.tensor(feed), pos, [V4Chunk(state, 0, len(feed))], torch.tensor([len(feed) - 1]))
        tokens.append(int(logits[0].argmax()))
        feed = tokens[-1:]
    assert tokens == ref
