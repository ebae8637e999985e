"""A lean forward for Llama-architecture targets: the same arithmetic as transformers' Llama
forward, without its per-call machinery.

A one-token step of the embedded 135M model spends about a third of its time outside the
matrix products (docs/engine.md, "The lean forward"): transformers' module calls, mask and
rotary-table construction on every call, and a KV cache that grows by `torch.cat`. This
forward runs the same operations in the same order on the same weights, so its logits are
the ones transformers computes, and cuts the rest:

- q/k/v and gate/up are each one matrix product (their weights concatenated once, packed for
  oneDNN where the model's linears are), so 4 products per layer instead of 7;
- the rotary cos/sin rows are computed once per position, with transformers' formula;
- keys/values live in buffers that grow by doubling (`FlatCache`), so a step writes its own
  columns instead of copying the whole cache;
- the causal mask of a window is built once per call, not once per layer.

`FlatCache` has the part of DynamicCache's surface the rest of specd uses (`layers[i].keys`,
`.values`, `update`, `crop`, `get_seq_length`), so KV sessions, draft trees and batched
verification treat it like any cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specd.errors import InvalidRequest
from specd.models import rows
from specd.models.kernels import PackedLinear, RowsLinear, onednn_available, single_row

FORWARDS = ("auto", "lean", "hf")
_MIN_CAPACITY = 256


class _LayerView:
    """One layer's cached keys/values, as views of the live prefix of its buffers."""

    __slots__ = ("_cache", "_i")

    def __init__(self, cache: FlatCache, i: int):
        self._cache, self._i = cache, i

    @property
    def keys(self) -> torch.Tensor:
        return self._cache.k[self._i][:, :, :self._cache.lens[self._i]]

    @property
    def values(self) -> torch.Tensor:
        return self._cache.v[self._i][:, :, :self._cache.lens[self._i]]


