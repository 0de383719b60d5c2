"""Acceptance really happens: trees holding the target's own continuation are accepted to full depth, stops land
inside accepted paths, and the target cache afterwards equals a fresh forward over the committed tokens."""

import torch
from transformers import DynamicCache

from jetspec_hf import tree_generate

from tiny_models import OracleTreeGenerator, tiny_target


def assert_cache_equals_fresh_forward(target, out):
    """The cache returned by generate() must hold exactly the keys/values of every committed token but the last."""
    sequence = out.sequences
    cache = out.past_key_values
    assert cache.get_seq_length() == sequence.shape[1] - 1
    fresh = DynamicCache(config=target.config)
    target(sequence[:, :-1], past_key_values=fresh, use_cache=True)
    for got, want in zip(cache.layers, fresh.layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)


def oracle_generate(target, ids, oracle, **kwargs):
    """`generate()` through `tree_generate` with the oracle's trees; the output holds the cache."""
    return target.generate(
        ids, custom_generate=tree_generate, candidate_generator=oracle, return_dict_in_generate=True, **kwargs
    )


def test_full_depth_paths_are_accepted_in_one_step_and_the_cache_is_exact():
    target = tiny_target("qwen3")
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    plain = target.generate(ids, max_new_tokens=21, do_sample=False, eos_token_id=None)
    depth = 4
    oracle = OracleTreeGenerator(plain[0].tolist(), width=3, depth=depth, miss_rate=0.0, seed=7)
    out = oracle_generate(target, ids, oracle, max_new_tokens=21, eos_token_id=None)
    assert torch.equal(out.sequences, plain)
    # 1 token from the prefill, then 4 steps of depth 4 + the bonus token
    assert oracle.stats.accepted_lengths == [depth + 1] * 4
    assert oracle.stats.target_forwards == 5
    assert all(len(tree) > depth + 1 for tree in oracle.trees)  # the trees really had distractor branches
    assert_cache_equals_fresh_forward(target, out)


def test_eos_inside_an_accepted_path_stops_there():
    target = tiny_target("llama")
    ids = torch.tensor([[7, 7, 21, 33, 48]])
    free = target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)[0].tolist()
    new = free[ids.shape[1] :]
    # a token that first appears as new token k (2 <= k <= 4) becomes "EOS": plain decoding stops right after it.
    # new[0] comes from the prefill and new[1..5] are the depth-5 drafts of the first step, so EOS is a draft there.
    k = next(k for k in range(2, 5) if new[k] not in new[:k])
    eos = new[k]
    plain = target.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=eos)
    # the oracle keeps drafting past EOS (it drafts from the free-running continuation)
    oracle = OracleTreeGenerator(free, width=2, depth=5, seed=1)
    out = oracle_generate(target, ids, oracle, max_new_tokens=20, eos_token_id=eos, output_scores=True)
    assert torch.equal(out.sequences, plain)
    assert out.sequences[0, -1].item() == eos and len(out.scores) == out.sequences.shape[1] - ids.shape[1]
    # the step that reached EOS had drafts beyond it in its tree, and they were not committed
    assert oracle.stats.accepted_lengths == [k]
    assert oracle.trees[-1].depths.max().item() >= 5
    assert_cache_equals_fresh_forward(target, out)


class DeepOracle(OracleTreeGenerator):
    """Drafts deeper than the tokens still allowed, so max_new_tokens lands inside an accepted path."""

    def draft(self, input_ids, logits_processor, max_depth):
        return input_ids.shape[1], self.tree_depth


def test_max_new_tokens_inside_an_accepted_path_is_exact():
    target = tiny_target("qwen3")
    ids = torch.tensor([[10, 20, 30]])
    reference = target.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)[0].tolist()
    for max_new in (1, 2, 3, 7, 8, 13):
        plain = target.generate(ids, max_new_tokens=max_new, do_sample=False, eos_token_id=None)
        oracle = DeepOracle(reference, width=2, depth=5, seed=max_new)
        out = oracle_generate(target, ids, oracle, max_new_tokens=max_new, eos_token_id=None)
        assert torch.equal(out.sequences, plain), max_new
        assert_cache_equals_fresh_forward(target, out)


def test_rejected_branches_leave_no_trace_in_the_cache():
    target = tiny_target("mistral", attn="eager")
    ids = torch.tensor([[5, 6, 7, 8]])
    plain = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=None)
    oracle = OracleTreeGenerator(plain[0].tolist(), width=4, depth=5, miss_rate=0.4, seed=3)
    out = oracle_generate(target, ids, oracle, max_new_tokens=30, eos_token_id=None)
    assert torch.equal(out.sequences, plain)
    assert 1 in oracle.stats.accepted_lengths and max(oracle.stats.accepted_lengths) > 2
    assert_cache_equals_fresh_forward(target, out)
