"""DeepSeek V3's multi-token-prediction (MTP, ``num_nextn_predict_layers``) module as a model of its own.

The module of depth 1 (checkpoint layer ``num_hidden_layers``) predicts the token after next: for row ``i`` it
takes the target's last hidden state ``h_i`` (the residual stream after the last decoder layer, before the final
norm; the state that predicted ``x_{i+1}``) and the embedding of ``x_{i+1}``, and computes

    x = eh_proj([enorm(embed(x_{i+1})), hnorm(h_i)])        # [T, 2 * hidden] -> [T, hidden]
    h'_i = decoder_layer(x)                                 # MLA + MoE (or dense) at row i's position, own KV
    logits = shared_head(final_norm_mtp(h'_i))              # a distribution over x_{i+2}

(the concatenation order is the released checkpoints': embedding first). Chained drafting feeds ``h'_i`` as the
previous hidden state of the next row, as SGLang and vLLM run one MTP module for several drafted tokens.

Invariants:
- The module shares the model's embedding and output head (the DeepSeek-V3 report's design): the checkpoint's
  copies under the MTP layer are never read, and no tensor of the target is copied.
- Its decoder layer is a ``DeepseekV3Model`` of one layer (MoE exactly when the layer's index is at or past
  ``first_k_dense_replace``), so its KV is one latent row per token in the target's layout and every attention
  path (chunked rows over a paged cache, decode rows) is the target's own code.
- ``forward`` is a function of its inputs and the paged KV of earlier rows only; it returns the logits at the
  rows asked for and ``h'`` at the same rows (the next chained row's previous hidden state).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kernels.layer_ops import rms_norm
from shared.errors import invalid
from shared.model.attention import AttentionMetadata
from shared.model.deepseek import DeepseekV3Model, is_moe_layer
from shared.model.linear import linear, prepare_weight


class MultiTokenPredictor:
    """The MTP module of ``depth`` (0 = the first) of a loaded ``DeepseekV3Model`` (see the module docstring).

    Offers what a draft model offers ``DraftStates`` (``config`` of one latent-KV layer, ``dtype``, ``device``)."""

    def __init__(self, target: DeepseekV3Model, depth: int = 0) -> None:
        c = target.config
        if not 0 <= depth < c.nextn_layers or not target.nextn_weights:
            raise invalid(f"{c.model_id} has no MTP layer {depth} (its checkpoint has {c.nextn_layers} next-n "
                          "prediction layers); --drafter mtp needs a DeepSeek V3 checkpoint that ships them")
        index = c.num_layers + depth
        p = f"model.layers.{index}."
        raw = target.nextn_weights
        weights = {"model.layers.0." + name[len(p):]: t for name, t in raw.items() if name.startswith(p)}
        weights["model.embed_tokens.weight"] = target.embed
        weights["model.norm.weight"] = raw[p + "shared_head.norm.weight"]
        moe = c.moe
        if moe is not None:  # the layer's own MoE-or-dense choice, as layer 0 of a one-layer model
            moe = dataclasses.replace(moe, first_k_dense_replace=0 if is_moe_layer(c, index) else 1)
        config = dataclasses.replace(c, num_layers=1, layer_sliding_windows=(None,), moe=moe, nextn_layers=0,
                                     tie_word_embeddings=True, model_id=f"{c.model_id}:mtp{depth}")
        self.block = DeepseekV3Model(config, weights, target.dtype, target.device, lm_head=target.lm_head)
        self.block.keep_hidden = True
        self.config, self.dtype, self.device = config, target.dtype, target.device

        def take(name: str) -> torch.Tensor:
            return raw[name].to(device=target.device, dtype=target.dtype).contiguous()

        self.enorm, self.hnorm = take(p + "enorm.weight"), take(p + "hnorm.weight")  # [hidden] each
        self.eh_proj = prepare_weight(take(p + "eh_proj.weight"))  # [hidden, 2 * hidden]

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor,  # [T] int64 each: x_{i+1} and its row's position
        meta: AttentionMetadata, kv_cache: torch.Tensor,  # the module's own paged KV: one layer of latents
        logits_indices: torch.Tensor,  # [S] int64
        prev_hidden: torch.Tensor,  # [T, hidden]: h_i (the target's, or the previous chained row's h')
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [S, V], h' [S, hidden]
        eps = self.config.rms_norm_eps
        e = rms_norm(F.embedding(input_ids, self.block.embed), self.enorm, eps)  # [T, hidden]
        x = linear(torch.cat([e, rms_norm(prev_hidden.contiguous(), self.hnorm, eps)], dim=-1), self.eh_proj)
        logits = self.block.forward(input_ids, positions, meta, kv_cache, logits_indices, embeds=x)
        return logits, self.block.last_hidden[logits_indices]
