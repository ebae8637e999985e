"""The drafter interface: a session proposes one token at a time after a token sequence.

A session keeps whatever per-request state drafting needs (a KV cache, an n-gram
continuation) and is told by `rollback` how much of the sequence survived verification.
"""

from __future__ import annotations

import copy
import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from specd.errors import ModelError
from specd.runtime.pool import PoolSession
from specd.runtime.session import KVSession
from specd.sampling import entropy, logits_to_probs, race_row, sample
from specd.types import DraftStep, SamplingParams


@dataclass(slots=True)
class DraftToken:
    token: int
    q: torch.Tensor | None  # [V] distribution x was drawn from; None for a point mass
    prob: float  # q(x)
    max_prob: float
    entropy: float  # H(q) in nats
    hidden: torch.Tensor | None = None  # [H] draft hidden state that produced q
    match_len: int = 0  # n-gram drafters: length of the matched suffix this token continues
    retrieved: bool = False  # retrieval: the match is in the datastore, not in this request's text
    votes: int = 0  # n-gram drafters: occurrences of the match that voted on this token (0: unknown)
    support: float = 1.0  # ... and the share of them that continue with it
    # coupled sampling: E(x), the race noise of x at its position (specd.sampling); < 0: not coupled
    noise: float = -1.0

    def step(self, index: int, position: int) -> DraftStep:
        """What the stopping policy sees of this token, the index-th (1-based) of its window,
        at `position` among the generated tokens."""
        return DraftStep(index, position, self.token, self.prob, self.max_prob, self.entropy, self.hidden,
                         self.match_len, self.retrieved, self.votes, self.support, self.noise)


@dataclass(frozen=True, slots=True)
class BatchStep:
    """One session's part of a batched draft forward: feed `ids` to `kv` (a KV pool session),
    then `finish(logits [1, V], hidden [1, H] | None)` is the DraftToken `next` would return."""

    kv: object
    ids: list[int]
    finish: Callable[[torch.Tensor, torch.Tensor | None], DraftToken]


class DraftSession(ABC):
    # A step is a lookup that costs less than handing it to another thread: a draft service runs
    # it on its event loop (services.draft.runner), not on its compute thread.
    inline: ClassVar[bool] = False

    @abstractmethod
    def next(self, seq: list[int], params: SamplingParams, generator: torch.Generator | None,
             want_hidden: bool) -> DraftToken | None:
        """Propose the token after seq, or None when there is nothing worth proposing."""

    @abstractmethod
    def rollback(self, length: int) -> None:
        """Only seq[:length] is still valid."""

    def branches(self, seq: list[int], chain: list[int], length: int,
                 params: SamplingParams | None = None) -> list[list[int]]:
        """Alternative continuations of seq (the committed tokens), best first, up to `length`
        tokens each, for a draft tree beside `chain`, the window just drafted (only asked of
        drafters whose `branch_length` is non-zero); params: the request's sampling."""
        return []

    def observe_target(self, start: int, hidden: torch.Tensor) -> None:
        """The target's last hidden states [n, H] at positions start..start+n-1 of the verified
        sequence (only for drafters with needs_target_features)."""

    def batch_step(self, seq: list[int], params: SamplingParams, generator: torch.Generator | None,
                   want_hidden: bool) -> BatchStep | None:
        """`next` split for a batched forward over many sessions (a draft service serving them),
        or None where this session's steps cannot join one (the default)."""
        return None

    def close(self) -> None:
        """Free per-request memory."""

    def nbytes(self) -> int:
        """Bytes of per-request cache held (KV caches; 0 for drafters without one)."""
        return 0


class Drafter(ABC):
    kind: ClassVar[str]
    has_distribution: ClassVar[bool] = True
    # Reads the target's last hidden states of verified positions (DraftSession.observe_target).
    needs_target_features: ClassVar[bool] = False
    # DVI: the drafter's head takes a LoRA trained online (set_lora, specd.dvi); its draft
    # tokens' hidden states are the head's input.
    learns_online: ClassVar[bool] = False
    # Draft trees (specd.tree): side branches per round by default, and new tokens per branch
    # (0 for drafters whose sessions offer no alternatives: no trees at all).
    branches: ClassVar[int] = 0
    branch_length: ClassVar[int] = 0

    @property
    @abstractmethod
    def name(self) -> str:
        """Identifies the drafter's weights in shared policy state and statistics."""

    @abstractmethod
    def open(self, vocab_size: int | None = None) -> DraftSession:
        """A fresh session for one request; vocab_size: the target's, when it differs from
        the drafter's own (distributions are cropped or padded to it)."""


