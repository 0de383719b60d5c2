"""Sampling stays lossless: seed-exact with plain sampling, and the tokens follow the target's distribution."""

import pytest
import torch
import transformers

import jetspec_hf.generation
from jetspec_hf import DraftTree, JetSpecStats, tree_generate

from tiny_models import OracleTreeGenerator, tiny_head, tiny_target

SAMPLING = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=20),
    dict(temperature=1.2, top_p=0.9),
    dict(temperature=1.0, min_p=0.05, repetition_penalty=1.3),
]


@pytest.mark.parametrize("settings", SAMPLING, ids=lambda s: "-".join(s))
def test_sampling_is_seed_exact(settings):
    """Every committed token costs exactly one draw from the target's processed distribution, in order, so with the
    same seed the output equals plain sampling, whatever the tree and however many drafts are accepted."""
    target = tiny_target("qwen3")
    head = tiny_head(target)
    ids = torch.tensor([[11, 12, 13, 14]])
    for seed in range(3):
        torch.manual_seed(seed)
        plain = target.generate(ids, do_sample=True, max_new_tokens=24, **settings)
        torch.manual_seed(seed)
        assert torch.equal(
            target.generate(ids, assistant_model=head, do_sample=True, max_new_tokens=24, **settings), plain
        )
        oracle = OracleTreeGenerator(plain[0].tolist(), width=3, depth=5, miss_rate=0.1, seed=seed)
        torch.manual_seed(seed)
        out = target.generate(
            ids,
            custom_generate=tree_generate,
            candidate_generator=oracle,
            do_sample=True,
            max_new_tokens=24,
            **settings,
        )
        assert torch.equal(out, plain)
        assert max(oracle.stats.accepted_lengths) > 1


# ---- distribution test on a small vocabulary -------------------------------------------------------------------

VOCAB, TEMPERATURE, RUNS, ROOT = 10, 1.3, 1200, 4


def small_target():
    # the next token depends strongly on the last one (large embeddings dominate the residual stream), yet every
    # token stays likely enough to be counted (lm_head only x 2)
    model = tiny_target(
        "qwen3", logit_scale=2.0, vocab_size=VOCAB, num_hidden_layers=2, bos_token_id=None, eos_token_id=None
    )
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(10.0)
    return model


class ForceFirstToken(transformers.LogitsProcessor):
    """Makes the prefill's token deterministic, so the first tree step starts from a known root."""

    def __init__(self, prompt_length: int, token: int):
        self.prompt_length, self.token = prompt_length, token

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] == self.prompt_length:
            forced = torch.full_like(scores, float("-inf"))
            forced[:, self.token] = 0.0
            return forced
        return scores


@torch.no_grad()
def exact_pair_distribution(target, ids) -> torch.Tensor:
    """p(t1, t2) of the two tokens after `ids`, `[V, V]`, straight from the target's tempered softmax."""
    p1 = torch.softmax(target(ids).logits[0, -1] / TEMPERATURE, -1)
    extended = torch.cat([ids.expand(VOCAB, -1), torch.arange(VOCAB)[:, None]], dim=1)
    p2 = torch.softmax(target(extended).logits[:, -1] / TEMPERATURE, -1)
    return p1[:, None] * p2


class TargetTreeGenerator(OracleTreeGenerator):
    """Trees from the target's own top-3 tokens at depth 1 and, under each, the top-3 given that token: the tree a
    perfect drafter would build, so most steps accept drafts and the acceptance rule decides the distribution."""

    def __init__(self, pairs):
        self.pairs, self.tree_depth, self.tree_budget, self.stats = pairs, 2, 13, JetSpecStats()

    def draft(self, input_ids, logits_processor, max_depth):
        return max_depth

    def build_tree(self, root_token, max_depth):
        tokens, parents, depths = [root_token], [-1], [0]
        if max_depth == 2:  # only the first step is drafted from the exact pair distribution
            for t1 in self.pairs.sum(1).topk(3).indices.tolist():
                node = len(tokens)
                tokens.append(t1), parents.append(0), depths.append(1)
                for t2 in self.pairs[t1].topk(3).indices.tolist():
                    tokens.append(t2), parents.append(node), depths.append(2)
        return DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths))


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of observed pair counts to exact probabilities; cells expected below 5 are pooled."""
    expected = probs.flatten() * counts.sum()
    observed = counts.flatten().double()
    small = expected < 5
    if small.any():
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor((len(expected) - 1) / 2, dtype=torch.float64)
    return torch.special.gammaincc(dof, statistic / 2).item()


def sample_pairs(target, ids, pairs) -> tuple[torch.Tensor, list[int]]:
    counts = torch.zeros(VOCAB, VOCAB)
    accepted = []
    for seed in range(RUNS):
        torch.manual_seed(10_000 + seed)
        generator = TargetTreeGenerator(pairs)
        out = target.generate(
            ids,
            custom_generate=tree_generate,
            candidate_generator=generator,
            do_sample=True,
            temperature=TEMPERATURE,
            top_k=None,
            max_new_tokens=4,
            logits_processor=transformers.LogitsProcessorList([ForceFirstToken(ids.shape[1], ROOT)]),
        )
        t1, t2 = out[0, ids.shape[1] + 1 : ids.shape[1] + 3].tolist()  # the two tokens of the first tree step
        counts[t1, t2] += 1
        accepted += generator.stats.accepted_lengths[:1]
    return counts, accepted


def accept_first_child_on_mismatch(children, pick, commit):
    """A deliberately wrong acceptance rule: when the target's token is not among the drafted children, accept the
    first drafted child anyway half of the time (a "probably close enough" shortcut)."""
    path, committed, coin = [0], [], torch.Generator().manual_seed(len(children))
    while True:
        token = pick(path[-1])
        child = children[path[-1]].get(token)
        if child is None and children[path[-1]] and torch.rand(1, generator=coin).item() < 0.5:
            token, child = next(iter(children[path[-1]].items()))
        committed.append(token)
        if commit(token) or child is None:
            return path, committed
        path.append(child)


def test_sampled_tokens_follow_the_target_distribution_and_a_wrong_rule_is_caught(monkeypatch):
    target = small_target()
    ids = torch.tensor([[1, 2, 3]])
    pairs = exact_pair_distribution(target, torch.cat([ids, torch.tensor([[ROOT]])], dim=1))
    assert pairs.max() < 0.2  # the test needs a spread-out distribution to have power

    counts, accepted = sample_pairs(target, ids, pairs)
    assert sum(a == 3 for a in accepted) > RUNS // 20  # full-depth acceptance is exercised
    assert chi_square_pvalue(counts, pairs) > 1e-3

    monkeypatch.setattr(jetspec_hf.generation, "walk_tree", accept_first_child_on_mismatch)
    wrong_counts, _ = sample_pairs(target, ids, pairs)
    assert chi_square_pvalue(wrong_counts, pairs) < 1e-6
