"""DVI: drafters that learn online from verification (Draft, Verify & Improve; docs/engine.md).

The draft head of an early-exit or feature drafter gets a LoRA adapter (`HeadLoRA`): the
logits of the rows it computes become  h W^T + s (h A^T) B^T,  with W the target's frozen LM
head (or its rows of a reduced draft vocabulary), A [r, H], B [rows, r] zero-initialised, so
a fresh adapter changes nothing. Because the LoRA reads only h, the head's input, training
needs no model forward at all: a replay record is h, the drafted token, the target's top-k
log-probs at that position and the reward (1 accepted, 0 the first rejected token of its
window; later tokens of a rejected window were never judged and are not logged).

The trainer (`DVITrainer`) follows DVI's KL -> RL schedule: for the first `kl_steps` updates
pure distillation, the cross-entropy to the target's top-k distribution restricted to the
draft vocabulary (KL up to a constant); after that the distillation term stays as an anchor
and the on-policy terms are added: reward-masked cross-entropy on the drafted token
(-r log q(x)) and a small policy-gradient term -(r - b) log q(x) with b an EMA of the reward.

The verifier never changes, so the output stays lossless whatever the adapter does: each
drafted token carries the q it was drawn from, and verification uses exactly that q. Weights
can therefore be swapped into a live drafter between any two draft steps (`set_lora`); KV
caches are untouched, because the LoRA acts after the last layer.

This module is the pure part: records and their wire form, the in-memory replay stream,
the adapter and the trainer. The Redis stream and `specd serve trainer` live in services/.
"""

from __future__ import annotations

import io
import json
import math
import random
import struct
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from safetensors.torch import load, save
from torch import nn

from specd.errors import InvalidRequest, ModelError

TOP_K = 16  # target log-probs kept per record: the distillation target


@dataclass(slots=True)
class Record:
    """One judged draft position."""
    hidden: torch.Tensor  # [H] the draft head's input that produced q
    token: int  # the drafted token
    reward: float  # 1: accepted by the lossless rule; 0: the window's first rejected token
    top_ids: torch.Tensor  # [k] the target's most likely next tokens at this position
    top_logprobs: torch.Tensor  # [k] their log-probabilities (temperature 1)
    version: int = 0  # the adapter version that drafted it

    def encode(self) -> dict[str, bytes]:
        """Flat fields for a stream entry (h in float16: 2 bytes per hidden unit)."""
        return {"h": self.hidden.detach().to("cpu", torch.float16).numpy().tobytes(),
                "x": str(self.token).encode(), "r": repr(float(self.reward)).encode(),
                "i": self.top_ids.detach().to("cpu", torch.int32).numpy().tobytes(),
                "l": self.top_logprobs.detach().to("cpu", torch.float32).numpy().tobytes(),
                "v": str(self.version).encode()}

    @classmethod
    def decode(cls, fields: dict) -> Record:
        f = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
        try:
            ids = torch.frombuffer(bytearray(f["i"]), dtype=torch.int32).long()
            lps = torch.frombuffer(bytearray(f["l"]), dtype=torch.float32)
            if ids.numel() != lps.numel():
                raise ValueError(f"{ids.numel()} top-k ids but {lps.numel()} log-probs")
            return cls(torch.frombuffer(bytearray(f["h"]), dtype=torch.float16).float(), int(f["x"]),
                       float(f["r"]), ids, lps, int(f.get("v", b"0")))
        except (KeyError, ValueError) as e:
            raise ValueError(f"malformed replay record: {e}") from None


def judged_records(hiddens: Sequence[torch.Tensor | None], tokens: Sequence[int], num_strict: int,
                   target_logits: torch.Tensor, version: int = 0, top_k: int = TOP_K) -> list[Record]:
    """The records of one verified window: its drafts up to and including the first rejected
    one. target_logits [>= judged, V]: the target's logits at the drafts' positions."""
    judged = min(num_strict + 1, len(tokens))
    if judged == 0 or any(h is None for h in hiddens[:judged]):
        return []
    lp, ids = top_logprobs(target_logits[:judged], top_k)
    return [Record(hiddens[i].detach().float().cpu(), tokens[i], float(i < num_strict), ids[i], lp[i], version)
            for i in range(judged)]


