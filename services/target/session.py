"""One verification session of the target service: a Verifier (specd.speculation.verifier,
the target's side of the round) with what serving many sessions adds: its tenant, its prompt
shared with other sessions' caches, and when it was last answered."""

from __future__ import annotations

import asyncio

from specd.grammar import Grammar
from specd.runtime.loading import LoadedModel
from specd.speculation.verifier import Verifier
from specd.types import SamplingParams


class TargetSession(Verifier):
    def __init__(self, target: LoadedModel, prompt: list[int], sampling: SamplingParams, features: bool = False,
                 tenant: str = "", logprobs: int | None = None, grammar: Grammar | None = None):
        super().__init__(target, prompt, sampling, features, logprobs, grammar)
        self.prefilled = asyncio.Event()  # its prompt is cached (set however its call ends): others may copy it
        self.tenant = tenant  # who the session is for (OpenTarget.tenant), for the KV pool's fair shares
        self.last_reply_at: float | None = None  # when its last verification was answered

    def shared_prefix(self, other: TargetSession) -> int:
        """How many leading prompt positions this session could take from other's cache: the
        prompts' common prefix, short of either's last token (which the first verification
        feeds); 0 where either returns hidden states, which a prefill computes."""
        if self.features or other.features:
            return 0
        a, b = self.seq[:self.prompt_len - 1], other.seq[:other.prompt_len - 1]
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n

    def adopt(self, other: TargetSession, n: int) -> int:
        """Take other's first n prompt positions instead of prefilling them (on the compute
        thread, where other's slot cannot be freed meanwhile); the positions taken (0: none)."""
        copy = getattr(self.kv, "copy_from", None)
        return n if copy is not None and copy(other.kv, n) else 0
