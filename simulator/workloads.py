"""Synthetic workloads for the simulator, as ``TraceRequest`` lists (the Mooncake trace's format: arrival
seconds, token counts, chained prefix-block ids of ``block_size`` tokens).

``shifting_workload``: a mix that shifts from chat (short prompts on a shared system prompt, medium outputs:
decode-heavy) to long-input agent turns (a tool preamble plus large observations, short outputs:
prefill-heavy) and back to chat. Poisson arrivals at each phase's rate; a request continues one of a few
sessions, re-sending the session's history (a shareable prefix) plus new blocks.

``agent_workload``: tool-calling agent sessions resending a context that grows by a tool result and a short
answer per turn (the seed's 77K-token average input).

Invariants: the same arguments give the same list; ``idx`` runs 0.. in arrival order; ``len(hash_ids) ==
ceil(input_length / block_size)``; ids are chained (an id always stands at the same position of the same
prefix, so a seen id implies its whole prefix was seen), as in the Mooncake trace.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from simulator.trace import TraceRequest


@dataclass(frozen=True)
class Phase:
    """``kind`` "chat" or "agent" for ``duration_s`` seconds at ``rps`` requests per second."""
    kind: str
    duration_s: float
    rps: float


class _Sessions:
    """Sessions of one kind: each a chain of block ids; a turn appends blocks, a long one starts over."""

    def __init__(self, rng: random.Random, ids: list[int], preambles: list[tuple[int, ...]], count: int,
                 max_blocks: int) -> None:
        self.rng, self.ids, self.preambles, self.max_blocks = rng, ids, preambles, max_blocks
        self.chains = [self._fresh() for _ in range(count)]

    def _new_ids(self, n: int) -> tuple[int, ...]:
        out = tuple(range(self.ids[0], self.ids[0] + n))
        self.ids[0] += n
        return out

    def _fresh(self) -> tuple[int, ...]:
        return self.rng.choice(self.preambles)

    def turn(self, new_blocks: int) -> tuple[int, ...]:
        i = self.rng.randrange(len(self.chains))
        chain = self.chains[i]
        if len(chain) + new_blocks > self.max_blocks:
            chain = self._fresh()
        chain = chain + self._new_ids(new_blocks)
        self.chains[i] = chain
        return chain


def shifting_workload(chat_s: float = 120.0, agent_s: float = 120.0, chat_rps: float = 32.0,
                      agent_rps: float = 3.0, seed: int = 0, block_size: int = 512,
                      phases: tuple[Phase, ...] | None = None) -> list[TraceRequest]:
    """Chat for ``chat_s`` s at ``chat_rps``, agent turns for ``agent_s`` s at ``agent_rps``, chat again for
    ``chat_s`` s (or the given ``phases``). Chat: a 2-block system prompt shared by all, 1-2 new blocks a
    turn (history up to 16 blocks), 256-1024 output tokens. Agent: one of 4 tool preambles of 12 blocks, 16-48
    new blocks a turn (history up to 96 blocks), 8-64 output tokens."""
    if phases is None:
        phases = (Phase("chat", chat_s, chat_rps), Phase("agent", agent_s, agent_rps), Phase("chat", chat_s, chat_rps))
    if any(p.kind not in ("chat", "agent") or p.duration_s < 0 or p.rps < 0 for p in phases):
        raise ValueError(f"invalid phases {phases}")
    rng = random.Random(seed)
    ids = [0]  # the next fresh block id, shared by every session
    system = tuple(range(2))
    ids[0] = 2
    tools = []
    for _ in range(4):
        tools.append(tuple(range(ids[0], ids[0] + 12)))
        ids[0] += 12
    chat = _Sessions(rng, ids, [system], count=64, max_blocks=16)
    agent = _Sessions(rng, ids, tools, count=24, max_blocks=96)
    out: list[TraceRequest] = []
    t0 = 0.0
    for phase in phases:
        t = t0
        while phase.rps > 0:
            t += rng.expovariate(phase.rps)
            if t >= t0 + phase.duration_s:
                break
            if phase.kind == "chat":
                chain, output = chat.turn(rng.randint(1, 2)), rng.randint(256, 1024)
            else:
                chain, output = agent.turn(rng.randint(16, 48)), rng.randint(8, 64)
            length = len(chain) * block_size - rng.randrange(block_size)  # the last block is partial
            out.append(TraceRequest(len(out), round(t, 6), length, output, chain))
        t0 += phase.duration_s
    return out


def agent_workload(duration_s: float = 600.0, sessions_per_s: float = 0.2, seed: int = 0, block_size: int = 512,
                   preamble_blocks: int = 16, mean_turns: float = 34.0, max_context: int = 180_000,
                   think_s: float = 4.0) -> list[TraceRequest]:
    """Tool-calling agent sessions, the seed's workload: sessions start as a Poisson stream of ``sessions_per_s``
    for ``duration_s`` seconds, each on one of 4 agent types' shared tool preambles (``preamble_blocks``
    blocks) plus a 1-4 block task. Every turn resends the whole context; the model answers 32-256 tokens, then,
    after a think / tool time (exponential, mean ``think_s`` seconds, counted from the request's arrival), the
    tool result (1,024-8,192 tokens) and the answer are appended and the next turn is sent. A session ends after a
    geometric number of turns (mean ``mean_turns``) or when its context would pass ``max_context``. With the
    defaults the mean input is near the seed's 77K tokens (``tests/unit/test_agent_workload.py``).

    Invariants (as ``shifting_workload``): the same arguments give the same list; ``idx`` runs 0.. in arrival
    order; ``len(hash_ids) == ceil(input_length / block_size)``; ids are chained: a turn's ids extend its
    session's previous turn's, except the previous last block when it was partial (its content grew: a new id)."""
    rng = random.Random(seed)
    next_id = [4 * preamble_blocks]

    def fresh(n: int) -> list[int]:
        out = list(range(next_id[0], next_id[0] + n))
        next_id[0] += n
        return out

    preambles = [list(range(k * preamble_blocks, (k + 1) * preamble_blocks)) for k in range(4)]
    turns: list[tuple[float, int, int, tuple[int, ...]]] = []
    t = 0.0
    while True:
        t += rng.expovariate(sessions_per_s)
        if t >= duration_s:
            break
        tokens = preamble_blocks * block_size + rng.randint(1, 4) * block_size - rng.randrange(block_size)
        ids = preambles[rng.randrange(4)] + fresh(-(-tokens // block_size) - preamble_blocks)
        arrival = t
        while True:
            output = rng.randint(32, 256)
            turns.append((arrival, tokens, output, tuple(ids)))
            grown = tokens + output + rng.randint(1024, 8192)
            if grown > max_context or rng.random() < 1.0 / mean_turns:
                break
            full = tokens // block_size   # blocks whose tokens stay as they were
            ids = ids[:full] + fresh(-(-grown // block_size) - full)
            tokens = grown
            arrival += rng.expovariate(1.0 / think_s) if think_s > 0 else 0.0
    turns.sort(key=lambda r: r[0])
    return [TraceRequest(i, round(a, 6), n, out, ids) for i, (a, n, out, ids) in enumerate(turns)]
