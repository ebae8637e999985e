"""Draft trees: several continuations verified in one target forward (SpecInfer, Miao et al.
2024; the candidate trie of REST, He et al. 2024).

A lookup drafter often has more than one plausible continuation: the request's own earlier
text says one thing, the datastore's matched occurrences disagree about the next token. Where
a target forward over many tokens costs little more than one over a few (a GPU; on the 2-core
CPU only up to about 7 tokens, docs/engine.md), verifying the alternatives beside the
policy's chain raises the tokens kept per forward.

The tree holds the policy's chain first (nodes 0..main-1, each the child of the one before),
then side branches merged into it as a trie: a branch that starts like an existing path
shares its nodes. Siblings are distinct tokens. Node i sits at position committed + depth[i]
and attends to the committed text and its own ancestors only (`tree_mask`).

Verification walks from the root (the last committed token) down the target's choices:
  greedy: follow the child equal to the target's argmax; stop where no child is (seeded
    sampling: the same walk on the race scores, specd.sampling);
  sampling: at a node whose children are point-mass drafts c_1..c_m, accept c_j with
    probability r(c_j) / sum(r), where r is p with the children already refused removed;
    when all are refused, sample from what is left of p. The emitted token is distributed
    exactly as p (this is sampling from p, asked one candidate at a time), so a tree is as
    lossless as a chain; with one child it is the chain's rule (accept x with p(x)). A chain
    drafted from a distribution q (the hybrid drafter's model chain) keeps its own rule at its
    nodes, judged first: accept x with min(1, p(x) / q(x)), else r = max(p - q, 0), the
    residual a refused chain token leaves, which its point-mass siblings are then asked from
    (SpecInfer's multi-draft rule with one q).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specd.cost_model import ESTIMATES
from specd.errors import InvalidRequest
from specd.sampling import argmax_rows, logits_to_probs, race_scores, sample
from specd.types import SamplingParams, check_branch_count

TREE_BRANCHES = 3  # what `specd bench --trees` runs
TREE_MAX_FED = 64  # committed tokens fed with a tree (a longer prefill verifies a chain)
MAX_TREE_NODES = 32  # chain and side branches together


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)  # -1: a child of the root
    depths: list[int] = field(default_factory=list)  # 0: a child of the root
    main: int = 0  # the first `main` nodes are the policy's chain
    children: dict[int, dict[int, int]] = field(default_factory=dict)  # node (-1 root) -> token -> child

    @classmethod
    def from_chain(cls, chain: list[int]) -> DraftTree:
        tree = cls()
        tree.add(chain, len(chain))
        tree.main = len(tree.tokens)
        return tree

    @classmethod
    def from_nodes(cls, chain: Sequence[int], side_tokens: Sequence[int], side_parents: Sequence[int],
                   vocab_size: int) -> DraftTree:
        """A tree sent over the wire: the chain, then side node i (node len(chain) + i) holding
        side_tokens[i] under node side_parents[i] (-1: the root; an earlier node otherwise).
        InvalidRequest naming the field for a malformed one (a repeated sibling, a parent that
        does not come first, a token outside the vocabulary, too many nodes)."""
        if len(side_parents) != len(side_tokens):
            raise InvalidRequest("side_parents", f"expected {len(side_tokens)} parents, got {len(side_parents)}")
        if len(chain) + len(side_tokens) > MAX_TREE_NODES:
            raise InvalidRequest("side_tokens", f"a tree holds at most {MAX_TREE_NODES} nodes, "
                                                f"got {len(chain) + len(side_tokens)}")
        if side_tokens and not all(0 <= t < vocab_size for t in side_tokens):
            raise InvalidRequest("side_tokens", f"token ids must be in [0, {vocab_size})")
        tree = cls.from_chain(list(chain))
        for token, parent in zip(side_tokens, side_parents):
            if not -1 <= parent < len(tree):
                raise InvalidRequest("side_parents", f"node {len(tree)}'s parent {parent} is not an earlier node")
            if token in tree.children.get(parent, {}):
                raise InvalidRequest("side_tokens", f"node {len(tree)} repeats a sibling's token {token}")
            tree.attach(parent, token)
        return tree

    def attach(self, parent: int, token: int) -> int:
        """Add one node under `parent` (-1: the root); returns its index."""
        child = len(self.tokens)
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(self.depths[parent] + 1 if parent >= 0 else 0)
        self.children.setdefault(parent, {})[token] = child
        return child

    def side(self) -> tuple[list[int], list[int]]:
        """The side nodes' (tokens, parents): what from_nodes takes back beside the chain."""
        return self.tokens[self.main:], self.parents[self.main:]

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, branch: list[int], budget: int) -> int:
        """Merge a continuation from the root, adding at most `budget` new nodes; returns
        the number added (shared prefixes cost nothing)."""
        node, added = -1, 0
        for token in branch:
            kids = self.children.setdefault(node, {})
            child = kids.get(token)
            if child is None:
                if added >= budget:
                    break
                child = self.attach(node, token)
                added += 1
            node = child
        return added

    def row_offsets(self) -> list[int]:
        """Per verification row (row 0 after the root, row i + 1 after node i): how far past
        the committed text the token it predicts sits."""
        return [0] + [d + 1 for d in self.depths]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node`."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def main_prefix(self, path: list[int]) -> int:
        """How many leading nodes of `path` are the policy's chain."""
        n = 0
        while n < len(path) and path[n] == n and n < self.main:
            n += 1
        return n


def choose_branches(proposals: Iterable[Sequence[int]], chain: Sequence[int], length: int,
                    n: int) -> list[list[int]]:
    """The side branches of a tree: the first n proposals, each cut to `length` tokens, that are
    neither the chain's own start (no new node) nor a repeat of one already chosen."""
    chosen: list[list[int]] = []
    for branch in proposals:
        branch = list(branch[:length])
        if branch and branch != list(chain[:len(branch)]) and branch not in chosen:
            chosen.append(branch)
            if len(chosen) == n:
                break
    return chosen


def tree_mask(tree: DraftTree, cached: int, pending: int, dtype: torch.dtype,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(attention mask [1, 1, q, cached + q] additive, position ids [1, q]) for a forward over
    `pending` committed tokens then the tree's nodes, after `cached` cached tokens."""
    n = len(tree)
    q = pending + n
    ancestors = np.zeros((n, n), dtype=bool)  # row i: node i and its ancestors
    for i, parent in enumerate(tree.parents):  # a parent always comes before its children
        if parent >= 0:
            ancestors[i] = ancestors[parent]
        ancestors[i, i] = True
    allowed = torch.zeros(q, cached + q, dtype=torch.bool)
    allowed[:, :cached + pending] = True
    allowed[:pending, cached:cached + pending] = torch.ones(pending, pending, dtype=torch.bool).tril()
    allowed[pending:, cached + pending:] = torch.from_numpy(ancestors)
    mask = torch.zeros(q, cached + q, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    committed = cached + pending
    positions = list(range(cached, committed)) + [committed + d for d in tree.depths]
    return mask[None, None].to(device), torch.tensor([positions], device=device)


@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]  # accepted node indices, root's child first
    next_token: int  # recovered or bonus token after the path


def verify_tree_greedy(logits: torch.Tensor, tree: DraftTree) -> TreeVerdict:
    """logits [len(tree) + 1, V]: row 0 after the root, row i + 1 after node i."""
    best = argmax_rows(logits)
    path, node = [], -1
    while True:
        y = best[node + 1]
        child = tree.children.get(node, {}).get(y)
        if child is None:
            return TreeVerdict(path, y)
        path.append(child)
        node = child


def verify_tree_sampling(p: torch.Tensor, tree: DraftTree, generator: torch.Generator | None,
                         qs: list[torch.Tensor] | None = None) -> TreeVerdict:
    """p [len(tree) + 1, V] target probabilities. qs: the draft distributions of the policy's
    chain (node i < tree.main drawn from qs[i]; None: every node a point mass). A chain node is
    judged first among its siblings with the chain's rule (accept x with min(1, p(x) / q(x)),
    else go on with the residual max(p - q, 0)); the point-mass siblings are then asked one at
    a time against what is left, so the emitted token is distributed exactly as p. (A chain
    node is always its parent's first child: `from_chain` adds the chain before any branch.)"""
    path, node = [], -1
    while True:
        kids = tree.children.get(node, {})
        row = p[node + 1]
        if not kids:
            return TreeVerdict(path, int(sample(row, generator)))
        residual = row.clone()
        u = torch.rand(len(kids), generator=generator, device=p.device).tolist()
        accepted = None
        for j, (token, child) in enumerate(kids.items()):
            if qs is not None and child < tree.main:  # the chain's node: x drawn from q
                q = qs[child]
                if u[j] * float(q[token]) <= float(row[token]):
                    accepted = child
                    break
                residual = torch.clamp(row - q, min=0.0)
                continue
            total = float(residual.sum())
            if total <= 0:
                break
            if u[j] * total <= float(residual[token]):
                accepted = child
                break
            residual[token] = 0.0
        if accepted is None:
            total = residual.sum()
            if total <= 0:  # float round-off: the children held all of p
                residual, total = row, row.sum()
            return TreeVerdict(path, int(sample(residual / total, generator)))
        path.append(accepted)
        node = accepted


def verify_tree(logits: torch.Tensor, tree: DraftTree, sampling: SamplingParams, generator: torch.Generator | None,
                committed: int, chain_q: list[torch.Tensor] | None = None) -> TreeVerdict:
    """A tree forward's logits [len(tree) + 1, V] -> the verdict, by the request's rule: greedy
    walks the argmax, seeded sampling the race scores at each row's position (specd.sampling),
    unseeded sampling asks the children one at a time (verify_tree_sampling; chain_q: the
    chain's draft distributions, None for point masses). committed: the root's position + 1."""
    if sampling.greedy:
        return verify_tree_greedy(logits, tree)
    p = logits_to_probs(logits, sampling)
    if sampling.coupled:
        return verify_tree_greedy(race_scores(p, sampling.seed, [committed + o for o in tree.row_offsets()]), tree)
    return verify_tree_sampling(p, tree, generator, chain_q)


def check_branches(requested: int | None, kind: str, branch_length: int) -> None:
    """InvalidRequest naming `branches` for side branches out of range or asked of a drafter
    (`kind`, proposing alternatives of up to `branch_length` tokens) that proposes none."""
    check_branch_count(requested)
    if requested and not branch_length:
        raise InvalidRequest("branches", f"the {kind} drafter proposes no alternatives; "
                                         "draft trees need a lookup drafter (ngram, retrieval, hybrid)")


def tree_shape(requested: int | None, drafter, policy: str, relaxed: bool) -> tuple[int, int]:
    """(side branches per round, new nodes per branch) for a request: `requested` side branches
    (None: the drafter's default); (0, 0) verifies chains only. InvalidRequest for branches a
    drafter cannot propose. The oracle's chain is right by construction; relaxed verification
    and the target's features (a feature drafter) are defined for chains."""
    if drafter is None:
        check_branch_count(requested)
        return 0, 0
    branches = drafter.branches if requested is None else requested
    check_branches(branches, drafter.kind, drafter.branch_length)
    if policy == "oracle" or relaxed or drafter.needs_target_features:
        return 0, 0
    return branches, drafter.branch_length


class TreePlanner:
    """Grows one request's draft trees: the policy's chain plus the drafter's alternatives, as
    many side nodes as pay for themselves (`budget`), and learns what a side node adds from the
    request's own tree rounds (`observe`). Used alike by the engine and the draft service."""

    def __init__(self, branches: int, length: int):
        self.branches, self.length = branches, length
        # Tokens one side node has added per round so far (specd.cost_model: tree.gain), from a
        # prior measured by a teacher-forced replay on MT-bench greedy answers (docs/engine.md).
        self.gain = ESTIMATES["tree.gain"].seed

    def grow(self, session, seq: list[int], chain: list[int], room: int, sampling: SamplingParams,
             mean_tokens: float, t_target) -> DraftTree:
        """The tree over `chain` (drafted after `seq`), grown breadth-first (every branch's first
        token, then every second one, ...) up to the budget; room: nodes a path may hold (a path
        of n nodes emits n + 1 tokens, and max_new_tokens bounds them)."""
        tree = DraftTree.from_chain(chain)
        budget = self.budget(len(chain), mean_tokens, t_target)
        if not budget or room <= 0:
            return tree
        chosen = choose_branches(session.branches(seq, chain, self.length, sampling), chain,
                                 min(room, self.length), self.branches)
        for depth in range(1, self.length + 1):
            for branch in chosen:
                if budget and len(branch) >= depth:
                    budget -= tree.add(branch[:depth], budget)
        return tree

    def budget(self, k: int, mean_tokens: float, t_target) -> int:
        """Side nodes to add to a k-token chain: the count s that maximises the expected rate
        (m + g * s) / t(k + 1 + s), with m the request's mean tokens per round, g what a side node
        has added so far and t the target's monotone cost curve (t_target). Where the curve is
        flat (a CPU up to a few tokens, a GPU much further) every node is worth adding; where it
        is steep only a high g pays."""
        m = mean_tokens or 1.0
        best, best_rate = 0, m / t_target(k + 1)
        for s in range(1, MAX_TREE_NODES - k + 1):
            rate = (m + self.gain * s) / t_target(k + 1 + s)
            if rate > best_rate:
                best, best_rate = s, rate
        return best

    def observe(self, side: int, accepted: int, on_chain: int) -> None:
        """A tree round with `side` side nodes kept `accepted` drafts, `on_chain` of them the chain's."""
        if side:
            self.gain = ESTIMATES["tree.gain"].moved(self.gain, (accepted - on_chain) / side)
