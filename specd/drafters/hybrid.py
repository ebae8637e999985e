"""hybrid: a model drafter's chain with a lookup drafter's proposal beside it, verified together
as one draft tree (specd.tree).

The two kinds of drafter are right at different places: at temperature 1 the union of the
positions where either is right is much larger than either alone (docs/benchmarks.md).
Choosing one proposal per round gets little of that union (no cheap signal says which one is
right), so the hybrid keeps both: the policy drafts the model's chain as usual, and the lookup
drafter's own proposal (the continuation it would have drafted alone), then its alternatives,
become side branches.
Verification walks down whichever the target agrees with. The engine sizes the side branches
by what they have added so far against the cost curve (`TreePlanner.budget`), so a steep
verification cost keeps them short.

The model chain keeps its q: unseeded sampling verifies its node with the chain's rule and
the lookup siblings against the residual (`verify_tree_sampling`), seeded and greedy runs walk
the target's own choices; all three are lossless.
"""

from __future__ import annotations

from specd.drafters.base import Drafter, ModelDraftSession
from specd.drafters.ngram import NgramDrafter, NgramSession
from specd.types import SamplingParams


class HybridSession(ModelDraftSession):
    """The model session drafts (`next`, `rollback`, its KV cache); the lookup session offers the
    side branches."""

    def __init__(self, model: ModelDraftSession, lookup: NgramSession):
        super().__init__(model.kv, model.vocab_size)
        self.lookup = lookup

    def branches(self, seq, chain, length, params=None):
        """The lookup drafter's own proposal after seq, then its alternatives."""
        own = self._proposal(seq, length, params or SamplingParams())
        return ([own] if own else []) + self.lookup.branches(seq, chain, length, params)

    def _proposal(self, seq: list[int], length: int, params: SamplingParams) -> list[int]:
        """What the lookup drafter would draft after seq, up to `length` tokens (with coupled
        sampling its race rule: the candidate the target's noise favours)."""
        lookup, ext, out = self.lookup, list(seq), []
        lookup.rollback(len(seq))  # a fresh walk from seq
        while len(out) < length and (d := lookup.next(ext, params, None, False)) is not None:
            out.append(d.token)
            ext.append(d.token)
        lookup.rollback(len(seq))
        return out


class HybridDrafter(Drafter):
    kind = "hybrid"
    branches = 2  # the lookup's proposal and one alternative
    branch_length = 4

    def __init__(self, model: Drafter, lookup: NgramDrafter):
        if not model.has_distribution or lookup.has_distribution:
            raise ValueError("a hybrid drafter pairs a model drafter's chain with a lookup drafter's "
                             "branches")
        if model.needs_target_features:
            # Its session drafts from the target's features, which HybridSession (a plain model
            # session over the drafter's KV cache) neither holds nor is handed.
            raise ValueError(f"a hybrid drafter's chain comes from a drafter with a KV session "
                             f"(early-exit, hf), not {model.kind}")
        self.model, self.lookup = model, lookup

    @property
    def name(self) -> str:
        return f"{self.model.name}+{self.lookup.name}"

    def open(self, vocab_size: int | None = None) -> HybridSession:
        model = self.model.open(vocab_size)
        return HybridSession(model, self.lookup.open(model.vocab_size))
