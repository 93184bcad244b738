"""What Gemma 3 (text) is, as the loaders need it: its ``ModelConfig`` knobs from GGUF metadata or an HF config,
its GGUF tensor names, and its chat template when a file carries none.

The forward pass is ``shared/model/llama.py``'s ``LlamaModel`` driven by these knobs (the engine builds every
model through that one class). Facts checked against transformers 5.23 (``Gemma3TextConfig``, modeling_gemma3)
and llama.cpp (``LLM_ARCH_GEMMA3`` hparams, convert_hf_to_gguf.py ``Gemma3Model``):

- sliding-window layers: layer ``i`` slides iff ``(i + 1) % 6 != 0`` (five of every six; llama.cpp's
  ``set_swa_pattern(6)``, transformers' ``layer_types`` default); a GGUF ``attention.sliding_window_pattern``
  (an int period or one bool per layer) overrides it;
- RoPE: base ``rope.freq_base`` (1e6) and any ``rope.scaling`` on the full-attention layers; base 10,000 and no
  scaling on the sliding layers (``rope.freq_base_swa`` when the file has it);
- attention scale ``query_pre_attn_scalar ** -0.5``: llama.cpp takes the scalar to be ``head_dim``, except for the
  62-layer 27B model (``hidden / heads``); HF configs state it;
- norms scale by ``1 + w``; llama.cpp's converter stores ``1 + w`` in the GGUF, the loader subtracts 1 again
  (as transformers' GGUF loader does) so checkpoints keep HF's convention;
- embeddings times sqrt(hidden); tanh-GELU gated MLP; Q/K RMSNorm over head_dim before RoPE; four norms per
  layer; tied LM head; no logit soft-capping in Gemma 3 (a file or config asking for any is refused).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

SLIDING_WINDOW_PATTERN = 6
LOCAL_ROPE_THETA = 10000.0
END_OF_TURN = "<end_of_turn>"

# GGUF tensor name (after "blk.{i}.") -> HF name (after "model.layers.{i}."), where Gemma differs from LLaMA
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",  # on the attention output
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
GGUF_EXTRA_LAYER_TENSORS = ("attn_q_norm.weight", "attn_k_norm.weight", "post_attention_norm.weight",
                            "post_ffw_norm.weight")
# Gemma3TextConfig's defaults for the fields hf_loader reads (a saved config.json may leave them out)
HF_DEFAULTS = {"tie_word_embeddings": True, "head_dim": 256, "rms_norm_eps": 1e-6, "sliding_window": 4096,
               "max_position_embeddings": 131_072, "query_pre_attn_scalar": 256, "bos_token_id": 2,
               "eos_token_id": 1}
HF_EXTRA_LAYER_TENSORS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight", "pre_feedforward_layernorm.weight",
                          "post_feedforward_layernorm.weight")

# Gemma's turn format, written to render what the Gemma 3 -it models' own template renders for string contents (a
# leading system message is folded into the first user turn, roles must alternate, "assistant" is spelled "model");
# the 270M GGUF ships no template. Images and list contents are not supported.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def layer_windows(window: int | None, num_layers: int,
                  pattern: int | Sequence[bool] = SLIDING_WINDOW_PATTERN) -> tuple[int | None, ...]:
    """Per-layer sliding window: ``pattern`` is a period ``n`` (layer i slides iff ``(i + 1) % n``) or one bool per
    layer (True = sliding). No window (``None``/0) means full attention everywhere."""
    if not window:
        return (None,) * num_layers
    if isinstance(pattern, int):
        slides = [pattern <= 0 or bool((i + 1) % pattern) for i in range(num_layers)]
    else:
        slides = [bool(x) for x in pattern]
        if len(slides) != num_layers:
            raise ValueError(f"sliding-window pattern has {len(slides)} entries for {num_layers} layers")
    return tuple(int(window) if s else None for s in slides)


def common_knobs(hidden: int) -> dict[str, Any]:
    """The ``ModelConfig`` fields every Gemma 3 shares."""
    return dict(hidden_act="gelu_tanh", embed_scale=hidden ** 0.5, sandwich_norms=True, norm_weight_offset=1.0)


def gguf_knobs(get: Callable[[str], Any], *, hidden: int, heads: int, head_dim: int,
               num_layers: int) -> dict[str, Any]:
    """``ModelConfig`` fields from a ``gemma3`` GGUF; ``get(key)`` reads ``gemma3.{key}`` (None if absent).
    Raises ``ValueError`` for soft-capping, which Gemma 3 does not have and this model does not implement."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if get(key):
            raise ValueError(f"{key} = {get(key)} is not supported")
    pattern = get("attention.sliding_window_pattern")
    scalar = hidden / heads if num_layers == 62 else head_dim  # llama.cpp: the 27B model scales by hidden/heads
    return dict(common_knobs(hidden), query_pre_attn_scalar=float(scalar),
                rope_local_theta=float(get("rope.freq_base_swa") or LOCAL_ROPE_THETA),
                layer_sliding_windows=layer_windows(get("attention.sliding_window"), num_layers,
                                                    SLIDING_WINDOW_PATTERN if pattern is None else pattern))


def hf_knobs(raw: dict[str, Any]) -> dict[str, Any]:
    """``ModelConfig`` fields from a ``gemma3_text`` ``config.json`` (transformers 4.x or 5.x layout): Gemma knobs,
    per-layer windows, both RoPE bases and the global layers' scaling."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key):
            raise ValueError(f"{key} = {raw[key]} is not supported")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported")
    layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    pattern = [t == "sliding_attention" for t in types] if types else \
        int(raw.get("sliding_window_pattern", SLIDING_WINDOW_PATTERN))
    params = raw.get("rope_parameters") or {}
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    scaling = raw.get("rope_scaling") or {k: v for k, v in full.items() if k != "rope_theta"}
    kind = scaling.get("rope_type", scaling.get("type"))
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"scaled RoPE on sliding layers ({local['rope_type']}) is not supported")
    return dict(common_knobs(int(raw["hidden_size"])),
                query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
                rope_theta=float(full.get("rope_theta", raw.get("rope_theta", 1_000_000.0))),
                rope_local_theta=float(local.get("rope_theta", raw.get("rope_local_base_freq", LOCAL_ROPE_THETA))),
                rope_scaling=None if kind in (None, "default") else dict(scaling, rope_type=kind),
                layer_sliding_windows=layer_windows(raw.get("sliding_window"), layers, pattern))