def top_logprobs(logits: torch.Tensor, k: int = TOP_K) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest log-probabilities of each row (temperature 1) and their token ids, on the CPU."""
    vals, ids = logits.float().topk(k, -1)
    lp = vals - logits.float().logsumexp(-1, keepdim=True)
    return lp.cpu(), ids.cpu()


class ReplayStream(Protocol):
    """Where drafters log records and the trainer reads them, in order."""

    def add(self, records: Sequence[Record]) -> None: ...

    def read(self, after: int, count: int) -> list[tuple[int, Record]]:
        """Up to count records with ids after `after` (0: from the oldest kept)."""


class MemoryReplayStream:
    """In-process ReplayStream (the in-process engine and tests); keeps the last maxlen records."""

    def __init__(self, maxlen: int = 100_000):
        self._items: deque[tuple[int, Record]] = deque(maxlen=maxlen)
        self._next = 1
        self._lock = threading.Lock()

    def add(self, records: Sequence[Record]) -> None:
        with self._lock:
            for r in records:
                self._items.append((self._next, r))
                self._next += 1

    def read(self, after: int, count: int) -> list[tuple[int, Record]]:
        with self._lock:
            return [(i, r) for i, r in self._items if i > after][:count]

    def __len__(self) -> int:
        return len(self._items)


class HeadLoRA(nn.Module):
    """delta logits [.., rows] = scale (h A^T) B^T; B starts at zero (no change)."""

    def __init__(self, hidden_size: int, rows: int, rank: int = 16, alpha: float = 16.0, version: int = 0):
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, hidden_size))
        self.B = nn.Parameter(torch.zeros(rows, rank))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        self.scale = alpha / rank
        self.version = version

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h.to(self.A.dtype) @ self.A.T @ self.B.T * self.scale).to(h.dtype)

    def to_bytes(self) -> bytes:
        """safetensors bytes, with rank, scale and version in the metadata."""
        return save({"A": self.A.detach().float().cpu().contiguous(), "B": self.B.detach().float().cpu().contiguous()},
                    {"kind": "dvi-lora", "scale": repr(self.scale), "version": str(self.version)})

    @classmethod
    def from_bytes(cls, data: bytes) -> HeadLoRA:
        try:
            tensors = load(data)
            meta = _safetensors_meta(data)
            A, B = tensors["A"], tensors["B"]
        except Exception as e:  # safetensors raises its own types for a bad header
            raise ModelError(f"not a DVI LoRA: {e}") from None
        lora = cls(A.shape[1], B.shape[0], A.shape[0], version=int(meta.get("version", 0)))
        lora.scale = float(meta.get("scale", lora.scale))
        with torch.no_grad():
            lora.A.copy_(A)
            lora.B.copy_(B)
        return lora.requires_grad_(False).eval()


def _safetensors_meta(data: bytes) -> dict[str, str]:
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]).get("__metadata__", {})


@dataclass
class TrainerConfig:
    rank: int = 16
    lr: float = 2e-3
    batch_size: int = 64
    buffer: int = 8192  # replay records kept for sampling batches
    kl_steps: int = 200  # pure distillation before the on-policy terms join in
    ce_weight: float = 1.0  # reward-masked cross-entropy on the drafted token
    pg_weight: float = 0.1  # policy gradient with an EMA baseline
    baseline_decay: float = 0.99
    seed: int = 0

    def validate(self) -> None:
        for name in ("rank", "batch_size", "buffer"):
            if getattr(self, name) < 1:
                raise InvalidRequest(name, f"must be at least 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise InvalidRequest("lr", f"must be positive, got {self.lr}")
        if self.kl_steps < 0:
            raise InvalidRequest("kl_steps", f"must be at least 0, got {self.kl_steps}")
        if not 0 <= self.baseline_decay < 1:
            raise InvalidRequest("baseline_decay", f"must be in [0, 1), got {self.baseline_decay}")


class DVITrainer:
    """Online LoRA training of a draft head from replay records.

    head_weight [rows, H]: the frozen head rows the drafter computes; vocab_ids [rows] their
    token ids (None: row i is token i). Records whose top-k falls outside the draft vocabulary
    are distilled on the part inside it, renormalised (as offline training does)."""

    def __init__(self, head_weight: torch.Tensor, vocab_ids: torch.Tensor | None, vocab_size: int,
                 config: TrainerConfig | None = None, lora: HeadLoRA | None = None):
        config = config or TrainerConfig()
        config.validate()
        self.cfg = config
        self.W = head_weight.detach().float().cpu()
        rows, hidden = self.W.shape
        self.row_of = torch.full((vocab_size,), -1, dtype=torch.long)
        ids = vocab_ids.cpu().long() if vocab_ids is not None else torch.arange(rows)
        self.row_of[ids] = torch.arange(rows)
        self.lora = lora if lora is not None else HeadLoRA(hidden, rows, config.rank)
        if self.lora.B.shape[0] != rows or self.lora.A.shape[1] != hidden:
            raise ModelError("the LoRA does not fit this draft head")
        self.lora.requires_grad_(True).train()
        self.opt = torch.optim.AdamW(self.lora.parameters(), lr=config.lr, weight_decay=0.0)
        self.buffer: deque[Record] = deque(maxlen=config.buffer)
        self.rng = random.Random(config.seed)
        self.steps = 0
        self.baseline = 0.5
        self.seen = 0

    @property
    def version(self) -> int:
        return self.steps

    def add(self, records: Sequence[Record]) -> None:
        for r in records:
            if r.hidden.numel() != self.W.shape[1]:
                raise ValueError(f"record hidden size {r.hidden.numel()} != head's {self.W.shape[1]}")
        self.buffer.extend(records)
        self.seen += len(records)

    def step(self) -> dict[str, float] | None:
        """One update on a batch drawn from the replay buffer; None while it is empty."""
        if not self.buffer:
            return None
        n = min(self.cfg.batch_size, len(self.buffer))
        batch = self.rng.sample(list(self.buffer), n) if len(self.buffer) > n else list(self.buffer)
        h = torch.stack([r.hidden.float() for r in batch])
        x_rows = self.row_of[torch.tensor([r.token for r in batch])]
        reward = torch.tensor([r.reward for r in batch])
        k = max(r.top_ids.numel() for r in batch)
        ids = torch.stack([_pad(r.top_ids, k, 0) for r in batch])
        lps = torch.stack([_pad(r.top_logprobs, k, float("-inf")) for r in batch])
        rows = self.row_of[ids]
        lps = lps.masked_fill(rows < 0, float("-inf"))
        keep = torch.isfinite(lps).any(-1)
        p = torch.where(keep[:, None], lps, torch.zeros_like(lps)).softmax(-1)

        logq = (h @ self.W.T + self.lora(h)).log_softmax(-1)  # [n, rows]
        logq_top = logq.gather(1, rows.clamp(min=0))
        kl = -(p * logq_top.masked_fill(rows < 0, 0.0)).sum(-1)
        kl = (kl * keep).sum() / keep.sum().clamp(min=1)
        loss = kl
        stats = {"kl": kl.item()}
        if self.steps >= self.cfg.kl_steps:
            valid = x_rows >= 0
            logq_x = logq.gather(1, x_rows.clamp(min=0)[:, None])[:, 0] * valid
            ce = -(reward * logq_x).sum() / valid.sum().clamp(min=1)
            pg = -((reward - self.baseline) * logq_x).sum() / valid.sum().clamp(min=1)
            loss = loss + self.cfg.ce_weight * ce + self.cfg.pg_weight * pg
            stats |= {"ce": ce.item(), "pg": pg.item()}
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.lora.parameters(), 1.0)
        self.opt.step()
        d = self.cfg.baseline_decay
        self.baseline = d * self.baseline + (1 - d) * float(reward.mean())
        self.steps += 1
        self.lora.version = self.steps
        return stats | {"loss": loss.item(), "reward": float(reward.mean()), "baseline": self.baseline}

    def snapshot(self) -> HeadLoRA:
        """A frozen copy of the current adapter, to swap into a drafter."""
        return HeadLoRA.from_bytes(self.lora.to_bytes())

    def checkpoint(self) -> bytes:
        """Adapter, optimiser and counters (torch.save bytes), to resume training."""
        buf = io.BytesIO()
        torch.save({"lora": self.lora.state_dict(), "scale": self.lora.scale, "opt": self.opt.state_dict(),
                    "steps": self.steps, "baseline": self.baseline, "seen": self.seen}, buf)
        return buf.getvalue()

    def restore(self, data: bytes) -> None:
        state = torch.load(io.BytesIO(data), weights_only=True)
        self.lora.load_state_dict(state["lora"])
        self.lora.scale = state["scale"]
        self.opt.load_state_dict(state["opt"])
        self.steps, self.baseline, self.seen = state["steps"], state["baseline"], state["seen"]
        self.lora.version = self.steps


def trainer_for(drafter, config: TrainerConfig | None = None) -> DVITrainer:
    """A trainer for a drafter with a learnable head (early-exit, feature)."""
    if not drafter.learns_online:
        raise InvalidRequest("drafter", f"the {drafter.kind} drafter has no head to train online "
                                        "(DVI needs early-exit or feature)")
    return DVITrainer(drafter.head_weight, drafter.vocab_ids, drafter.lm_head.weight.shape[0], config)


def _pad(t: torch.Tensor, k: int, value) -> torch.Tensor:
    if t.numel() == k:
        return t
    return torch.cat([t, t.new_full((k - t.numel(),), value)])
