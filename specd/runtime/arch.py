"""What the lean forward needs to know of a decoder family: the few places where the families
users deploy differ from Llama (as gpt-fast's and vLLM's model descriptions do).

Every supported family is a pre-norm decoder of grouped-query attention with rotary positions
and a gated MLP. They differ in:

- norms: Llama's RMSNorm (`w * x`) or Gemma's (`(1 + w) * x`, in float32), and whether the
  attention and MLP outputs are normed too before the residual sum (Gemma's four norms a layer);
- q/k norms (Qwen3, Gemma 3): an RMSNorm over each head's query and key before rotation;
- biases on the projections (Qwen2's q/k/v; Llama's optional attention and MLP biases);
- the activation of the gate (SiLU, or GELU with the tanh approximation for Gemma);
- the attention's scale (Gemma: `query_pre_attn_scalar`), a soft cap on its scores (Gemma 2)
  and on the final logits (Gemma 2 and 3);
- sliding-window layers (Mistral, Qwen2 with `use_sliding_window`, Gemma's alternating local
  layers), a key visible to a query within `window` positions of it (transformers' rule);
- rotary tables: one per layer type (Gemma 3's local layers have a base of their own), of the
  whole head or a part of it (`partial_rotary_factor`), with any scaling transformers' rotary
  module applies (linear, dynamic, yarn, llama3, longrope; `specd.runtime.lean`).

`unsupported(model)` names what a model has that the runtime cannot compute exactly; a model it
returns None for runs on the lean forward, the KV pool, the graphs and tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# model_type -> family. gemma3_text is Gemma 3's text model (the 1B, or a text-only checkpoint);
# the multimodal gemma3 wraps a vision tower the runtime does not run.
FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "llama", "phi3": "llama",
            "gemma2": "gemma", "gemma3_text": "gemma"}
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class Arch:
    """One model's departures from Llama (see the module doc)."""

    model_type: str
    gemma_norm: bool  # (1 + w) * x in float32, Gemma's RMSNorm
    sandwich: bool  # the attention and MLP outputs are normed before the residual sum
    qk_norm: bool
    activation: str
    scaling: float  # of q . k
    attn_softcap: float | None
    final_softcap: float | None
    windows: tuple[int | None, ...]  # per layer: the sliding window, None for global attention
    rope_kinds: tuple[str | None, ...]  # per layer: the rotary module's layer type (Gemma 3), else None

    @property
    def plain_attention(self) -> bool:
        """Causal attention without a window or a cap: what the few-row attention operator computes."""
        return self.attn_softcap is None and all(w is None for w in self.windows)

    def act(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "silu":
            return torch.nn.functional.silu(x)
        return torch.nn.functional.gelu(x, approximate="tanh")


def _text_config(model: torch.nn.Module):
    return getattr(model, "config", None)


def unsupported(model: torch.nn.Module) -> str | None:
    """What keeps the lean forward from computing this model's own forward, or None."""
    config = _text_config(model)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        return (f"model type {model_type!r}: the runtime describes "
                f"{', '.join(sorted(FAMILIES))} (docs/deploy.md, 'Your own models')")
    if getattr(model, "hf_device_map", None):
        return "layers placed over several devices (--device shard); use --tensor-parallel"
    if getattr(config, "pretraining_tp", 1) != 1:
        return f"pretraining_tp {config.pretraining_tp}"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        return "mixture-of-experts layers"
    activation = getattr(config, "hidden_activation", None) or config.hidden_act
    if activation not in ACTIVATIONS:
        return f"activation {activation!r} (the runtime runs {', '.join(ACTIVATIONS)})"
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    if attention not in ("sdpa", "eager"):
        return f"attention implementation {attention!r} (sdpa or eager)"
    for params in _rope_parameters(config):
        rope_type = params.get("rope_type", "default")
        if rope_type not in ROPE_TYPES:
            return f"rotary scaling {rope_type!r} (the runtime applies {', '.join(ROPE_TYPES)})"
    if getattr(config, "layer_types", None) is not None:
        unknown = set(config.layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            return f"layer types {sorted(unknown)}"
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        return "no decoder layers where a causal LM keeps them (model.model.layers)"
    return None


def _rope_parameters(config) -> list[dict]:
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type (Gemma 3)
        return list(params.values())
    return [params]


def describe(model: torch.nn.Module) -> Arch:
    """The Arch of a model unsupported() accepts."""
    config = _text_config(model)
    gemma = FAMILIES[config.model_type] == "gemma"
    layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if layer_types is not None:
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    else:  # Mistral, Phi-3: every layer slides when the config sets a window
        windows = (window,) * layers
    rotary = model.model.rotary_emb
    kinds = tuple(layer_types) if hasattr(rotary, "layer_types") else (None,) * layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    scalar = getattr(config, "query_pre_attn_scalar", None) if gemma else None
    return Arch(
        model_type=config.model_type,
        gemma_norm=gemma,
        sandwich=gemma,
        qk_norm=hasattr(model.model.layers[0].self_attn, "q_norm"),
        activation=getattr(config, "hidden_activation", None) or config.hidden_act,
        scaling=(scalar if scalar is not None else head_dim) ** -0.5,
        attn_softcap=getattr(config, "attn_logit_softcapping", None),
        final_softcap=getattr(config, "final_logit_softcapping", None),
        windows=windows[:layers],
        rope_kinds=kinds[:layers],
    )