class FlatCache:
    """Per-layer key/value buffers [1, kv_heads, capacity, head_dim] that grow by doubling."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        self.shape = (1, kv_heads, 0, head_dim)
        self.dtype, self.device = dtype, device
        self.k: list[torch.Tensor] = [self._empty(0) for _ in range(num_layers)]
        self.v: list[torch.Tensor] = [self._empty(0) for _ in range(num_layers)]
        self.lens = [0] * num_layers
        self.layers = [_LayerView(self, i) for i in range(num_layers)]

    def _empty(self, capacity: int) -> torch.Tensor:
        b, h, _, d = self.shape
        with torch.inference_mode(False):  # a normal tensor: batched verification writes it outside
            return torch.empty((b, h, capacity, d), dtype=self.dtype, device=self.device)

    def _reserve(self, i: int, length: int) -> None:
        capacity = self.k[i].shape[2]
        if length <= capacity:
            return
        capacity = max(_MIN_CAPACITY, 2 * capacity, length)
        for bufs in (self.k, self.v):
            grown = self._empty(capacity)
            grown[:, :, :self.lens[i]] = bufs[i][:, :, :self.lens[i]]
            bufs[i] = grown

    def update(self, keys: torch.Tensor, values: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append keys/values [1, kv_heads, T, head_dim] to layer i; its whole cached keys/values."""
        start = self.lens[i]
        end = start + keys.shape[2]
        self._reserve(i, end)
        self.k[i][:, :, start:end] = keys
        self.v[i][:, :, start:end] = values
        self.lens[i] = end
        return self.k[i][:, :, :end], self.v[i][:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.lens[layer_idx]

    def nbytes(self) -> int:
        """Bytes held by the buffers (their capacity, not only the cached prefix)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def crop(self, max_length: int) -> None:
        """Keep the first max_length positions (a negative value removes that many)."""
        if max_length < 0:
            max_length = self.lens[0] + max_length
        self.lens = [min(n, max_length) for n in self.lens]


def check_forward(forward: str) -> None:
    if forward not in FORWARDS:
        raise InvalidRequest("forward", f"unknown forward {forward!r} ({', '.join(FORWARDS)})")


def choose_forward(model: torch.nn.Module, forward: str, device: torch.device) -> str:
    """lean or hf. auto: lean for a supported float32 model on the CPU, where it computes
    transformers' logits bit for bit (tests/specd/models/test_lean.py) and is faster; hf
    elsewhere until it has been measured there (a GPU; bfloat16, where the fused products
    round differently)."""
    check_forward(forward)
    if forward == "lean" and not supports(model):
        raise InvalidRequest("forward", "lean needs a plain Llama model on one device (rotary "
                                        "embeddings without scaling, no biases, SiLU, SDPA attention)")
    if forward == "auto":
        weight = model.get_input_embeddings().weight
        plain = device.type == "cpu" and weight.dtype == torch.float32
        return "lean" if plain and supports(model) else "hf"
    return forward


def supports(model: torch.nn.Module) -> bool:
    """Whether the lean forward computes what this model's own forward computes: a Llama causal
    LM on one device, with plain rotary embeddings, no biases, SiLU and SDPA attention."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) != "llama":
        return False
    if getattr(model, "hf_device_map", None):
        return False
    rope = getattr(config, "rope_parameters", None) or {}
    return (rope.get("rope_type", "default") == "default" and not config.attention_bias
            and not config.mlp_bias and config.hidden_act == "silu"
            and getattr(config, "_attn_implementation", "sdpa") == "sdpa"
            and getattr(config, "pretraining_tp", 1) == 1)


def _fused(layers: list[torch.nn.Linear]):
    """One product whose output is the given linears' outputs side by side. With the few-row
    product (RowsLinear) each linear's own weight is read, all of them in one pass of the
    operator (rows.linear_cat), as when the forward is traced for compilation
    (specd.models.aot); where single rows run unpacked (PackedLinear._gemv), torch's products.
    With oneDNN kernels only the packed copy is kept (the lean forward runs in inference mode
    only)."""
    parts = [m.weight.detach() for m in layers]
    few_rows = isinstance(layers[0], RowsLinear)

    def separate(x: torch.Tensor) -> torch.Tensor:
        if (few_rows or torch.compiler.is_compiling()) and not torch.is_grad_enabled():
            return rows.linear_cat(x, parts)
        return torch.cat([F.linear(x, w) for w in parts], dim=-1)
    if few_rows:  # no concatenated copy to keep
        separate.weight = None
        return separate
    if (isinstance(layers[0], PackedLinear) and onednn_available() and parts[0].dtype == torch.float32
            and parts[0].device.type == "cpu"):
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat(parts, dim=0), None)
        gemv = layers[0]._gemv

        def fused(x: torch.Tensor) -> torch.Tensor:
            if torch.compiler.is_compiling() or (gemv and single_row(x)):  # MKL's products, measured faster for one row
                return separate(x)
            return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        fused.weight = None  # only the packed copy is kept
        return fused
    weight = torch.cat(parts, dim=0)

    def plain(x: torch.Tensor) -> torch.Tensor:
        return separate(x) if torch.compiler.is_compiling() else F.linear(x, weight)
    plain.weight = weight  # the concatenated weight, for the pool's batched matrix-vector products
    return plain


