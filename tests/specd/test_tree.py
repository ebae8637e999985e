"""Draft trees: the trie, its attention mask against plain chain forwards, the cache kept for
the accepted path, and both verification rules (sampling checked against p by chi-square,
with a wrong rule as the negative control)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specd.tree import DraftTree, choose_branches, verify_tree_greedy, verify_tree_sampling

PROMPT = [5, 9, 17, 33, 5, 9, 17, 2]


def sample_tree() -> DraftTree:
    tree = DraftTree.from_chain([11, 12, 13])
    assert tree.add([21, 22], 8) == 2  # a new first token
    assert tree.add([11, 12, 31, 32], 8) == 2  # shares two nodes with the chain
    assert tree.add([11, 41], 8) == 1
    return tree


def test_trie_merges_shared_prefixes_and_respects_the_budget():
    tree = sample_tree()
    assert tree.tokens == [11, 12, 13, 21, 22, 31, 32, 41]
    assert tree.parents == [-1, 0, 1, -1, 3, 1, 5, 0]
    assert tree.depths == [0, 1, 2, 0, 1, 2, 3, 1]
    assert tree.main == 3
    assert tree.add([11, 12, 13], 8) == 0  # already there
    assert tree.add([50, 51, 52], 2) == 2 and tree.tokens[-2:] == [50, 51]
    assert tree.path_to(6) == [0, 1, 5, 6]
    assert tree.main_prefix([0, 1, 5, 6]) == 2 and tree.main_prefix([3, 4]) == 0


def chain_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("pending", [1, 3, len(PROMPT)])
def test_tree_forward_equals_a_chain_forward_per_node(tiny_target, pending):
    """Every node's logits are those of a plain forward over the prompt and its own path: the
    mask hides its siblings and cousins, the positions are its depth (also when several
    committed tokens, or the whole prompt, are fed with the tree)."""
    tree = sample_tree()
    s = tiny_target.session()
    if len(PROMPT) > pending:
        s.extend(PROMPT[:-pending])
    logits = s.extend_tree(PROMPT[-pending:], tree, torch.float32)
    assert logits.shape[0] == len(tree) + 1
    torch.testing.assert_close(logits[0], chain_logits(tiny_target.model, PROMPT), atol=1e-4, rtol=1e-4)
    for node in range(len(tree)):
        path = [tree.tokens[i] for i in tree.path_to(node)]
        torch.testing.assert_close(logits[node + 1], chain_logits(tiny_target.model, PROMPT + path),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("node", [2, 4, 6, 7])
def test_keep_path_leaves_the_cache_of_that_path(tiny_target, node):
    tree = sample_tree()
    path = tree.path_to(node)
    s = tiny_target.session()
    s.extend(PROMPT[:-1])
    s.extend_tree(PROMPT[-1:], tree, torch.float32)
    s.keep_path(len(PROMPT), path)
    assert s.length == len(PROMPT) + len(path)
    tokens = [tree.tokens[i] for i in path]
    logits, _ = s.extend([7, 8], 2)  # decoding goes on after the kept path
    torch.testing.assert_close(logits[1], chain_logits(tiny_target.model, PROMPT + tokens + [7, 8]),
                               atol=1e-4, rtol=1e-4)


def one_hot_logits(rows: list[int], vocab: int = 64) -> torch.Tensor:
    logits = torch.zeros(len(rows), vocab)
    logits[torch.arange(len(rows)), torch.tensor(rows)] = 5.0
    return logits


def test_greedy_follows_the_targets_choices_into_a_branch():
    tree = sample_tree()  # rows: root, then nodes 0..7
    # root -> 11 (node 0), after 11 -> 12 (node 1), after 12 -> 31 (node 5), after 31 -> 9 (no such child)
    logits = one_hot_logits([11, 12, 31, 0, 0, 0, 9, 0, 0])
    v = verify_tree_greedy(logits, tree)
    assert v.path == [0, 1, 5] and v.next_token == 9
    v = verify_tree_greedy(one_hot_logits([21, 0, 0, 0, 22, 3, 0, 0, 0]), tree)
    assert v.path == [3, 4] and v.next_token == 3  # node 4 is a leaf: the bonus token
    assert verify_tree_greedy(one_hot_logits([60] * 9), tree).path == []


P = torch.tensor([0.30, 0.25, 0.15, 0.12, 0.10, 0.08])
RUNS = 4000


def first_tokens(rule, tree: DraftTree) -> Counter:
    p = P.expand(len(tree) + 1, -1).clone()
    g = torch.Generator().manual_seed(0)
    counts = Counter()
    for _ in range(RUNS):
        v = rule(p, tree, g)
        counts[tree.tokens[v.path[0]] if v.path else v.next_token] += 1
    return counts


def pvalue(counts: Counter) -> float:
    obs = np.array([counts.get(i, 0) for i in range(len(P))], float)
    return chisquare(obs, P.numpy().astype(float) * RUNS).pvalue


def wrong_rule(p, tree, g):
    """Tries every child with probability p(c), ignoring the mass the refused ones took."""
    from specd.sampling import sample
    from specd.tree import TreeVerdict

    for token, child in tree.children[-1].items():
        if float(torch.rand(1, generator=g)) < float(p[0, token]):
            return TreeVerdict([child], 0)
    residual = p[0].clone()
    residual[list(tree.children[-1])] = 0
    return TreeVerdict([], int(sample(residual / residual.sum(), g)))


def test_tree_sampling_emits_tokens_distributed_as_p():
    tree = DraftTree.from_chain([3, 1])
    tree.add([0, 4], 4)
    tree.add([5], 4)  # three candidates at the root: 3, 0, 5
    counts = first_tokens(verify_tree_sampling, tree)
    assert all(counts[t] for t in (3, 0, 5, 1))  # accepted, and recovered from the residual
    assert pvalue(counts) > 1e-3
    assert pvalue(first_tokens(wrong_rule, tree)) < 1e-3  # the negative control fails



Q = torch.tensor([0.05, 0.10, 0.05, 0.60, 0.10, 0.10])  # the chain's draft distribution at the root


def chain_first_tokens(rule) -> Counter:
    """First emitted tokens of a tree whose chain token x is drawn from Q each run, with the
    point-mass siblings 0, 5 and 3 (those that differ from x) beside it."""
    p = P.expand(8, -1).clone()
    g = torch.Generator().manual_seed(1)
    counts = Counter()
    for _ in range(RUNS):
        x = int(torch.multinomial(Q, 1, generator=g))
        tree = DraftTree.from_chain([x, 1 if x != 1 else 2])
        for c in (0, 5, 3):
            if c != x:
                tree.add([c, 4], 4)
        v = rule(p[:len(tree) + 1], tree, g, [Q, Q])
        counts[tree.tokens[v.path[0]] if v.path else v.next_token] += 1
    return counts


def siblings_against_p(p, tree, g, qs):
    """Judges the chain token with its own rule, then asks the siblings against p instead of
    the residual max(p - q, 0) the refused chain token leaves."""
    from specd.tree import TreeVerdict

    x = tree.tokens[0]
    if float(torch.rand(1, generator=g)) * float(qs[0][x]) <= float(p[0, x]):
        return TreeVerdict([0], 0)
    siblings = DraftTree()
    for token in list(tree.children[-1])[1:]:
        siblings.add([token], 1)
    v = verify_tree_sampling(p[:len(siblings) + 1], siblings, g)
    return TreeVerdict([tree.children[-1][siblings.tokens[v.path[0]]]] if v.path else [], v.next_token)


def test_tree_sampling_keeps_the_chains_rule_beside_point_mass_siblings():
    """The hybrid drafter's tree: a chain token drawn from q with lookup siblings beside it.
    The chain's node is judged with min(1, p / q), its siblings against the residual; the
    emitted token is distributed as p, and ignoring the residual is caught."""
    counts = chain_first_tokens(verify_tree_sampling)
    assert all(counts[t] for t in range(len(P)))
    assert pvalue(counts) > 1e-3
    assert pvalue(chain_first_tokens(siblings_against_p)) < 1e-3  # the negative control fails


def test_choose_branches_skips_the_chains_own_start_and_repeats():
    proposals = [[5, 6, 7, 8, 9], [1, 2], [5, 6, 7, 0], [3, 4, 5], [8]]
    # [1, 2] is the chain's start; the two [5, 6, 7, ...] agree on their first 3 tokens
    assert choose_branches(proposals, [1, 2, 3], 3, 2) == [[5, 6, 7], [3, 4, 5]]
    assert choose_branches(proposals, [1, 2, 3], 3, 9) == [[5, 6, 7], [3, 4, 5], [8]]
    assert choose_branches([[1, 2, 3, 4]], [1, 2], 4, 2) == [[1, 2, 3, 4]]  # reaches past the chain
    assert choose_branches([[]], [], 4, 2) == []


def test_a_tree_sent_as_side_nodes_is_the_same_tree():
    from specd.tree import DraftTree

    tree = DraftTree.from_chain([1, 2, 3])
    tree.add([1, 5, 6], 8)
    tree.add([4, 2], 8)
    back = DraftTree.from_nodes(tree.tokens[:tree.main], *tree.side(), vocab_size=10)
    assert (back.tokens, back.parents, back.depths, back.main) == (tree.tokens, tree.parents, tree.depths, tree.main)
    assert back.children == tree.children


@pytest.mark.parametrize("tokens, parents, field", [
    ([4], [], "side_parents"),
    ([4], [2], "side_parents"),  # a node's parent must come before it
    ([2], [0], "side_tokens"),  # the chain's own next token again
    ([10], [-1], "side_tokens"),  # outside the vocabulary
    ([4] * 31, [-1] + list(range(1, 31)), "side_tokens"),  # past MAX_TREE_NODES
])
def test_a_malformed_tree_names_the_field(tokens, parents, field):
    from specd.errors import InvalidRequest
    from specd.tree import DraftTree

    with pytest.raises(InvalidRequest) as e:
        DraftTree.from_nodes([1, 2], tokens, parents, vocab_size=10)
    assert e.value.field == field


def test_the_planner_adds_side_nodes_only_where_the_cost_curve_lets_them_pay():
    from specd.tree import MAX_TREE_NODES, TreePlanner

    planner = TreePlanner(3, 4)
    assert planner.budget(4, 2.0, lambda n: 1.0) == MAX_TREE_NODES - 4  # flat: every node
    assert planner.budget(4, 2.0, lambda n: float(n)) == 0  # linear: a side node costs a token
    planner.observe(4, 3, 0)  # four side nodes kept three tokens
    assert planner.gain > 0.05
