"""DeepSeek V4 decoder (``deepseek_v4``: V4-Flash / V4-Pro and their shape), computing over per-sequence
attention states (``shared/model/v4_state.py``) with transformers' ``DeepseekV4ForCausalLM`` semantics.

Per layer (``CompressedAttention`` in ``shared/model/config.py`` names every knob):
- mHC: the residual is ``hc_mult`` streams; a hyper-connection reads them (unweighted RMSNorm over all streams,
  one linear map) into ``pre`` (collapses the streams into the block's input), ``post`` (spreads the block's
  output back) and ``comb`` (mixes the streams; softmax, then Sinkhorn row/column normalisation), all float32;
- attention: queries ``q_b(norm(q_a(x)))`` per-head RMS-normed; one shared K=V row ``norm(wkv(x))`` per token;
  RoPE on the trailing ``rope_dim`` dims (interleaved pairs; ``compress`` base on CSA/HCA layers); keys = the
  window's rows + (CSA) the compressed entries the lightning indexer picks per query (top ``index_topk`` of
  ``sum_h w_h relu(q_h . k)``, causal; ties to the lowest entry) or (HCA) every complete compressed entry; a per-head sink logit in the
  softmax; the output's RoPE dims rotated back (conjugate rotation at the query position); grouped output
  projection ``wo_b(wo_a per group)``;
- compressors: per group of ``ratio`` tokens, ``norm(sum softmax(gate + ape) * kv)`` over the group (CSA: over
  two overlapping groups, the previous group's first-half series and this group's second half), RoPE at the
  group's first position;
- MoE in every layer: ``hash_moe`` experts from the frozen ``tid2eid[token]`` table, ``moe`` the top-k of
  ``scores + bias``; weights = the chosen ``scores`` (``sqrtsoftplus`` / ``sigmoid`` / ``softmax`` of the router
  logits) renormalised, times ``routed_scaling_factor``; SwiGLU with gate clipped at ``swiglu_limit`` from above
  and up to +-limit, for routed and shared experts;
- the final hyper head collapses the streams, then RMSNorm and the LM head.

Weights arrive in DeepSeek's checkpoint naming (what transformers saves: ``attn.wq_a``, ``attn.compressor.ape``,
``ffn.experts.<e>.w1`` ...; ``hf_weight_shapes``). Invariant: ``forward`` over chunks of a sequence in any split
equals one forward over the whole (the state carries everything; ``tests/model/test_deepseek_v4_tiny.py``).
Not yet served by the engine: it has no paged pools for these states (issue 32's next part).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shared.errors import DeepinferError, ErrorCode
from shared.model.config import V4_LAYER_TYPES, V4_MLP_LAYER_TYPES, CompressedAttention, MixtureOfExperts, ModelConfig
from shared.model.fingerprint import weights_digest
from shared.model.moe import MoE, MoEWeights
from shared.model.rope import inv_frequencies
from shared.model.v4_state import CompressorState, LayerState, V4SequenceState

HF_MODEL_TYPES = ("deepseek_v4",)
SLIDING, CSA, HCA = V4_LAYER_TYPES


def hf_knobs(raw: dict) -> dict:
    """``ModelConfig`` fields of a ``deepseek_v4`` ``config.json`` beyond the common ones."""
    n = int(raw["num_hidden_layers"])
    head_dim = int(raw["head_dim"])
    rope = raw.get("rope_parameters") or {}
    main, compress = rope.get("main") or {}, rope.get("compress") or {}
    rope_dim = int(raw.get("qk_rope_head_dim") or head_dim * float(main.get("partial_rotary_factor")
                                                                    or raw["partial_rotary_factor"]))
    rates = raw.get("compress_rates") or {}
    hash_layers = int(raw.get("num_hash_layers", 3))
    mlp_types = tuple(raw.get("mlp_layer_types") or ["hash_moe"] * hash_layers + ["moe"] * (n - hash_layers))

    def scaling(params: dict) -> dict | None:
        kind = params.get("rope_type", params.get("type", "default"))
        return None if kind == "default" else {k: v for k, v in params.items() if k != "partial_rotary_factor"}

    v4 = CompressedAttention(
        layer_types=tuple(raw["layer_types"]), mlp_layer_types=mlp_types, q_lora_rank=int(raw["q_lora_rank"]),
        rope_dim=rope_dim, sliding_window=int(raw["sliding_window"]), csa_ratio=int(rates.get(CSA, 4)),
        hca_ratio=int(rates.get(HCA, 128)),
        compress_rope_theta=float(compress.get("rope_theta", raw.get("compress_rope_theta", 160000.0))),
        compress_rope_scaling=scaling(compress), o_groups=int(raw["o_groups"]), o_lora_rank=int(raw["o_lora_rank"]),
        index_heads=int(raw["index_n_heads"]), index_head_dim=int(raw["index_head_dim"]),
        index_topk=int(raw["index_topk"]), hc_mult=int(raw["hc_mult"]), hc_sinkhorn_iters=int(raw["hc_sinkhorn_iters"]),
        hc_eps=float(raw["hc_eps"]), swiglu_limit=float(raw["swiglu_limit"]),
        n_routed_experts=int(raw["n_routed_experts"]), num_experts_per_tok=int(raw["num_experts_per_tok"]),
        scoring_func=str(raw.get("scoring_func", "sqrtsoftplus")),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)))
    if any(t not in V4_LAYER_TYPES for t in v4.layer_types) or any(t not in V4_MLP_LAYER_TYPES for t in mlp_types) \
            or len(v4.layer_types) != n or len(mlp_types) != n:
        raise ValueError(f"layer_types / mlp_layer_types must name one of {V4_LAYER_TYPES} / {V4_MLP_LAYER_TYPES} "
                         f"per layer ({n})")
    if v4.scoring_func not in _SCORES:
        raise ValueError(f"unsupported scoring_func {v4.scoring_func!r} (supported: {', '.join(_SCORES)})")
    return {"v4": v4, "num_kv_heads": 1, "head_dim": head_dim, "intermediate_size": int(raw["moe_intermediate_size"]),
            "rope_theta": float(main.get("rope_theta", raw.get("rope_theta", 10000.0))), "rope_scaling": scaling(main),
            "nextn_layers": int(raw.get("num_nextn_predict_layers") or 0)}


def hf_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a ``deepseek_v4`` checkpoint must have (checkpoint naming), with its shape."""
    v4, d, heads, hd = config.v4, config.hidden_size, config.num_heads, config.head_dim
    hc, f, e = v4.hc_mult, config.intermediate_size, v4.n_routed_experts
    mix = (2 + hc) * hc
    shapes = {"model.embed_tokens.weight": (config.vocab_size, d), "model.norm.weight": (d,),
              "head.weight": (config.vocab_size, d), "model.hc_head.hc_fn": (hc, hc * d), "model.hc_head.hc_base": (hc,),
              "model.hc_head.hc_scale": (1,)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        a = p + "attn."
        shapes.update({p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,), a + "attn_sink": (heads,),
                       a + "wq_a.weight": (v4.q_lora_rank, d), a + "q_norm.weight": (v4.q_lora_rank,),
                       a + "wq_b.weight": (heads * hd, v4.q_lora_rank), a + "wkv.weight": (hd, d), a + "norm.weight": (hd,),
                       a + "wo_a.weight": (v4.o_groups * v4.o_lora_rank, heads * hd // v4.o_groups),
                       a + "wo_b.weight": (d, v4.o_groups * v4.o_lora_rank)})
        for block in ("attn", "ffn"):
            shapes.update({f"{p}hc_{block}_fn": (mix, hc * d), f"{p}hc_{block}_base": (mix,),
                           f"{p}hc_{block}_scale": (3,)})
        kind = v4.layer_types[i]
        if kind != SLIDING:
            ratio, width = (v4.csa_ratio, 2 * hd) if kind == CSA else (v4.hca_ratio, hd)
            c = a + "compressor."
            shapes.update({c + "ape": (ratio, width), c + "norm.weight": (hd,), c + "wkv.weight": (width, d),
                           c + "wgate.weight": (width, d)})
        if kind == CSA:
            x, di = a + "indexer.", v4.index_head_dim
            shapes.update({x + "compressor.ape": (v4.csa_ratio, 2 * di), x + "compressor.norm.weight": (di,),
                           x + "compressor.wkv.weight": (2 * di, d), x + "compressor.wgate.weight": (2 * di, d),
                           x + "weights_proj.weight": (v4.index_heads, d),
                           x + "wq_b.weight": (v4.index_heads * di, v4.q_lora_rank)})
        g = p + "ffn."
        shapes[g + "gate.weight"] = (e, d)
        shapes[g + ("gate.tid2eid" if v4.mlp_layer_types[i] == "hash_moe" else "gate.bias")] = \
            (config.vocab_size, v4.num_experts_per_tok) if v4.mlp_layer_types[i] == "hash_moe" else (e,)
        for expert in [f"experts.{k}." for k in range(e)] + ["shared_experts."]:
            shapes.update({g + expert + "w1.weight": (f, d), g + expert + "w3.weight": (f, d),
                           g + expert + "w2.weight": (d, f)})
    return shapes


_SCORES = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid,
           "softmax": lambda x: torch.softmax(x, dim=-1)}


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``DeepseekV4RMSNorm``: normalise in float32, scale by the float32 weight, cast once."""
    xf = x.float()
    return (w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def _unweighted_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


@dataclass(slots=True)
class _Rope:
    """Interleaved-pair RoPE on the trailing ``dim`` dims, angles computed per call (V4's context is 1M tokens)."""
    inv_freq: torch.Tensor  # [dim / 2] float32
    scale: float

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq  # [T, dim / 2]
        return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x: [T, ..., D]``; ``cos, sin: [T, dim / 2]``: rotate pairs ``(2i, 2i + 1)`` of the last ``dim`` dims."""
        dim = 2 * cos.shape[-1]
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (dim,)
        c, s = cos.repeat_interleave(2, -1).view(shape), sin.repeat_interleave(2, -1).view(shape)
        nope, rope = x[..., :-dim], x[..., -dim:]
        half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
        return torch.cat([nope, ((rope.float() * c) + (half.float() * s)).to(x.dtype)], dim=-1)


@dataclass(slots=True)
class _Compressor:
    wkv: torch.Tensor  # [W, hidden]
    wgate: torch.Tensor  # [W, hidden]
    ape: torch.Tensor  # [ratio, W] float32
    norm: torch.Tensor  # [d] float32
    ratio: int
    overlap: bool  # CSA's two overlapping series (W = 2 d)


@dataclass(slots=True)
class _HyperConnection:
    fn: torch.Tensor  # [(2 + hc) * hc, hc * hidden] float32
    base: torch.Tensor  # [(2 + hc) * hc] float32
    scale: torch.Tensor  # [3] float32


@dataclass(slots=True)
class _Layer:
    kind: str
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    wq_a: torch.Tensor
    q_norm: torch.Tensor
    wq_b: torch.Tensor
    wkv: torch.Tensor
    kv_norm: torch.Tensor
    wo_a: torch.Tensor  # [groups, o_lora, heads * head_dim / groups]
    wo_b: torch.Tensor
    sinks: torch.Tensor  # [heads] float32
    hc_attn: _HyperConnection
    hc_ffn: _HyperConnection
    moe: MoE
    compressor: _Compressor | None = None
    indexer: _Compressor | None = None
    index_wq_b: torch.Tensor | None = None  # [index_heads * index_head_dim, q_lora]
    index_weights: torch.Tensor | None = None  # [index_heads, hidden]


@dataclass(frozen=True, slots=True)
class V4Chunk:
    """Rows ``[start, end)`` of a forward batch: the next tokens of the sequence whose state is ``state``. One
    sequence may have several consecutive chunks in a batch (the state advances through them in order: the same
    result as one chunk). ``snapshot``, an empty ``V4SequenceState``, receives the state as it stands right after
    this chunk (``V4SequenceState.snapshot``): a prefix-cache entry at a block boundary inside a longer step."""
    state: V4SequenceState
    start: int
    end: int
    snapshot: V4SequenceState | None = None


class DeepseekV4Model:
    """Inference-only DeepSeek V4 decoder (see the module docstring). Not an nn.Module."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device) -> None:
        if config.v4 is None:
            raise DeepinferError(ErrorCode.MODEL_CORRUPT, "a DeepSeek V4 config needs its compressed-attention knobs")
        self.config, self.dtype, self.device = config, dtype, device
        self.weights_digest = weights_digest(weights)
        v4 = config.v4

        def take(name: str, wide: bool = False) -> torch.Tensor:
            if name not in weights:
                raise DeepinferError(ErrorCode.MODEL_CORRUPT, f"checkpoint lacks tensor {name!r}")
            return weights[name].to(device=device, dtype=torch.float32 if wide else dtype).contiguous()

        self.embed = take("model.embed_tokens.weight")  # [V, hidden]
        self.lm_head = take("head.weight")  # [V, hidden]
        self.final_norm = take("model.norm.weight", wide=True)
        self.hc_head = _HyperConnection(take("model.hc_head.hc_fn", True), take("model.hc_head.hc_base", True),
                                        take("model.hc_head.hc_scale", True))
        moe = MixtureOfExperts(n_routed_experts=v4.n_routed_experts, n_shared_experts=1,
                               num_experts_per_tok=v4.num_experts_per_tok,
                               moe_intermediate_size=config.intermediate_size, first_k_dense_replace=0)
        self.layers = [self._layer(take, i, moe) for i in range(config.num_layers)]
        angle = torch.float32
        self.ropes = {
            "main": _Rope(*inv_frequencies(v4.rope_dim, config.rope_theta, config.rope_scaling,
                                           config.max_position_embeddings, angle)),
            "compress": _Rope(*inv_frequencies(v4.rope_dim, v4.compress_rope_theta, v4.compress_rope_scaling,
                                               config.max_position_embeddings, angle))}
        for rope in self.ropes.values():
            rope.inv_freq = rope.inv_freq.to(device)

    def _layer(self, take, i: int, moe: MixtureOfExperts) -> _Layer:
        v4 = self.config.v4
        p, kind = f"model.layers.{i}.", v4.layer_types[i]
        a, g = p + "attn.", p + "ffn."

        def hc(block: str) -> _HyperConnection:
            return _HyperConnection(take(f"{p}hc_{block}_fn", True), take(f"{p}hc_{block}_base", True),
                                    take(f"{p}hc_{block}_scale", True))

        def compressor(prefix: str, ratio: int, overlap: bool) -> _Compressor:
            return _Compressor(take(prefix + "wkv.weight"), take(prefix + "wgate.weight"), take(prefix + "ape", True),
                               take(prefix + "norm.weight", True), ratio, overlap)

        experts = [f"{g}experts.{k}." for k in range(v4.n_routed_experts)]
        weights = MoEWeights(
            gate=take(g + "gate.weight"), bias=take(g + "gate.bias", True) if v4.mlp_layer_types[i] == "moe" else
            torch.zeros(v4.n_routed_experts, device=self.device),
            gate_up=torch.stack([torch.cat([take(e + "w1.weight"), take(e + "w3.weight")]) for e in experts]),
            down=torch.stack([take(e + "w2.weight") for e in experts]),
            shared_gate_up=torch.cat([take(g + "shared_experts.w1.weight"), take(g + "shared_experts.w3.weight")]),
            shared_down=take(g + "shared_experts.w2.weight"))
        table = take(g + "gate.tid2eid").round().long() if v4.mlp_layer_types[i] == "hash_moe" else None
        groups = v4.o_groups
        layer = _Layer(
            kind=kind, attn_norm=take(p + "attn_norm.weight", True), ffn_norm=take(p + "ffn_norm.weight", True),
            wq_a=take(a + "wq_a.weight"), q_norm=take(a + "q_norm.weight", True), wq_b=take(a + "wq_b.weight"),
            wkv=take(a + "wkv.weight"), kv_norm=take(a + "norm.weight", True),
            wo_a=take(a + "wo_a.weight").view(groups, v4.o_lora_rank, -1), wo_b=take(a + "wo_b.weight"),
            sinks=take(a + "attn_sink", True), hc_attn=hc("attn"), hc_ffn=hc("ffn"),
            moe=MoE(weights, moe, router=self._router(weights, table), act=self._swiglu))
        if kind != SLIDING:
            ratio = v4.csa_ratio if kind == CSA else v4.hca_ratio
            layer.compressor = compressor(a + "compressor.", ratio, kind == CSA)
        if kind == CSA:
            layer.indexer = compressor(a + "indexer.compressor.", v4.csa_ratio, True)
            layer.index_wq_b, layer.index_weights = take(a + "indexer.wq_b.weight"), take(a + "indexer.weights_proj.weight")
        return layer

    def _router(self, w: MoEWeights, table: torch.Tensor | None):
        v4 = self.config.v4
        score = _SCORES[v4.scoring_func]

        def route(x: torch.Tensor, input_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
            scores = score(F.linear(x, w.gate))  # [T, E]
            if table is not None:   # hash routing: the token picks its experts
                experts = table[input_ids]
            else:
                experts = torch.topk(scores + w.bias, v4.num_experts_per_tok, dim=-1, sorted=False).indices
            weights = scores.gather(1, experts)
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
            return (weights * v4.routed_scaling_factor).float(), experts
        return route

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        limit = self.config.v4.swiglu_limit
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)

    def new_state(self) -> V4SequenceState:
        """The state of a sequence with no tokens yet."""
        v4, hd, dt, dev = self.config.v4, self.config.head_dim, self.dtype, self.device
        layers = []
        for layer in self.layers:
            state = LayerState(torch.zeros(0, hd, dtype=dt, device=dev))
            if layer.compressor is not None:
                width = layer.compressor.wkv.shape[0]
                state.compressor = CompressorState.empty(hd, width, dt, dev)
            if layer.indexer is not None:
                state.indexer = CompressorState.empty(v4.index_head_dim, 2 * v4.index_head_dim, dt, dev)
            layers.append(state)
        return V4SequenceState(layers)

    # -- the pieces -------------------------------------------------------------------------------------
    def _hyper(self, streams: torch.Tensor, hc: _HyperConnection) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams: [T, n, hidden]`` → ``(post [T, n], comb [T, n, n], collapsed [T, hidden])`` (float32 maps)."""
        v4, n = self.config.v4, self.config.v4.hc_mult
        mix = F.linear(_unweighted_norm(streams.flatten(1).float(), self.config.rms_norm_eps), hc.fn)
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = hc.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * hc.scale[0] + pre_b) + v4.hc_eps
        post = 2 * torch.sigmoid(post_w * hc.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * hc.scale[2] + comb_b.view(n, n), dim=-1) + v4.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + v4.hc_eps)
        for _ in range(v4.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + v4.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + v4.hc_eps)
        return post, comb, (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)

    def _compress(self, state: CompressorState, kv: torch.Tensor, gate: torch.Tensor, c: _Compressor) -> None:
        """Append the entries of the groups ``kv, gate: [n, W]`` complete (with the state's pending part)."""
        kv, gate = torch.cat([state.pending_kv, kv]), torch.cat([state.pending_gate, gate])
        usable = kv.shape[0] // c.ratio * c.ratio
        state.pending_kv, state.pending_gate = kv[usable:], gate[usable:]
        if not usable:
            return
        groups, d = usable // c.ratio, c.norm.shape[0]
        chunk_kv = kv[:usable].view(groups, c.ratio, -1)
        chunk_gate = gate[:usable].view(groups, c.ratio, -1) + c.ape
        if c.overlap:   # entry w mixes group w - 1's first series with group w's second
            mixed_kv = chunk_kv.new_zeros((groups, 2 * c.ratio, d))
            mixed_gate = chunk_gate.new_full((groups, 2 * c.ratio, d), float("-inf"))
            mixed_kv[:, c.ratio:], mixed_gate[:, c.ratio:] = chunk_kv[..., d:], chunk_gate[..., d:]
            mixed_kv[1:, :c.ratio], mixed_gate[1:, :c.ratio] = chunk_kv[:-1, :, :d], chunk_gate[:-1, :, :d]
            if state.overlap_kv is not None:
                mixed_kv[0, :c.ratio], mixed_gate[0, :c.ratio] = state.overlap_kv, state.overlap_gate
            state.overlap_kv, state.overlap_gate = chunk_kv[-1, :, :d].clone(), chunk_gate[-1, :, :d].clone()
            chunk_kv, chunk_gate = mixed_kv, mixed_gate
        entries = _norm((chunk_kv * chunk_gate.softmax(dim=1, dtype=torch.float32).to(chunk_kv.dtype)).sum(dim=1),
                        c.norm, self.config.rms_norm_eps)  # [groups, d]
        first = state.entries.shape[0]
        positions = (torch.arange(groups, device=entries.device) + first) * c.ratio
        cos, sin = self.ropes["compress"].tables(positions, entries.dtype)
        state.entries = torch.cat([state.entries, _Rope.apply(entries, cos, sin)])

    def _indexed(self, state: CompressorState, q: torch.Tensor, weights: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
        """``[n, entries]`` bool: the compressed entries each query picks (top-k indexer scores, causal)."""
        v4 = self.config.v4
        keys = state.entries  # [E, di]
        visible = torch.zeros(q.shape[0], keys.shape[0], dtype=torch.bool, device=q.device)
        if not keys.shape[0]:
            return visible
        scores = F.relu(torch.einsum("thd,ed->the", q.float(), keys.float())) * v4.index_head_dim ** -0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [n, E]
        threshold = (positions + 1) // v4.csa_ratio  # [n]: entries complete at each query
        entry = torch.arange(keys.shape[0], device=q.device)
        scores = scores.masked_fill(entry[None] >= threshold[:, None], float("-inf"))
        # the top k, ties (relu zeros) to the lowest index: a stable order makes the picks the same whether the
        # query runs in one forward beside later entries (masked) or alone at decode
        picks = scores.sort(dim=-1, descending=True, stable=True).indices[:, :min(v4.index_topk, keys.shape[0])]
        valid = picks < threshold[:, None]
        return visible.scatter_(1, picks, valid)

    def _attention(self, x: torch.Tensor, layer: _Layer, i: int, positions: torch.Tensor,
                   chunks: list[V4Chunk]) -> torch.Tensor:
        """``x: [T, hidden]`` (normed) → ``[T, hidden]``; updates each chunk's layer-``i`` state."""
        c, v4, eps = self.config, self.config.v4, self.config.rms_norm_eps
        heads, hd, window = c.num_heads, c.head_dim, v4.sliding_window
        rope = self.ropes["main" if layer.kind == SLIDING else "compress"]
        cos, sin = rope.tables(positions, x.dtype)
        q_res = _norm(F.linear(x, layer.wq_a), layer.q_norm, eps)  # [T, q_lora]
        q = _Rope.apply(_unweighted_norm(F.linear(q_res, layer.wq_b).view(-1, heads, hd), eps), cos, sin)
        kv = _Rope.apply(_norm(F.linear(x, layer.wkv), layer.kv_norm, eps), cos, sin)  # [T, hd]
        comp = layer.compressor
        if comp is not None:
            ckv, cgate = F.linear(x, comp.wkv), F.linear(x, comp.wgate)  # [T, W] each
        if layer.indexer is not None:
            idx = layer.indexer
            ikv, igate = F.linear(x, idx.wkv), F.linear(x, idx.wgate)
            icos, isin = self.ropes["compress"].tables(positions, x.dtype)
            iq = _Rope.apply(F.linear(q_res, layer.index_wq_b).view(-1, v4.index_heads, v4.index_head_dim), icos, isin)
            iw = F.linear(x, layer.index_weights).float() * v4.index_heads ** -0.5  # [T, index_heads]
        out = torch.empty_like(q)  # [T, H, hd]
        for ch in chunks:
            a, b, st = ch.start, ch.end, ch.state.layers[i]
            pos = positions[a:b]
            keys = torch.cat([st.window, kv[a:b]])  # [w + n, hd]
            key_pos = torch.arange(int(pos[0]) - st.window.shape[0], int(pos[-1]) + 1, device=x.device)
            st.window = keys[max(0, keys.shape[0] - (window - 1)):] if window > 1 else keys[:0]
            mask = (key_pos[None] <= pos[:, None]) & (key_pos[None] > pos[:, None] - window)  # [n, w + n]
            if comp is not None:
                self._compress(st.compressor, ckv[a:b], cgate[a:b], comp)
                entries = st.compressor.entries
                if layer.indexer is not None:
                    self._compress(st.indexer, ikv[a:b], igate[a:b], layer.indexer)
                    seen = self._indexed(st.indexer, iq[a:b], iw[a:b], pos)
                else:
                    seen = torch.arange(entries.shape[0], device=x.device)[None] < ((pos + 1) // comp.ratio)[:, None]
                keys, mask = torch.cat([keys, entries]), torch.cat([mask, seen], dim=1)
            if ch.snapshot is not None:
                ch.snapshot.layers.append(st.detached())
            logits = torch.einsum("thd,kd->htk", q[a:b], keys) * hd ** -0.5  # [H, n, K]
            logits = logits.masked_fill(~mask[None], float("-inf"))
            sinks = layer.sinks.to(logits.dtype).view(heads, 1, 1).expand(heads, b - a, 1)
            combined = torch.cat([logits, sinks], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            probs = torch.softmax(combined, dim=-1)[..., :-1]
            out[a:b] = torch.einsum("htk,kd->thd", probs.to(keys.dtype), keys)
        out = _Rope.apply(out, cos, -sin)  # the values' rotation undone at the query position
        grouped = out.reshape(out.shape[0], v4.o_groups, -1).transpose(0, 1)  # [g, T, H * hd / g]
        grouped = torch.bmm(grouped, layer.wo_a.transpose(1, 2)).transpose(0, 1).flatten(1)  # [T, g * o_lora]
        return F.linear(grouped, layer.wo_b)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,  # [T] int64 each
                chunks: list[V4Chunk], logits_indices: torch.Tensor) -> torch.Tensor:  # [S] → [S, V]
        """One step over ``chunks`` (each sequence's next tokens, contiguous rows, positions from its state's
        ``num_tokens``); the states advance past them."""
        covered: dict[int, int] = {}   # id(state) -> tokens it covers once the chunks before this one ran
        for ch in chunks:
            expected = covered.get(id(ch.state), ch.state.num_tokens)
            if int(positions[ch.start]) != expected:
                raise ValueError(f"a chunk starts at position {int(positions[ch.start])}, its state covers "
                                 f"{expected} tokens")
            covered[id(ch.state)] = expected + ch.end - ch.start
        eps, n = self.config.rms_norm_eps, self.config.v4.hc_mult
        streams = F.embedding(input_ids, self.embed).unsqueeze(1).expand(-1, n, -1).contiguous()  # [T, n, hidden]
        for i, layer in enumerate(self.layers):
            post, comb, collapsed = self._hyper(streams, layer.hc_attn)
            attn = self._attention(_norm(collapsed, layer.attn_norm, eps), layer, i, positions, chunks)
            streams = post.to(streams.dtype).unsqueeze(-1) * attn.unsqueeze(1) + \
                torch.matmul(comb.to(streams.dtype).transpose(-1, -2), streams)
            post, comb, collapsed = self._hyper(streams, layer.hc_ffn)
            mlp = layer.moe(_norm(collapsed, layer.ffn_norm, eps), input_ids)
            streams = post.to(streams.dtype).unsqueeze(-1) * mlp.unsqueeze(1) + \
                torch.matmul(comb.to(streams.dtype).transpose(-1, -2), streams)
        for ch in chunks:
            ch.state.num_tokens += ch.end - ch.start
            if ch.snapshot is not None:
                ch.snapshot.num_tokens = ch.state.num_tokens
        picked = streams[logits_indices]  # [S, n, hidden]
        flat = _unweighted_norm(picked.flatten(1).float(), eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_head.fn) * self.hc_head.scale + self.hc_head.base) + \
            self.config.v4.hc_eps
        h = (pre.unsqueeze(-1) * picked).sum(dim=1).to(picked.dtype)
        return F.linear(_norm(h, self.final_norm, eps), self.lm_head)
