"""DeepSeekMoE feed-forward (DeepSeek V3, and V2's routing): routed experts chosen per token by a (group-limited)
top-k, plus shared experts every token goes through. Semantics are transformers' ``DeepseekV3MoE`` /
``DeepseekV2Moe``.

Invariants:
- Routing runs in float32 whatever the model dtype: ``scores = sigmoid(x @ gate^T)``; the choice ranks
  ``scores + e_score_correction_bias``; a group's score is the sum of its two best choices; a token picks its
  ``num_experts_per_tok`` experts among the ``topk_group`` best groups only. Its weights are the chosen experts'
  ``scores`` (not the biased ranks), renormalised to sum 1 when ``norm_topk_prob``, times
  ``routed_scaling_factor``. V2 (``scoring`` softmax): ``scores = softmax(x @ gate^T)``; ``greedy`` takes the
  top ``k`` scores, ``group_limited_greedy`` the top ``k`` within the ``topk_group`` groups whose best score is
  highest; weights are those scores, not renormalised, times ``routed_scaling_factor``.
- Execution is grouped by expert: the (token, slot) pairs are sorted by expert once, and each expert that
  received tokens runs one gated-MLP GEMM pair over all its rows (a loop over experts, never over tokens);
  results are scaled by the routing weight and summed into the output in expert order.
- ``expert_counts`` of the last call is kept (tokens per expert, ``[E]`` int64: the load of the last step) and
  ``expert_tokens`` sums them over every call (what ``/metrics`` exports, the signal an expert balancer needs).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.layer_ops import silu_mul
from shared.model.config import MixtureOfExperts
from shared.model.linear import linear


@dataclass(slots=True)
class MoEWeights:
    gate: torch.Tensor  # [E, hidden] float32 router
    bias: torch.Tensor  # [E] float32 e_score_correction_bias
    gate_up: torch.Tensor  # [E, 2 * I, hidden]: each expert's gate rows, then its up rows
    down: torch.Tensor  # [E, hidden, I]
    shared_gate_up: torch.Tensor  # [2 * I_shared, hidden] (prepared for ``linear``)
    shared_down: torch.Tensor  # [hidden, I_shared]


def route(x: torch.Tensor, w: MoEWeights, moe: MixtureOfExperts) -> tuple[torch.Tensor, torch.Tensor]:
    """``x: [T, hidden]`` → ``(weights [T, k] float32, experts [T, k] int64)``."""
    if moe.scoring == "softmax":
        return _route_v2(x, w, moe)
    scores = torch.sigmoid(x.float() @ w.gate.T)  # [T, E]
    choice = scores + w.bias
    grouped = choice.view(choice.shape[0], moe.n_group, -1)  # [T, G, E / G]
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(-1)  # [T, G]: each group's two best
    experts = choice.masked_fill(~_in_best_groups(group_scores, moe, choice.shape[1]), float("-inf")).topk(moe.num_experts_per_tok, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)  # [T, k]
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * moe.routed_scaling_factor, experts


def _in_best_groups(group_scores: torch.Tensor, moe: MixtureOfExperts, num_experts: int) -> torch.Tensor:
    """``[T, E]`` bool: the experts of each token's ``topk_group`` best groups (``group_scores: [T, G]``)."""
    groups = group_scores.topk(moe.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
    mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()  # [T, G]
    return mask.repeat_interleave(num_experts // moe.n_group, dim=1)


def _route_v2(x: torch.Tensor, w: MoEWeights, moe: MixtureOfExperts) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.softmax(x.float() @ w.gate.T, dim=-1)  # [T, E]
    if moe.topk_method == "group_limited_greedy":
        group_scores = scores.view(scores.shape[0], moe.n_group, -1).max(dim=-1).values  # [T, G]
        scores = scores.masked_fill(~_in_best_groups(group_scores, moe, scores.shape[1]), 0.0)
    weights, experts = scores.topk(moe.num_experts_per_tok, dim=-1, sorted=False)
    return weights * moe.routed_scaling_factor, experts


def gated_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              act: Callable[[torch.Tensor], torch.Tensor] = silu_mul) -> torch.Tensor:
    """``x: [T, hidden]`` → ``down(act(gate(x), up(x)))``, ``[T, hidden]`` (``act``: SiLU(gate) * up by default)."""
    return linear(act(linear(x, gate_up)), down)


Router = Callable[[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]


class MoE:
    """One DeepSeekMoE layer's forward over its weights (``__call__``). ``router(x, input_ids) -> (weights [T, k]
    float32, experts [T, k])`` and ``act`` (on ``[T, 2 I]`` gate-then-up rows) replace V3's routing and SiLU-mul
    for models that route otherwise (DeepSeek V4: ``shared/model/deepseek_v4.py``)."""

    def __init__(self, weights: MoEWeights, moe: MixtureOfExperts, router: Router | None = None,
                 act: Callable[[torch.Tensor], torch.Tensor] = silu_mul) -> None:
        self.w, self.moe, self.router, self.act = weights, moe, router, act
        self.expert_counts = torch.zeros(moe.n_routed_experts, dtype=torch.int64)
        self.expert_tokens = torch.zeros(moe.n_routed_experts, dtype=torch.int64)

    def __call__(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``x: [T, hidden]`` (``input_ids: [T]`` for a router that reads them) → ``[T, hidden]``."""
        weights, experts = route(x, self.w, self.moe) if self.router is None else self.router(x, input_ids)
        k = experts.shape[1]
        flat = experts.flatten()  # [T * k]: pair p is token p // k, slot p % k
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.moe.n_routed_experts)  # [E]
        self.expert_counts = counts
        self.expert_tokens += counts
        pair_weights = weights.flatten()  # [T * k] float32
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts.tolist()):
            if n == 0:
                continue
            pairs = order[start:start + n]
            start += n
            tokens = pairs // k
            h = self.act(x[tokens] @ self.w.gate_up[expert].T) @ self.w.down[expert].T  # [n, hidden]
            h = (h * pair_weights[pairs, None]).to(x.dtype)   # float32 weights, as transformers
            out.index_add_(0, tokens, h)
        return out + gated_mlp(x, self.w.shared_gate_up, self.w.shared_down, self.act)
