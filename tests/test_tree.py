"""Tree building, the verification mask and the acceptance walk, on hand-made inputs."""

import math

import pytest
import torch

from jetspec_hf.tree import DraftTree, build_tree, walk_tree


def logprobs(rows: list[dict[int, float]], vocab: int = 10) -> torch.Tensor:
    """Per-depth log-probs with the given probabilities (the rest spread evenly), full-vocab normalised."""
    out = torch.empty(len(rows), vocab)
    for d, row in enumerate(rows):
        rest = (1.0 - sum(row.values())) / (vocab - len(row))
        out[d] = math.log(rest)
        for token, p in row.items():
            out[d, token] = math.log(p)
    return out


def test_budget_counts_the_root_and_expands_best_node_first():
    lp = logprobs([{1: 0.6, 2: 0.3}, {3: 0.9, 4: 0.05}, {5: 0.5, 6: 0.4}])
    tree = build_tree(root_token=7, draft_logprobs=lp, budget=5, width=2)
    assert len(tree) == 5  # the root plus 4 drafts
    # root expands to [1, 2]; the best node (1, log .6) expands next to [3, 4]; the budget is then spent
    assert tree.tokens.tolist() == [7, 1, 2, 3, 4]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1]
    assert tree.depths.tolist() == [0, 1, 1, 2, 2]
    assert tree.scores[3].item() == pytest.approx(math.log(0.6) + math.log(0.9), abs=1e-5)


def test_best_first_prefers_a_deep_likely_path_over_a_shallow_unlikely_sibling():
    lp = logprobs([{1: 0.9, 2: 0.05}, {3: 0.95, 4: 0.03}, {5: 0.95, 6: 0.03}])
    tree = build_tree(0, lp, budget=7, width=2)
    # expansion order: root -> [1,2]; node 1 (-.105) -> [3,4]; node 3 (-.157) -> [5,6]; node 2 is never expanded
    assert tree.tokens.tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 1, 3, 3]


def test_per_depth_candidates_are_shared_and_depth_is_capped():
    lp = logprobs([{1: 0.5, 2: 0.4}, {3: 0.5, 4: 0.4}])
    tree = build_tree(0, lp, budget=100, width=2)
    assert len(tree) == 1 + 2 + 4  # full binary tree of depth 2, nothing deeper than the draft rows
    assert tree.depths.max().item() == 2
    for node in range(len(tree)):
        if tree.depths[node] == 2:
            assert tree.tokens[node].item() in (3, 4)


def test_width_one_gives_the_argmax_chain():
    lp = logprobs([{4: 0.5}, {5: 0.5}, {6: 0.5}])
    tree = build_tree(9, lp, budget=100, width=1)
    assert tree.tokens.tolist() == [9, 4, 5, 6]
    assert tree.parents.tolist() == [-1, 0, 1, 2]


def test_minus_infinity_candidates_are_never_added():
    lp = torch.full((2, 10), float("-inf"))
    lp[0, 3] = 0.0  # top-k=1 warping left one token at depth 1
    lp[1, 4], lp[1, 5] = math.log(0.6), math.log(0.4)
    tree = build_tree(0, lp, budget=100, width=3)
    assert tree.tokens.tolist() == [0, 3, 4, 5]


def test_budget_one_and_no_drafts_give_the_root_only():
    assert build_tree(5, logprobs([{1: 0.9}]), budget=1, width=3).tokens.tolist() == [5]
    assert build_tree(5, torch.empty(0, 10), budget=10, width=3).tokens.tolist() == [5]
    with pytest.raises(ValueError):
        build_tree(5, logprobs([{1: 0.9}]), budget=0, width=3)


def test_ancestor_mask_and_children():
    tree = DraftTree(
        tokens=torch.tensor([0, 10, 11, 12, 13, 14]),
        parents=torch.tensor([-1, 0, 0, 1, 3, 2]),
        depths=torch.tensor([0, 1, 1, 2, 3, 2]),
    )
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 1, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(tree.ancestor_mask(), expected)
    assert tree.children() == [{10: 1, 11: 2}, {12: 3}, {14: 5}, {13: 4}, {}, {}]


def make_walk(picks: dict[int, int], stop_after: set[int] = frozenset()):
    visited, committed = [], []

    def pick(node):
        visited.append(node)
        return picks[node]

    def commit(token):
        committed.append(token)
        return len(committed) in stop_after

    return pick, commit, visited, committed


def test_walk_follows_the_target_through_a_non_first_branch_and_adds_the_bonus_token():
    children = [{10: 1, 11: 2}, {12: 3}, {14: 5}, {13: 4}, {}, {}]
    pick, commit, visited, committed = make_walk({0: 11, 2: 14, 5: 99})
    path, tokens = walk_tree(children, pick, commit)
    assert path == [0, 2, 5]
    assert tokens == committed == [11, 14, 99]  # two accepted drafts, then the target's own token
    assert visited == [0, 2, 5]  # the target's choice is asked for exactly once per committed token


def test_walk_stops_at_the_first_mismatch_and_when_told_to_stop():
    children = [{10: 1, 11: 2}, {12: 3}, {14: 5}, {13: 4}, {}, {}]
    pick, commit, _, _ = make_walk({0: 42})
    assert walk_tree(children, pick, commit) == ([0], [42])
    pick, commit, visited, committed = make_walk({0: 10, 1: 12, 3: 13, 4: 7}, stop_after={2})
    assert walk_tree(children, pick, commit) == ([0, 1], [10, 12])  # stop (say EOS) right after the 2nd token
    assert visited == [0, 1] and committed == [10, 12]
