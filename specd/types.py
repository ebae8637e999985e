"""Small domain types shared by the engine, drafters and policies.

Glossary (used the same way everywhere in specd):
- *committed* tokens: prompt + tokens already emitted; never change again.
- *draft* tokens: proposed by the drafter after the committed ones, not yet verified.
- *accepted* tokens: the leading draft tokens that verification kept.
- *recovered* token: the token the target emits at the first rejected position.
- *bonus* token: the token the target emits after a window whose drafts were all accepted.
- a *round*: draft a window, verify it in one target forward, commit accepted + recovered/bonus.
- p: target distribution, q: draft distribution, x: a draft token, H(q): entropy in nats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from specd.errors import InvalidRequest


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. temperature 0 means greedy; top_k 0 and top_p 1 mean off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def coupled(self) -> bool:
        """Seeded sampling draws every token from the seed and its position alone
        (specd.sampling.race_noise), so the output is the target alone's for that seed
        whatever was drafted."""
        return not self.greedy and self.seed is not None

    def validate(self, max_new_tokens_limit: int = 1 << 20) -> None:
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise InvalidRequest("temperature", f"must be in [0, 100], got {self.temperature}")
        if not (0 <= self.top_k <= 1 << 20):
            raise InvalidRequest("top_k", f"must be >= 0 (0 disables it), got {self.top_k}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p}")
        if not (1 <= self.max_new_tokens <= max_new_tokens_limit):
            raise InvalidRequest(
                "max_new_tokens", f"must be in [1, {max_new_tokens_limit}], got {self.max_new_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise InvalidRequest("seed", f"must be a non-negative 64-bit integer, got {self.seed}")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop", "stop strings must be non-empty")


@dataclass(frozen=True)
class SpecParams:
    """How to speculate. policy "none" decodes with the target alone (the baseline).

    policy_params override the policy's defaults by name (e.g. {"h": 0.4} for svip);
    max_draft_tokens, when set, replaces the policy's own cap. relaxed turns on AdaSD's lossy
    JS-distance verification (adasd only). task_tag keys the shared adaptive state. branches:
    side branches verified beside the policy's chain as a draft tree (specd.tree; lookup
    drafters only; None: the drafter's default, 0: chains only).
    """

    policy: str = "constant"
    max_draft_tokens: int | None = None
    policy_params: dict = field(default_factory=dict)
    task_tag: str = "default"
    relaxed: bool = False
    branches: int | None = None


@dataclass(frozen=True, slots=True)
class DraftStep:
    """What a stopping policy sees after each drafted token."""

    index: int  # 1-based count of tokens drafted this round, this one included
    position: int  # index of this token among the generated tokens (0 = first generated)
    token: int  # the draft token x
    prob: float  # q(x)
    max_prob: float  # max_v q(v)
    entropy: float  # H(q) in nats
    hidden: torch.Tensor | None = None  # draft's last hidden state that produced q ([hidden])
    match_len: int = 0  # n-gram drafters: length of the matched suffix this token continues (else 0)
    retrieved: bool = False  # retrieval: the match is in the datastore, not in this request's text
    # n-gram drafters: how many occurrences of the match voted on this token (those whose text
    # agreed with the window so far; 0: unknown), and the share of them it follows
    votes: int = 0
    support: float = 1.0
    noise: float = -1.0  # coupled sampling: E(x), the race noise of x at its position (< 0: not coupled)


@dataclass(frozen=True, slots=True)
class RoundOutcome:
    """What verification decided about one round, fed back to the policy."""

    num_drafted: int
    num_accepted: int  # strictly accepted (relaxed acceptances are not counted here)
    entropies: tuple[float, ...]  # H(q) of each drafted token, in draft order
    hit_cap: bool  # drafting ended at the hard cap, not by the policy's own decision
    js_distances: tuple[float, ...] = ()  # JS(p, q) per verified position (relaxed mode only)
    steps: tuple[DraftStep, ...] = ()  # what the policy saw for each drafted token, in draft order
    # A token the policy dropped after the kept ones (Decision.DROP), and whether the target's
    # next token turned out to be that token (None when a kept draft was rejected first).
    dropped: DraftStep | None = None
    dropped_accepted: bool | None = None

    @property
    def all_accepted(self) -> bool:
        return self.num_accepted == self.num_drafted
