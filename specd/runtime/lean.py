"""A lean forward for the decoder families specd serves (Llama 2/3, Mistral, Qwen2/2.5/3,
Gemma 2/3, Phi-3; specd.runtime.arch says where they differ): the same arithmetic as
transformers' forward of the model, without its per-call machinery.

A one-token step of the embedded 135M model spends about a third of its time outside the
matrix products (docs/engine.md, "The lean forward"): transformers' module calls, mask and
rotary-table construction on every call, and a KV cache that grows by `torch.cat`. This
forward runs the same operations in the same order on the same weights, so its logits are
the ones transformers computes, and cuts the rest:

- q/k/v and gate/up are each one matrix product (their weights concatenated once, packed for
  oneDNN where the model's linears are), so 4 products per layer instead of 7;
- the rotary cos/sin rows are computed once per position, by the model's own rotary module
  (so every scaling transformers implements is the model's own); a scaling that depends on
  the sequence's length (dynamic, longrope) is applied per position, as transformers applies
  it when decoding one token at a time, so a position's keys do not depend on how the
  sequence was split into forwards (which speculation changes);
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
from specd.runtime import rows
from specd.runtime.arch import Arch, describe, unsupported
from specd.runtime.kernels import PackedLinear, RowsLinear, onednn_available, single_row

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
    transformers' logits (bit for bit for Llama, tests/specd/runtime/test_lean.py) and is
    faster; hf elsewhere until it has been measured there (a GPU; bfloat16, where the fused
    products round differently). A GPU's sessions run in the KV pool either way."""
    check_forward(forward)
    if forward == "lean" and not supports(model):
        raise InvalidRequest("forward", f"the lean forward cannot run this model: {unsupported(model)}")
    if forward == "auto":
        weight = model.get_input_embeddings().weight
        plain = device.type == "cpu" and weight.dtype == torch.float32
        return "lean" if plain and supports(model) else "hf"
    return forward


def supports(model: torch.nn.Module) -> bool:
    """Whether the lean forward computes what this model's own forward computes
    (specd.runtime.arch.unsupported names what it lacks)."""
    return unsupported(model) is None


