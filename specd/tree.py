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

from specd.sampling import sample


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
                child = len(self.tokens)
                self.tokens.append(token)
                self.parents.append(node)
                self.depths.append(self.depths[node] + 1 if node >= 0 else 0)
                kids[token] = child
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
    best = logits.argmax(-1).tolist()
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
