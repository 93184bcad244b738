"""DeepSeek V4 served by ``LLMEngine`` (per-sequence states: ``shared/engine/v4_kv.py``) on the tiny random V4
(window 8, CSA groups of 4, HCA groups of 16): greedy batches equal HF transformers' ``generate``; chunked prefill,
prefix hits at block boundaries inside and on compression groups (inside the prompt and past it, after a turn),
preemption under a small budget and speculative verification with rejected drafts (states rolled back) all equal
the uninterrupted miss token for token; the budget refuses what can never fit; KV events announce what a hit can
use."""
import pytest
import torch

from shared.engine.config import EngineConfig
from shared.engine.llm_engine import LLMEngine
from shared.engine.speculator import Speculator
from shared.spec.types import Proposal, TokenFeatures
from shared.engine.v4_kv import V4StateManager
from shared.errors import DeepinferError
from shared.model.loader import build_model, load_model_files
from shared.sampling import SamplingParams
from tests.deepseek_factory import VOCAB, write_v4_folder

transformers = pytest.importorskip("transformers")
GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(37 * i + 11 + salt) % (VOCAB - 10) + 5 for i in range(n)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_v4_folder(tmp_path_factory.mktemp("dsv4"), seed=3)


@pytest.fixture(scope="module")
def loaded(folder):
    return load_model_files(folder)


def engine(loaded, **kw) -> LLMEngine:
    config, weights, tokenizer = loaded
    return LLMEngine(build_model(config, weights, torch.float32, torch.device("cpu")),
                     EngineConfig(**{"block_size": 16, "num_kv_blocks": 256, **kw}), tokenizer)


def served(eng: LLMEngine, ids: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], int]:
    """Run one request to its end beside whatever else is queued: (its tokens, its cached prompt tokens)."""
    rid = eng.add_request(ids, params)
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    return [t for o in outs for t in o.new_token_ids], outs[-1].num_cached_tokens


@pytest.fixture(scope="module")
def misses(loaded):
    """Each prompt alone, prefix caching off: the reference every other schedule must equal."""
    eng = engine(loaded, enable_prefix_caching=False)
    return {n: eng.generate([prompt(n)], GREEDY)[0] for n in (5, 37, 70, 83)}


def test_greedy_batch_equals_transformers_generate(folder, loaded, misses):
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    eng = engine(loaded)
    lengths = (5, 37, 83)   # 83: 10x the window, 5x the HCA group
    got = eng.generate([prompt(n) for n in lengths], GREEDY)
    for n, tokens in zip(lengths, got):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt(n)]), max_new_tokens=GREEDY.max_tokens, do_sample=False)
        assert tokens == ref[0, n:].tolist() == misses[n]
    assert isinstance(eng.block_manager, V4StateManager) and eng.kv_pools()[0]["name"] == "v4_state"


@pytest.mark.parametrize("step_tokens", [7, 16, 24])
def test_chunked_prefill_equals_one_shot(loaded, misses, step_tokens):
    eng = engine(loaded, max_num_batched_tokens=step_tokens, enable_prefix_caching=False)
    assert eng.generate([prompt(70), prompt(83)], GREEDY) == [misses[70], misses[83]]


