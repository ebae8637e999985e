"""early-exit: the target's own first k layers, its final norm and LM head (Kangaroo,
Liu et al. 2024; DVI). The weights are shared with the target, so the drafter costs no
memory beyond an adapter and its own KV cache.

An adapter sits between the shallow model and the LM head. Two kinds:
  mlp    logits = head(a(norm(h_k))),  a(h) = h + up(silu(down(h)))   (rank r, `up` zero-
         initialised, so an untrained adapter is the identity)
  layer  one extra decoder layer on h_k (Kangaroo's adapter), a copy of target layer k
         (initialised as the target's own next layer), then norm, the mlp adapter and head
Untrained, the shallow model agrees with the target on few tokens; `specd train-drafter`
trains the adapter by distillation from the target (specd.training.early_exit).

A trained adapter may also carry a reduced draft vocabulary (FR-Spec, Zhao et al. 2025):
only the LM-head rows of the most frequent tokens are computed, which cuts the head's cost
(it dominates a shallow drafter) by the vocabulary ratio. Other tokens get probability 0 in
q; verification stays exact because the target's residual covers them.

An adapter file (safetensors) records its layers, kind and rank in its metadata, so
`--draft-adapter PATH` alone configures the drafter.

Draft sessions run specd's lean forward over the drafter's layers wherever the target's
sessions do (a float32 Llama on the CPU; specd/runtime/lean.py): the same logits as
transformers' forward, without its per-call overhead, which is most of a shallow model's
step there. `forward` (transformers', any cache) stays for training and analysis.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from specd.drafters.base import Drafter, ModelDraftSession, ReducedVocab, read_adapter_meta, shallow_decoder
from specd.errors import InvalidRequest, ModelError
from specd.runtime.lean import LeanModel
from specd.runtime.loading import LoadedModel
from specd.runtime.pool import KVPool
from specd.runtime.session import KVSession

ADAPTERS = ("mlp", "layer")
NO_ADAPTER = "none"  # --draft-adapter none: the untrained (identity) adapter
DATA = Path(__file__).resolve().parent.parent / "data"
# Trained adapters shipped with specd, by (target, layers): `specd train-drafter` made them
# (docs/engine.md gives the command); used when no adapter is named.
BUNDLED_ADAPTERS = {("smollm2-135m-instruct", 4): DATA / "smollm2-ee4-layer-v8k.safetensors"}


def bundled_adapter_path(target_name: str, layers: int) -> Path | None:
    return BUNDLED_ADAPTERS.get((target_name, layers))


class ResidualAdapter(nn.Module):
    def __init__(self, hidden_size: int, rank: int = 64):
        super().__init__()
        self.down = nn.Linear(hidden_size, rank, bias=False)
        self.up = nn.Linear(rank, hidden_size, bias=False)
        nn.init.zeros_(self.up.weight)  # identity until trained

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(nn.functional.silu(self.down(h)))


class EarlyExitDrafter(Drafter, ReducedVocab):
    kind = "early-exit"
    learns_online = True

    def __init__(self, target: LoadedModel, layers: int = 4, adapter_path: str | Path | None = None,
                 adapter: str = "mlp", rank: int = 64):
        meta = read_adapter_meta(adapter_path) if adapter_path is not None else {}
        if meta.get("kind", self.kind) != self.kind:
            raise ModelError(f"{adapter_path} holds a {meta['kind']} drafter, not an early-exit adapter")
        # A trained adapter fixes the drafter's shape: its layers, kind and rank win.
        layers = int(meta.get("layers", layers))
        adapter = meta.get("adapter", adapter)
        rank = int(meta.get("rank", rank))
        base = target.model.get_decoder()
        total = len(base.layers)
        if not 1 <= layers < total:
            raise InvalidRequest("draft_layers", f"must be in [1, {total - 1}] for this target, got {layers}")
        if adapter not in ADAPTERS:
            raise InvalidRequest("adapter", f"unknown adapter {adapter!r} ({', '.join(ADAPTERS)})")
        self.target = target
        self.layers = layers
        self.adapter_kind = adapter
        self.adapter_name: str | None = None  # set once a trained adapter is loaded
        dtype = next(base.parameters()).dtype
        # The target's first k layers (layer_idx 0..k-1), shared.
        kept = list(base.layers[:layers])
        self.extra_layer: nn.Module | None = None
        if adapter == "layer":  # target layer k, copied: layer_idx k, the cache's (k+1)-th layer
            self.extra_layer = copy.deepcopy(base.layers[layers]).to(target.device).eval()
            kept.append(self.extra_layer)
        self.decoder = shallow_decoder(base, kept)
        self._lean: LeanModel | None = None  # built by the first lean session
        self._kv_pool: KVPool | None = None  # built by the first session when the target has a pool
        self.lm_head = target.model.get_output_embeddings()
        self.adapter = ResidualAdapter(target.model.config.hidden_size, rank).to(target.device, dtype).eval()
        self.set_vocab(None)  # ReducedVocab: a trained adapter may bring its own
        if adapter_path is not None:
            self.load_adapter(adapter_path)

    @property
    def name(self) -> str:
        # A trained adapter is a different drafter: its shared policy state and heads are its own.
        base = f"{self.target.name}:early-exit-{self.layers}"
        return f"{base}+{self.adapter_name}" if self.adapter_name else base

    def trainable(self) -> nn.ModuleDict:
        """The modules training updates (the target's own weights stay frozen)."""
        mods = {"adapter": self.adapter}
        if self.extra_layer is not None:
            mods["layer"] = self.extra_layer
        return nn.ModuleDict(mods)

    def load_adapter(self, path: str | Path) -> None:
        path = Path(path)
        self.load_trained(path, self.trainable(), _prefixed)
        self.adapter_name = path.stem

    def save_adapter(self, path: str | Path, train: dict | None = None) -> None:
        self.save_trained(Path(path), self.trainable(), {
            "kind": self.kind, "layers": str(self.layers), "adapter": self.adapter_kind,
            "rank": str(self.adapter.down.out_features)}, train)

    def forward(self, input_ids, cache, num_logits, want_hidden):
        h = self.decoder(input_ids=input_ids, past_key_values=cache, use_cache=True).last_hidden_state
        return self.head_logits(h[0, -num_logits:], want_hidden)

    def lean_forward(self, input_ids, cache, num_logits, want_hidden):
        """`forward` through the lean Llama forward: cache is its FlatCache."""
        return self.head_logits(self._lean.hidden(input_ids, cache, num_logits)[0], want_hidden)

    def head_logits(self, h: torch.Tensor, want_hidden: bool = False):
        """Adapter and draft-vocabulary head on the final-normed shallow state [n, H]: logits
        (and the adapted state, the DVI LoRA's input, if wanted)."""
        h = self.adapter(h)
        return self.vocab_logits(h), (h if want_hidden else None)

    def use_pool(self, slots: int, max_len: int) -> KVPool:
        """Open sessions in a KV pool of the drafter's own layers (a draft service batching its
        sessions' steps); a target with a pool of its own gives the drafter one of its shape anyway."""
        self._kv_pool = _pool_of(self, slots, max_len)
        return self._kv_pool

    def open(self, vocab_size: int | None = None) -> ModelDraftSession:
        vocab_size, emitted = vocab_size or self.target.vocab_size, self.target.emitted_vocab
        if self._kv_pool is None and self.target.pool is not None:  # the target's pool: so do its first layers
            self._kv_pool = _pool_of(self, self.target.pool.num_slots, self.target.pool.max_len)
        if self._kv_pool is not None:
            return ModelDraftSession(self._kv_pool.session(), vocab_size, emitted)
        if self.target.forward_kind() != "lean":
            return ModelDraftSession(KVSession(self.forward, self.target.device), vocab_size, emitted)
        if self._lean is None:
            self._lean = LeanModel(self.target.model, list(self.decoder.layers))
        # new_cache re-fuses weights that changed since the last session (training the layer adapter)
        kv = KVSession(self.lean_forward, self.target.device, self._lean.new_cache())
        return ModelDraftSession(kv, vocab_size, emitted)


def _pool_of(drafter: EarlyExitDrafter, slots: int, max_len: int) -> KVPool:
    """The drafter's own KV pool (CUDA graphs too, if the target's forwards are captured)."""
    target = drafter.target.pool
    if drafter._lean is None:
        drafter._lean = LeanModel(drafter.target.model, list(drafter.decoder.layers))

    def head(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, adapted = drafter.head_logits(h, True)
        return logits.float(), adapted

    pool = KVPool(drafter._lean, slots, max_len, head=head)
    from specd.runtime.graphs import GraphRunner

    if target is not None and isinstance(target.runner, GraphRunner):  # a compiled CPU target's drafter stays eager
        GraphRunner(pool)
    return pool


def _prefixed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter files written before the `layer` kind hold the mlp's keys unprefixed."""
    if any(k.startswith(("adapter.", "layer.")) for k in tensors):
        return tensors
    return {f"adapter.{k}": v for k, v in tensors.items()}