class LeanLlama:
    """The lean forward of one transformers Llama model (reads its weights; copies q/k/v and
    gate/up once, concatenated). Call `forward` as a specd ForwardFn.

    layers: the decoder layers to run (default the model's own); an early-exit drafter passes
    the target's first k layers and its adapter layer, and reads `hidden`, the final-normed
    state, instead of the logits."""

    def __init__(self, model: torch.nn.Module, layers: list[torch.nn.Module] | None = None):
        assert supports(model), "lean forward: not a plain Llama model"
        config = model.config
        inner = model.model
        self.model = model
        self.decoder_layers = list(inner.layers if layers is None else layers)
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.lm_head = model.lm_head
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.groups = self.heads // self.kv_heads
        self.scaling = self.head_dim ** -0.5
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        self._sources = [(layer.self_attn, layer.mlp) for layer in self.decoder_layers]
        self._fuse()
        self.inv_freq = inner.rotary_emb.inv_freq
        self.rope_scale = inner.rotary_emb.attention_scaling

    def _fuse(self) -> None:
        self.layers = []
        for layer in self.decoder_layers:
            a, m = layer.self_attn, layer.mlp
            qkv, gate_up = _fused([a.q_proj, a.k_proj, a.v_proj]), _fused([m.gate_proj, m.up_proj])
            self.layers.append((layer.input_layernorm, qkv, a.o_proj, layer.post_attention_layernorm, gate_up,
                                m.down_proj))
        self._fused_from = self._stamps()
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        self._cos = self._sin = torch.empty(0, self.head_dim, dtype=self.dtype, device=self.device)

    def _stamps(self) -> list[tuple]:
        """What the fused copies were made from: each source weight's storage, dtype and
        in-place version (an inference tensor has none; nothing here writes weights in
        inference mode)."""
        return [(p.weight.data_ptr(), p.weight.dtype, -1 if p.weight.is_inference() else p.weight._version)
                for a, m in self._sources for p in (a.q_proj, a.k_proj, a.v_proj, m.gate_proj, m.up_proj)]

    def _refresh(self) -> None:
        if self._stamps() != self._fused_from:  # a source weight was replaced, converted or changed
            self._fuse()

    def new_cache(self) -> FlatCache:
        """An empty cache for a new session; the fused weights are checked against the model's
        here, once per session, not on every step."""
        self._refresh()
        return FlatCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device)

    def _rope(self, past: int, t: int, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, head_dim] for the new tokens, as LlamaRotaryEmbedding computes them: at
        past .. past + t - 1, or at the given positions (a draft tree's, never beyond those)."""
        need = past + t
        if need > self._cos.shape[0]:
            n = max(need, 2 * self._cos.shape[0], 512)
            pos = torch.arange(n, device=self.device, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq.to(device=self.device, dtype=torch.float)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos = (emb.cos() * self.rope_scale).to(self.dtype)
            self._sin = (emb.sin() * self.rope_scale).to(self.dtype)
        if positions is None:
            return self._cos[past:need], self._sin[past:need]
        return self._cos[positions], self._sin[positions]

    @staticmethod
    def _rms(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + norm.variance_epsilon)
        return norm.weight * h.to(dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos) + (rotated * sin)

    def forward(self, input_ids: torch.Tensor, cache: FlatCache, num_logits: int, want_hidden: bool,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None):
        h = self.hidden(input_ids, cache, num_logits, attention_mask, position_ids)
        logits = self.lm_head(h)
        return logits[0], (h[0] if want_hidden else None)

    def hidden(self, input_ids: torch.Tensor, cache: FlatCache, num_logits: int,
               attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The final-normed hidden states [1, num_logits, H] of the last positions."""
        assert input_ids.shape[0] == 1, "the lean forward runs one sequence"
        past = cache.lens[0]
        t = input_ids.shape[1]
        cos, sin = self._rope(past, t, None if position_ids is None else position_ids[0])
        cos, sin = cos[None, None], sin[None, None]  # [1, 1, T, D]
        mask = attention_mask
        if mask is None and t > 1:  # causal over the cache and the window, what transformers builds
            mask = torch.ones(t, past + t, dtype=torch.bool, device=self.device).tril(past)[None, None]
        h = self.embed(input_ids)
        for i, (norm_in, qkv_proj, o_proj, norm_post, gate_up_proj, down_proj) in enumerate(self.layers):
            x = self._rms(norm_in, h)
            qkv = qkv_proj(x)
            q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
            q = q.view(1, t, self.heads, self.head_dim).transpose(1, 2)
            k = k.view(1, t, self.kv_heads, self.head_dim).transpose(1, 2)
            v = v.view(1, t, self.kv_heads, self.head_dim).transpose(1, 2)
            q = self._rotate(q, cos, sin)
            k = self._rotate(k, cos, sin)
            keys, values = cache.update(k, v, i)
            # SDPA shares each KV head among its query heads (enable_gqa). For a window
            # transformers repeats the KV heads instead; the result is the same to the bit
            # (tests/specd/models/test_lean.py) without copying the whole cache on every layer.
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling,
                                                 enable_gqa=self.groups > 1)
            out = out.transpose(1, 2).reshape(1, t, self.q_size)
            h = h + o_proj(out)
            x = self._rms(norm_post, h)
            gate_up = gate_up_proj(x)
            gate, up = gate_up.chunk(2, dim=-1)
            h = h + down_proj(F.silu(gate) * up)
        return self._rms(self.norm, h[:, -num_logits:])