@pytest.mark.parametrize("block_size", [2, 16])   # 2: boundaries inside CSA and HCA groups; 16: on both
def test_prefix_hits_inside_and_past_the_prompt_equal_the_miss(loaded, misses, block_size):
    eng = engine(loaded, block_size=block_size, num_kv_blocks=4096 // block_size)
    first = eng.generate([prompt(70)], GREEDY)[0]
    assert first == misses[70]
    # the same prompt again: a hit at the last boundary before its last token
    tokens, cached = served(eng, prompt(70), GREEDY)
    assert tokens == misses[70]
    assert cached == (69 // block_size) * block_size
    # a longer prompt sharing the first 37 tokens: a hit inside its prompt, at the shared prefix's last boundary
    longer = prompt(37) + prompt(46, salt=5)
    want = engine(loaded, enable_prefix_caching=False).generate([longer], GREEDY)[0]
    eng.generate([prompt(37)], GREEDY)
    tokens, cached = served(eng, longer, GREEDY)
    assert tokens == want
    assert cached == 37 // block_size * block_size
    # the next turn (prompt + the reply + more): a hit past the first prompt, from the state its decode left
    turn = prompt(70) + first + prompt(9, salt=2)
    want = engine(loaded, enable_prefix_caching=False).generate([turn], GREEDY)[0]
    tokens, cached = served(eng, turn, GREEDY)
    assert tokens == want
    assert cached > 70


def test_preempted_equals_uninterrupted(loaded, misses):
    """A budget that holds about one long sequence: the scheduler preempts and recomputes (from the preempted
    request's own snapshot where it has one), and every output still equals its miss."""
    eng = engine(loaded, num_kv_blocks=28, max_num_batched_tokens=32)
    got = eng.generate([prompt(n) for n in (70, 83, 37)], GREEDY)
    assert eng.num_preemptions > 0
    assert got == [misses[70], misses[83], misses[37]]


class GreedyOracle:
    """Fault injection for verification: proposes the true greedy continuation (``answer``, after ``prompt``)
    with every third drafted token wrong, so steps accept some drafts and reject the rest."""
    name = "oracle"

    def __init__(self, prompt_len: int, answer: list[int]) -> None:
        self.prompt_len, self.answer = prompt_len, answer

    def propose(self, sequences, k):
        out = []
        for seq in sequences:
            done = len(seq.token_ids) - self.prompt_len
            draft = list(self.answer[done:done + k])
            if len(draft) > 2:
                draft[2] = (draft[2] + 1) % VOCAB
            out.append(Proposal(draft, [TokenFeatures(position=i) for i in range(len(draft))]))
        return out


@pytest.mark.parametrize("block_size", [2, 16])
def test_speculative_decoding_rolls_states_back_exactly(loaded, block_size):
    """Drafts partly right: every rejection puts the state back (window, entries, pending rows) to the last
    accepted row, so the output equals plain greedy decoding, and the prefix cache keeps no drafted token (the
    next turn's hit equals its miss)."""
    ids = prompt(45)
    want = engine(loaded, enable_prefix_caching=False).generate([ids], GREEDY)[0]
    eng = engine(loaded, block_size=block_size, num_kv_blocks=4096 // block_size)
    eng.set_speculator(Speculator(GreedyOracle(len(ids), want)))
    assert eng.generate([ids], GREEDY)[0] == want
    c = eng.speculator.counters
    assert c.steps > 0 and 0 < c.accepted < c.drafted, (c.accepted, c.drafted)
    eng.set_speculator(None)
    turn = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    plain = engine(loaded, enable_prefix_caching=False).generate([ids + want], turn)[0]
    tokens, cached = served(eng, ids + want, turn)
    assert tokens == plain and cached > len(ids)


def test_budget_refusals_and_events(loaded):
    eng = engine(loaded, num_kv_blocks=16)
    bm = eng.block_manager
    assert bm.refuse(16 * 16) is not None and bm.refuse(16) is None   # a window + pending rows cost blocks too
    with pytest.raises(DeepinferError, match="V4"):
        eng.add_request(prompt(300), SamplingParams(max_tokens=4))
    assert not bm.accepts(None)
    eng = engine(loaded)
    bm = eng.block_manager
    events = []
    eng.set_kv_event_sink(lambda kind, hashes: events.append((kind, list(hashes))))
    eng.generate([prompt(40)], SamplingParams(max_tokens=2, temperature=0.0))
    req = eng.new_request("probe", prompt(40), GREEDY)
    stored = [h for kind, hs in events if kind == "stored" for h in hs]
    assert stored == req.block_hashes[:2]   # the prompt's two full blocks: the snapshot at 32 covers both
    assert set(bm.cached) == set(stored) and bm.usage > 0
    bm.reset_prefix_cache()
    assert not bm.cached and bm.num_free_blocks == bm.num_blocks and events[-1][0] == "cleared"