def shallow_decoder(base: torch.nn.Module, layers: list[torch.nn.Module]) -> torch.nn.Module:
    """A shallow copy of a transformers decoder that shares every module (embeddings, rotary,
    final norm) but runs only `layers`; with each layer's attention layer_idx its index in
    that list, it can own a DynamicCache of its own."""
    dec = copy.copy(base)
    dec._modules = dict(base._modules)
    dec.layers = torch.nn.ModuleList(layers)
    dec.config = copy.copy(base.config)
    dec.config.num_hidden_layers = len(layers)
    return dec


def read_adapter_meta(path: str | Path) -> dict:
    """The metadata of an adapter file: layers, adapter, rank (and what it was trained on)."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"adapter file not found: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise ModelError(f"adapter {path} is not a safetensors file: {e}") from e
    return {k: (json.loads(v) if k == "train" else v) for k, v in meta.items()}


class ReducedVocab:
    """Mixin for drafters that use the target's LM head: drafting over a reduced vocabulary
    (FR-Spec, Zhao et al. 2025) computes only the head rows of those tokens; the others get
    logit -inf (q = 0), which verification handles exactly (the target's residual covers them).
    Needs self.lm_head and self.target; call set_vocab(None) in __init__."""

    lm_head: torch.nn.Module
    vocab_ids: torch.Tensor | None
    head_weight: torch.Tensor  # the rows computed: all, or those of vocab_ids
    lora: torch.nn.Module | None = None  # DVI: a LoRA on the head rows (specd.dvi)

    def set_lora(self, lora: torch.nn.Module | None) -> None:
        """Use this DVI adapter from the next draft step on (None: the plain head). Safe while
        sessions are drafting: it changes q only, never a KV cache, and every drafted token
        carries the q it was drawn from."""
        if lora is not None:
            rows, hidden = self.head_weight.shape
            if tuple(lora.B.shape[:1]) != (rows,) or lora.A.shape[1] != hidden:
                raise ModelError(f"the DVI adapter is for a head of {lora.B.shape[0]} rows and hidden size "
                                 f"{lora.A.shape[1]}; this drafter's has {rows} and {hidden}")
            lora = lora.to(self.head_weight.device, self.head_weight.dtype).requires_grad_(False).eval()
        self.lora = lora  # one assignment: a forward reads either the old or the new adapter

    @property
    def lora_version(self) -> int:
        return getattr(self.lora, "version", 0) if self.lora is not None else 0

    def set_vocab(self, vocab_ids: torch.Tensor | None) -> None:
        """Draft over these token ids only (None: the whole vocabulary). Drops a DVI adapter,
        which was trained for the old rows."""
        self.lora = None
        if vocab_ids is None:
            self.vocab_ids, self.head_weight = None, self.lm_head.weight
            return
        ids = vocab_ids.to(self.target.device, torch.long)
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.lm_head.weight.shape[0]:
            raise ModelError("draft vocabulary ids are outside the target's vocabulary")
        self.vocab_ids = ids
        self.head_weight = self.lm_head.weight.detach()[ids].contiguous()

    def load_trained(self, path: Path, module: torch.nn.Module, prepare=lambda tensors: tensors) -> None:
        """Load a trained file's weights into `module` and its draft vocabulary, refusing a file
        made for another target (its kind is the caller's to check)."""
        meta = read_adapter_meta(path)
        if meta.get("target") and meta["target"] != self.target.name:
            raise ModelError(f"{path} was trained for target {meta['target']}, not {self.target.name}")
        tensors = load_file(str(path), device=str(self.target.device))
        vocab = tensors.pop("vocab_ids", None)
        try:
            module.load_state_dict(prepare(tensors))
        except RuntimeError as e:
            raise ModelError(f"{path} does not fit this drafter: {e}") from e
        self.set_vocab(vocab)

    def save_trained(self, path: Path, module: torch.nn.Module, meta: dict[str, str], train: dict | None) -> None:
        """Write `module`'s weights, the draft vocabulary and metadata (the training report as JSON)."""
        tensors = {k: v.detach().contiguous() for k, v in module.state_dict().items()}
        if self.vocab_ids is not None:
            tensors["vocab_ids"] = self.vocab_ids.to(torch.int64).cpu()
        meta = {**meta, "target": self.target.name}
        if train is not None:
            meta["train"] = json.dumps(train)
        save_file(tensors, str(path), metadata=meta)

    def vocab_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (-inf outside a reduced draft vocabulary)."""
        lora = self.lora
        if self.vocab_ids is None:
            logits = self.lm_head(h)
            return logits if lora is None else logits + lora(h)
        logits = h @ self.head_weight.T
        if lora is not None:
            logits = logits + lora(h)
        full = logits.new_full((*logits.shape[:-1], self.lm_head.weight.shape[0]), float("-inf"))
        return full.index_copy_(-1, self.vocab_ids, logits)


class ModelDraftSession(DraftSession):
    """Drafting with a causal LM through a KV session (hf and early-exit drafters).

    For greedy decoding the token is argmax and q is the temperature-1 softmax (what the
    policies' confidence features and AdaSD's JS distance read); for sampling q is the
    distribution after temperature/top-k/top-p, exactly what x is drawn from.
    """

    def __init__(self, kv: KVSession, vocab_size: int, emitted: int | None = None):
        self.kv = kv
        self.vocab_size = vocab_size  # the target's: draft logits are cropped or padded to it
        self.emitted = emitted  # ids the target can emit (its tokenizer's): none past it is drafted

    def next(self, seq, params, generator, want_hidden):
        logits, hidden = self.kv.extend(seq[self.kv.length:], 1, want_hidden)
        return self._token(logits, hidden, seq, params, generator)

    def batch_step(self, seq, params, generator, want_hidden):
        if not isinstance(self.kv, PoolSession):
            return None
        return BatchStep(self.kv, seq[self.kv.length:],
                         lambda logits, hidden: self._token(logits, hidden, seq, params, generator))

    def _token(self, logits, hidden, seq, params, generator) -> DraftToken:
        return draft_token(fit_vocab(logits[0], self.vocab_size, self.emitted), params, generator,
                           hidden[0] if hidden is not None else None, len(seq))

    def rollback(self, length: int) -> None:
        self.kv.rollback(length)

    def close(self) -> None:
        self.kv.close()

    def nbytes(self) -> int:
        return self.kv.nbytes()


def draft_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                hidden: torch.Tensor | None, position: int) -> DraftToken:
    """The drafted token at sequence index `position` from logits [V]: for greedy decoding
    argmax, with q the temperature-1 softmax (what the policies' confidence features read);
    for sampling a draw from q, the distribution after temperature/top-k/top-p (seeded: the
    exponential race with the target's draws for that position, specd.sampling)."""
    noise = None
    if params.greedy:
        q = logits.softmax(-1)
        token = q.argmax()
    else:
        q = logits_to_probs(logits, params)
        if params.coupled:
            noise = race_row(params.seed, position, q.shape[-1]).to(q.device)
            token = (q / noise).argmax()
        else:
            token = sample(q, generator)
    # One host sync for everything the policy reads.
    e = noise[token] if noise is not None else q.new_tensor(-1.0)
    tok, prob, max_prob, h, e = torch.stack([token.float(), q[token], q.max(), entropy(q), e]).tolist()
    return DraftToken(int(tok), q, prob, max_prob, h, hidden, noise=e)


def fit_vocab(logits: torch.Tensor, vocab_size: int, emitted: int | None = None) -> torch.Tensor:
    """Logits [..., vocab_size]: cropped, or padded with -inf. Ids from `emitted` on (a padded
    table's rows past the tokenizer, which the target never emits) get -inf too, so that no draft
    proposes one and q keeps all its mass where verification reads it."""
    if logits.shape[-1] > vocab_size:
        logits = logits[..., :vocab_size]
    elif logits.shape[-1] < vocab_size:
        pad = logits.new_full((*logits.shape[:-1], vocab_size - logits.shape[-1]), float("-inf"))
        logits = torch.cat([logits, pad], -1)
    if emitted is not None and emitted < logits.shape[-1]:
        logits = logits.clone()
        logits[..., emitted:] = float("-inf")
    return logits
