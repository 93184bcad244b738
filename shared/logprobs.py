"""Log-probabilities a request asked for: of each generated token (``Sampling.logprobs``) and of each prompt token
after the first (``Sampling.prompt_logprobs``), each with the top ``k`` alternatives of its position.

Which distribution: the model's raw one, ``log_softmax`` of the logits before any logits processor, temperature
or truncation (vLLM v1's default, ``raw_logprobs``), so the values do not depend on how the token was chosen and
equal a plain forward pass of the model (HF transformers' ``log_softmax(logits)``). Computed in float32.

Invariants: the three lists of a ``Logprobs`` have one entry per token, in order; every ``top_ids[i]`` holds
``k`` ids, most likely first, with ``top_logprobs[i]`` their values. The object travels
in ``TokenChunk``s, one entry per token the chunk carries (prompt entries: on the first chunk only), so what a
client receives is bounded like the tokens themselves; ``MAX_PROMPT_LOGPROB_ENTRIES`` bounds the prompt's.
"""
from __future__ import annotations

import torch

from shared.errors import invalid
from shared.wire_validation import WireModel, wire_field, wire_message

MAX_PROMPT_LOGPROB_ENTRIES = 32_768   # prompt tokens x (1 + k) on one chunk: ~0.5 MB of msgpack at most


@wire_message(1 << 20)
class Logprobs(WireModel):
    """``token_logprobs[i]``: the log-probability of token ``i``; ``top_ids[i]`` / ``top_logprobs[i]``: the ``k``
    most likely tokens of its position and theirs; ``ranks[i]``: token ``i``'s rank in its position's
    distribution (1: the most likely; vLLM's ``prompt_logprobs`` shows it), or empty when not computed."""
    token_logprobs: list[float] = wire_field(default_factory=list, max_len=1 << 17)
    top_ids: list[list[int]] = wire_field(default_factory=list, max_len=1 << 17)
    top_logprobs: list[list[float]] = wire_field(default_factory=list, max_len=1 << 17)
    ranks: list[int] = wire_field(default_factory=list, max_len=1 << 17)

    def _check(self) -> None:
        if not len(self.token_logprobs) == len(self.top_ids) == len(self.top_logprobs) or \
                len(self.ranks) not in (0, len(self.token_logprobs)):
            raise invalid("field 'logprobs': token_logprobs, top_ids, top_logprobs (and ranks) need one entry per "
                          "token")

    def __len__(self) -> int:
        return len(self.token_logprobs)

    def head(self, n: int) -> "Logprobs":
        """The entries of the first ``n`` tokens."""
        return Logprobs(token_logprobs=self.token_logprobs[:n], top_ids=self.top_ids[:n],
                        top_logprobs=self.top_logprobs[:n], ranks=self.ranks[:n])

    def extend(self, other: "Logprobs") -> None:
        self.token_logprobs.extend(other.token_logprobs)
        self.top_ids.extend(other.top_ids)
        self.top_logprobs.extend(other.top_logprobs)
        self.ranks.extend(other.ranks)


def of_tokens(logits: torch.Tensor, tokens: list[int], k: int, ranks: bool = False) -> Logprobs:
    """``logits: [N, V]`` (raw: before processors) and the ``N`` tokens chosen at those positions -> their
    ``Logprobs`` with the top ``k`` (0: none) of each position; with ``ranks`` each token's rank too (1 + the
    number of tokens more likely than it)."""
    lp = torch.log_softmax(logits.float(), dim=-1)                                     # [N, V]
    chosen = lp.gather(1, torch.as_tensor(tokens, dtype=torch.long, device=lp.device)[:, None])[:, 0]
    if k > 0:
        values, ids = torch.topk(lp, k, dim=-1)                                         # [N, k], sorted
        top_ids, top_lps = ids.tolist(), values.tolist()
    else:
        top_ids, top_lps = [[] for _ in tokens], [[] for _ in tokens]
    rank = ((lp > chosen[:, None]).sum(-1) + 1).tolist() if ranks else []
    return Logprobs(token_logprobs=chosen.tolist(), top_ids=top_ids, top_logprobs=top_lps, ranks=rank)