def _fused(layers: list[torch.nn.Linear]):
    """One product whose output is the given linears' outputs side by side. With the few-row
    product (RowsLinear) each linear's own weight is read, all of them in one pass of the
    operator (rows.linear_cat), as when the forward is traced for compilation
    (specd.runtime.aot); where single rows run unpacked (PackedLinear._gemv), torch's products.
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


def _eps(norm: torch.nn.Module) -> float:
    eps = getattr(norm, "variance_epsilon", None)
    return norm.eps if eps is None else eps


class Layer:
    """One decoder layer as the lean forward runs it: its norms, the fused q/k/v and gate/up
    products (and their biases), the output products, its sliding window and rotary table."""

    __slots__ = ("down", "gate_up", "gate_up_bias", "k_norm", "norm_attn", "norm_in", "norm_mlp_in", "norm_mlp_out",
                 "o", "q_norm", "qkv", "qkv_bias", "rope", "sources", "window")

    def __init__(self, layer: torch.nn.Module, arch: Arch, index: int, rope: int):
        a, m = layer.self_attn, layer.mlp
        qkv = [a.qkv_proj] if hasattr(a, "qkv_proj") else [a.q_proj, a.k_proj, a.v_proj]  # Phi-3 fuses its own
        gate_up = [m.gate_up_proj] if hasattr(m, "gate_up_proj") else [m.gate_proj, m.up_proj]
        self.sources = qkv + gate_up  # the linears the fused products copy (LeanModel._stamps)
        self.qkv, self.qkv_bias = _fused(qkv), _bias(qkv)
        self.gate_up, self.gate_up_bias = _fused(gate_up), _bias(gate_up)
        self.o, self.down = a.o_proj, m.down_proj
        self.norm_in = layer.input_layernorm
        if arch.sandwich:  # Gemma: post_attention_layernorm norms the attention's output
            self.norm_attn, self.norm_mlp_in = layer.post_attention_layernorm, layer.pre_feedforward_layernorm
            self.norm_mlp_out = layer.post_feedforward_layernorm
        else:
            self.norm_attn, self.norm_mlp_in, self.norm_mlp_out = None, layer.post_attention_layernorm, None
        self.q_norm, self.k_norm = (a.q_norm, a.k_norm) if arch.qk_norm else (None, None)
        self.window = arch.windows[min(index, len(arch.windows) - 1)]
        self.rope = rope


def _bias(linears: list[torch.nn.Linear]) -> torch.Tensor | None:
    """The fused product's bias: the linears' biases side by side (zeros where one has none);
    None where there are none or all are zero (adding zeros changes no value)."""
    if all(m.bias is None or not m.bias.detach().any() for m in linears):
        return None
    return torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.weight.shape[0])
                      for m in linears])


class LeanModel:
    """The lean forward of one transformers causal LM of a family specd.runtime.arch describes
    (reads its weights; copies q/k/v and gate/up once, concatenated). Call `forward` as a specd
    ForwardFn.

    layers: the decoder layers to run (default the model's own); an early-exit drafter passes
    the target's first k layers and its adapter layer, and reads `hidden`, the final-normed
    state, instead of the logits."""

    def __init__(self, model: torch.nn.Module, layers: list[torch.nn.Module] | None = None):
        reason = unsupported(model)
        assert reason is None, f"lean forward: {reason}"
        config = model.config
        inner = model.model
        self.model = model
        self.arch = describe(model)
        self.decoder_layers = list(inner.layers if layers is None else layers)
        self.embed = inner.embed_tokens  # Gemma's scales its rows by sqrt(hidden) itself
        self.norm = inner.norm
        self.lm_head = model.lm_head
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.groups = self.heads // self.kv_heads
        self.scaling = self.arch.scaling
        self.q_size = self.heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        kinds = list(dict.fromkeys(self.arch.rope_kinds))  # Gemma 3: its local and global layers' tables
        self._rope_kinds = kinds
        self._layer_rope = [kinds.index(self.arch.rope_kinds[min(self._index(layer, i), len(self.arch.rope_kinds) - 1)])
                            for i, layer in enumerate(self.decoder_layers)]
        self._rotary = _RotaryTables(inner.rotary_emb, config, kinds)
        self._fuse()

    @staticmethod
    def _index(layer: torch.nn.Module, i: int) -> int:
        return getattr(layer.self_attn, "layer_idx", i)

    def _fuse(self) -> None:
        self.layers = [Layer(layer, self.arch, self._index(layer, i), self._layer_rope[i])
                       for i, layer in enumerate(self.decoder_layers)]
        scale = getattr(self.embed, "embed_scale", None)
        self._embed_scale = None if scale is None else float(scale.to(self.embed.weight.dtype))
        self._scales = {}  # Gemma: each norm's 1 + w in float32, made once (a constant, not a step's work)
        if self.arch.gemma_norm:
            with torch.inference_mode(False), torch.no_grad():
                for layer in self.layers:
                    for n in (layer.norm_in, layer.norm_attn, layer.norm_mlp_in, layer.norm_mlp_out, layer.q_norm,
                              layer.k_norm):
                        if n is not None:
                            self._scales[id(n)] = 1.0 + n.weight.float()
                self._scales[id(self.norm)] = 1.0 + self.norm.weight.float()
        self._fused_from = self._stamps()
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        self.rotary_dim = self._rotary.dim
        empty = torch.empty(0, self.rotary_dim, dtype=self.dtype, device=self.device)
        self.tables = [(empty, empty) for _ in self._rope_kinds]  # per rotary kind: cos, sin [positions, dim]

    def _stamps(self) -> list[tuple]:
        """What the fused copies were made from: each source weight's storage, dtype and
        in-place version (an inference tensor has none; nothing here writes weights in
        inference mode)."""
        sources = [p for layer in self.layers for p in layer.sources]
        if self.arch.gemma_norm:  # their scales are made from the norms' weights
            sources += [n for layer in self.layers for n in (layer.norm_in, layer.norm_attn, layer.norm_mlp_in,
                                                            layer.norm_mlp_out, layer.q_norm, layer.k_norm)
                        if n is not None] + [self.norm]
        return [(p.weight.data_ptr(), p.weight.dtype, -1 if p.weight.is_inference() else p.weight._version)
                for p in sources]

    def _refresh(self) -> None:
        if self._stamps() != self._fused_from:  # a source weight was replaced, converted or changed
            self._fuse()

    def new_cache(self) -> FlatCache:
        """An empty cache for a new session; the fused weights are checked against the model's
        here, once per session, not on every step."""
        self._refresh()
        return FlatCache(len(self.layers), self.kv_heads, self.head_dim, self.dtype, self.device)

    # rotary positions ---------------------------------------------------------------------

    def rope_tables(self, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per rotary kind, cos and sin [>= length, rotary_dim] (grown by doubling)."""
        have = self.tables[0][0].shape[0]
        if length > have:
            n = max(length, 2 * have, 512)
            self.tables = [self._rotary.extend(kind, old, n, self.dtype, self.device)
                           for kind, old in zip(self._rope_kinds, self.tables)]
        return self.tables

    def _rope(self, past: int, t: int, positions: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per rotary kind cos, sin [T, rotary_dim] for the new tokens: at past .. past + t - 1, or
        at the given positions (a draft tree's, never beyond those)."""
        tables = self.rope_tables(past + t)
        if positions is None:
            return [(c[past:past + t], s[past:past + t]) for c, s in tables]
        return [(c[positions], s[positions]) for c, s in tables]

    # the layer's arithmetic, shared by every exact forward (this one and KVPool.hidden) ------

    def rms(self, norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The model's RMSNorm, in transformers' order of operations."""
        if self.arch.gemma_norm:
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + _eps(norm))
            return (h * self._scales[id(norm)]).type_as(x)
        return self._rms(norm, x)

    def embed_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings; Gemma's scaled by sqrt(hidden) as its module scales them (the
        scale rounded to the model's dtype first), here a number rather than a 0-dim tensor,
        which a compiled forward would inline and drop from its constants."""
        if self._embed_scale is None:
            return self.embed(ids)
        return F.embedding(ids, self.embed.weight) * self._embed_scale

    def derived(self) -> dict[str, torch.Tensor]:
        """The tensors this forward reads that are not the model's own (concatenated biases,
        Gemma's norm scales 1 + w), by names stable across processes: what a compiled forward
        (specd.runtime.aot) takes as constants beside the model's parameters."""
        out = {}
        for i, layer in enumerate(self.layers):
            for name in ("qkv_bias", "gate_up_bias"):
                if getattr(layer, name) is not None:
                    out[f"lean.layers.{i}.{name}"] = getattr(layer, name)
        if self.arch.gemma_norm:
            norms = {id(n): n for layer in self.layers
                     for n in (layer.norm_in, layer.norm_attn, layer.norm_mlp_in, layer.norm_mlp_out, layer.q_norm,
                               layer.k_norm) if n is not None}
            norms[id(self.norm)] = self.norm
            names = {id(m): n for n, m in self.model.named_modules()}
            for key in norms:
                out[f"lean.scale.{names.get(key, key)}"] = self._scales[key]
        return out

    @staticmethod
    def _rms(norm: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        variance = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(variance + _eps(norm))
        return norm.weight * h.to(dtype)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == x.shape[-1]:
            return self._rotate(x, cos, sin)
        r = self.rotary_dim  # partial rotary (Phi-3's partial_rotary_factor): the rest passes through
        return torch.cat([self._rotate(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos) + (rotated * sin)

    def project_qkv(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        qkv = layer.qkv(x)
        return qkv if layer.qkv_bias is None else qkv + layer.qkv_bias

    def split_heads(self, layer: Layer, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, heads, T, D], k [B, kv_heads, T, D] (q/k-normed where the model norms them, not
        rotated yet) and v [B, T, kv_heads, D] of a q/k/v product [B, T, C]."""
        batch, width = qkv.shape[0], qkv.shape[1]
        q, k, v = qkv.split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(batch, width, self.heads, self.head_dim)
        k = k.view(batch, width, self.kv_heads, self.head_dim)
        if layer.q_norm is not None:
            q, k = self.rms(layer.q_norm, q), self.rms(layer.k_norm, k)
        return q.transpose(1, 2), k.transpose(1, 2), v.view(batch, width, self.kv_heads, self.head_dim)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """Attention of q [B, heads, T, D] over keys/values [B, kv_heads, S, D] under a bool mask
        (True: attend), [B, heads, T, D]. SDPA shares each KV head among its query heads
        (enable_gqa); where transformers repeats the KV heads instead the result is the same to
        the bit (tests/specd/runtime/test_lean.py). Soft-capped scores (Gemma 2) go the way of
        transformers' eager attention, which SDPA cannot take."""
        cap = self.arch.attn_softcap
        if cap is None:
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling,
                                                  enable_gqa=self.groups > 1)
        if self.groups > 1:
            keys, values = keys.repeat_interleave(self.groups, 1), values.repeat_interleave(self.groups, 1)
        scores = torch.matmul(q, keys.transpose(2, 3)) * self.scaling
        scores = torch.tanh(scores / cap) * cap
        if mask is not None and mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        elif mask is not None:  # additive (a draft tree's, specd.tree.tree_mask)
            scores = scores + mask
        weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(weights, values)

    def finish(self, layer: Layer, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The rest of a layer after attention: the output product, the residual sums and the MLP."""
        a = layer.o(out)
        if layer.norm_attn is not None:
            a = self.rms(layer.norm_attn, a)
        h = h + a
        x = self.rms(layer.norm_mlp_in, h)
        gate_up = layer.gate_up(x)
        if layer.gate_up_bias is not None:
            gate_up = gate_up + layer.gate_up_bias
        gate, up = gate_up.chunk(2, dim=-1)
        m = layer.down(self.arch.act(gate) * up)
        if layer.norm_mlp_out is not None:
            m = self.rms(layer.norm_mlp_out, m)
        return h + m

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.rms(self.norm, h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head over final-normed states, soft-capped where the model caps (Gemma)."""
        logits = self.lm_head(h)
        cap = self.arch.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @staticmethod
    def window_mask(mask: torch.Tensor | None, window: int | None, key_pos: torch.Tensor,
                    query_pos: torch.Tensor) -> torch.Tensor | None:
        """A layer's mask: the causal (or tree) mask, and for a sliding layer only the keys within
        `window` positions of the query (transformers': key > query - window)."""
        if window is None:
            return mask
        near = key_pos > query_pos[..., None] - window
        return near if mask is None else mask & near

    # the forward ------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, cache: FlatCache, num_logits: int, want_hidden: bool,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None):
        h = self.hidden(input_ids, cache, num_logits, attention_mask, position_ids)
        logits = self.logits(h)
        return logits[0], (h[0] if want_hidden else None)

    def hidden(self, input_ids: torch.Tensor, cache: FlatCache, num_logits: int,
               attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The final-normed hidden states [1, num_logits, H] of the last positions."""
        assert input_ids.shape[0] == 1, "the lean forward runs one sequence"
        past = cache.lens[0]
        t = input_ids.shape[1]
        tables = [(c[None, None], s[None, None])  # [1, 1, T, D]
                  for c, s in self._rope(past, t, None if position_ids is None else position_ids[0])]
        mask = attention_mask
        if mask is None and t > 1:  # causal over the cache and the window, what transformers builds
            mask = torch.ones(t, past + t, dtype=torch.bool, device=self.device).tril(past)[None, None]
        masks = {None: mask}
        if any(layer.window is not None for layer in self.layers):
            query = (torch.arange(past, past + t, device=self.device) if position_ids is None
                     else position_ids[0].to(self.device))
            keys = torch.arange(past + t, device=self.device)
            for w in {layer.window for layer in self.layers} - {None}:
                if past + t > w:
                    if mask is None:
                        base = torch.ones(1, 1, t, past + t, dtype=torch.bool, device=self.device)
                    else:
                        base = mask if mask.dtype == torch.bool else mask == 0
                    masks[w] = self.window_mask(base, w, keys, query)
                else:
                    masks[w] = mask
        h = self.embed_ids(input_ids)
        for i, layer in enumerate(self.layers):
            cos, sin = tables[layer.rope]
            x = self.rms(layer.norm_in, h)
            q, k, v = self.split_heads(layer, self.project_qkv(layer, x))
            q = self.rotate(q, cos, sin)
            k = self.rotate(k, cos, sin)
            keys, values = cache.update(k, v.transpose(1, 2), i)
            out = self.attend(q, keys, values, masks[layer.window])
            h = self.finish(layer, h, out.transpose(1, 2).reshape(1, t, self.q_size))
        return self.final_norm(h[:, -num_logits:])


class _RotaryTables:
    """cos/sin rows from the model's own rotary module, per rotary kind (a copy of the module:
    a dynamic scaling's state is the copy's, never the model's)."""

    def __init__(self, rotary: torch.nn.Module, config, kinds: list[str | None]):
        import copy

        self.rotary = copy.deepcopy(rotary)
        self.kinds = kinds
        rope_types = getattr(self.rotary, "rope_type", "default")
        self.types = {k: (rope_types[k] if isinstance(rope_types, dict) else rope_types) for k in kinds}
        self.original = {}
        for k in kinds:
            params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
            params = params[k] if k is not None else params
            self.original[k] = int(params.get("original_max_position_embeddings")
                                   or getattr(config, "original_max_position_embeddings", None)
                                   or config.max_position_embeddings)
        cos, _ = self._rows(kinds[0], 0, 1, torch.float32, None)
        self.dim = cos.shape[-1]

    def _rows(self, kind, start: int, stop: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        buffer = next(self.rotary.buffers(), None)
        on = buffer.device if buffer is not None else device
        x = torch.empty(0, dtype=dtype, device=on)
        pos = torch.arange(start, stop, device=on)[None]
        cos, sin = self.rotary(x, pos) if kind is None else self.rotary(x, pos, kind)
        return cos[0], sin[0]

    @torch.inference_mode()
    def extend(self, kind, old: tuple[torch.Tensor, torch.Tensor], n: int, dtype: torch.dtype,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The table of kind grown to n positions (old's rows kept). A length-dependent scaling
        gets each position's own: longrope's short factors up to the original context and its
        long ones past it; dynamic's frequencies for a sequence ending at each position."""
        start = old[0].shape[0]
        split = min(max(start, self.original[kind]), n)
        parts = [self._rows(kind, start, split, dtype, device)] if split > start else []
        if "dynamic" in self.types[kind]:
            parts += [self._rows(kind, p, p + 1, dtype, device) for p in range(split, n)]
        elif n > split:
            parts.append(self._rows(kind, split, n, dtype, device))
        with torch.inference_mode(False):
            cos = torch.cat([old[0]] + [p[0].to(device) for p in parts])
            sin = torch.cat([old[1]] + [p[1].to(device) for p in parts])
        return cos, sin
