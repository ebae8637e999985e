"""Per-request speculation statistics: plain numbers recorded by the engine; exporters
(CLI JSON, REST spec_stats, Prometheus) read them.

drafted / accepted count draft tokens; a verification is one target forward (the prefill
counts as the first). Mean accepted tokens per verification (MAT) counts the recovered or
bonus token each verification also yields: MAT = accepted / verifications + 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    policy: str
    drafter: str | None
    prompt_tokens: int = 0
    new_tokens: int = 0  # tokens returned to the caller
    drafted: int = 0
    accepted: int = 0
    relaxed_accepted: int = 0  # accepted only by AdaSD's lossy relaxed rule
    verifications: int = 0
    draft_lengths: list[int] = field(default_factory=list)  # tokens drafted per round
    accepted_lengths: list[int] = field(default_factory=list)  # tokens accepted per round
    # Per drafted token that verification judged (up to and including the first rejection):
    # H(q) and whether it was accepted. Discarded tokens after a rejection are not judged.
    judged_entropies: list[float] = field(default_factory=list)
    judged_accepted: list[bool] = field(default_factory=list)
    lossy: bool = False  # output may differ from the target alone (relaxed verification)
    tree_rounds: int = 0  # rounds verified as a draft tree (chain plus side branches)
    branch_accepted: int = 0  # of those, rounds whose accepted path left the policy's chain
    grammar_drafted: int = 0  # drafts the grammar forced (structured output), counted in drafted too
    wall_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    finish_reason: str = ""

    def record_round(self, drafted: int, accepted: int, strict: int, relaxed: int = 0,
                     entropies: Sequence[float] = ()) -> None:
        """One verification: `drafted` tokens verified (a tree's every node), `accepted` kept,
        the leading `strict` of the policy's chain accepted by the lossless rule and `relaxed`
        only by AdaSD's; entropies: H(q) of the chain's tokens, in order (where known). The
        chain's judged tokens are those up to and including the first rejection."""
        self.verifications += 1
        if not drafted:
            return
        self.drafted += drafted
        self.accepted += accepted
        self.relaxed_accepted += relaxed
        self.draft_lengths.append(drafted)
        self.accepted_lengths.append(accepted)
        judged = min(strict + 1, len(entropies))
        self.judged_entropies.extend(entropies[:judged])
        self.judged_accepted.extend(i < strict for i in range(judged))

    def record_tree_round(self, nodes: int, accepted: int, on_chain: int, entropies: Sequence[float] = ()) -> None:
        """One verification of a draft tree of `nodes` nodes: `accepted` kept along its path, the
        leading `on_chain` of them the policy's chain (the rest from a side branch)."""
        self.record_round(nodes, accepted, on_chain, 0, entropies)
        self.tree_rounds += 1
        self.branch_accepted += accepted > on_chain

    @property
    def mean_accepted_tokens(self) -> float:
        return self.accepted / self.verifications + 1.0 if self.verifications else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {
            "policy": self.policy,
            "drafter": self.drafter,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "discarded": self.drafted - self.accepted,
            "relaxed_accepted": self.relaxed_accepted,
            "verifications": self.verifications,
            "tree_rounds": self.tree_rounds,
            "branch_accepted": self.branch_accepted,
            "grammar_drafted": self.grammar_drafted,
            "mean_accepted_tokens": round(self.mean_accepted_tokens, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "draft_lengths": list(self.draft_lengths),
            "accepted_lengths": list(self.accepted_lengths),
            "wall_time_s": round(self.wall_time_s, 4),
            "draft_time_s": round(self.draft_time_s, 4),
            "verify_time_s": round(self.verify_time_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "lossy": self.lossy,
            "finish_reason": self.finish_reason,
        }
