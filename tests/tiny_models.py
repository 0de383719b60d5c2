"""Tiny real transformers models built from configs, and heads that fit them (shared by the test modules)."""

import torch
import transformers

from jetspec_hf import JetSpecConfig, JetSpecDraftHead

VOCAB = 96
HIDDEN = 32
LAYERS = 4

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=None,
    bos_token_id=1,
    eos_token_id=2,
)

# TrainingArguments of a quiet, reproducible CPU training run that saves nothing (the tests add the rest).
CPU_TRAINING = dict(use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True, seed=0)

# Every decoder-only family named in the core issue that transformers builds from a config. Sliding-window families
# (Mistral, Gemma 2/3) keep their window: tree decoding supports them while the sequence fits in the window.
TARGETS = {
    "qwen3": lambda c: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**c, head_dim=8)),
    "qwen2": lambda c: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**c)),
    "llama": lambda c: transformers.LlamaForCausalLM(transformers.LlamaConfig(**c)),
    "mistral": lambda c: transformers.MistralForCausalLM(transformers.MistralConfig(**{"sliding_window": 4096, **c})),
    "qwen3_moe": lambda c: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(**c, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    ),
    "gemma": lambda c: transformers.GemmaForCausalLM(transformers.GemmaConfig(**c, head_dim=8)),
    "gemma2": lambda c: transformers.Gemma2ForCausalLM(
        transformers.Gemma2Config(**{"head_dim": 8, "sliding_window": 4096, **c})
    ),
    "gemma3": lambda c: transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(**{"head_dim": 8, "sliding_window": 4096, **c})
    ),
}


def tiny_target(arch: str = "qwen3", attn: str = "sdpa", seed: int = 0, logit_scale: float = 8.0, **config):
    torch.manual_seed(seed)
    model = TARGETS[arch]({**_COMMON, **config})
    model.set_attn_implementation(attn)
    # Random weights give flat next-token distributions; sharpen them (lm_head x logit_scale) so greedy picks are far
    # from ties and the token-identity tests compare decisions, not rounding noise.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(logit_scale)
    return model.eval()


def tiny_head(target, causal: bool = True, block_size: int = 6, seed: int = 0, **config) -> JetSpecDraftHead:
    torch.manual_seed(seed)
    text = target.config.get_text_config()
    sizes = dict(intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    head_config = JetSpecConfig(
        vocab_size=target.get_input_embeddings().weight.shape[0],
        hidden_size=text.hidden_size,
        num_target_layers=text.num_hidden_layers,
        target_layer_ids=[0, text.num_hidden_layers - 2],
        mask_token_id=target.get_input_embeddings().weight.shape[0] - 1,
        block_size=block_size,
        causal=causal,
        **{**sizes, "tree_budget": 16, "tree_width": 3, **config},
    )
    return JetSpecDraftHead(head_config).eval()


class OracleTreeGenerator:
    """Drafts trees that contain the target's own continuation (known from plain decoding) among distractors.

    It plugs into `tree_generate` like `JetSpecCandidateGenerator` (same duck-typed interface) without a head, so
    tests control exactly which path is in the tree: at every depth the true token sits at a random rank among
    `width` siblings, every sibling gets distractor children, and with `miss_rate` the true token is left out of a
    level so acceptance stops there.
    """

    target_layer_ids: list[int] = []

    def __init__(
        self, continuation: list[int], width: int = 3, depth: int = 5, budget: int = 64, miss_rate=0.0, seed=0
    ):
        from jetspec_hf import JetSpecStats

        self.continuation, self.width, self.tree_depth, self.tree_budget = continuation, width, depth, budget
        self.miss_rate = miss_rate
        self.rng = torch.Generator().manual_seed(seed)
        self.stats = JetSpecStats()
        self.trees = []

    def extend_context(self, hidden_rows):
        pass

    def draft(self, input_ids, logits_processor, max_depth):
        return input_ids.shape[1], max_depth

    def build_tree(self, root_token, draft):
        from jetspec_hf import DraftTree

        position, max_depth = draft  # the root is the token at index position-1 of the full sequence
        truth = self.continuation[position : position + max_depth]
        tokens, parents, depths = [root_token], [-1], [0]
        true_node = 0
        for depth, true_token in enumerate(truth, start=1):
            hit = torch.rand(1, generator=self.rng).item() >= self.miss_rate
            others = [t for t in torch.randperm(VOCAB - 1, generator=self.rng).tolist() if t != true_token]
            siblings = others[: self.width - 1]
            if hit:
                siblings.insert(int(torch.randint(self.width, (1,), generator=self.rng)), true_token)
            next_true = None
            for token in siblings:
                if len(tokens) >= self.tree_budget:
                    break
                tokens.append(token), parents.append(true_node), depths.append(depth)
                if token == true_token:
                    next_true = len(tokens) - 1
                elif len(tokens) < self.tree_budget:  # a distractor child under a wrong branch
                    parents.append(len(tokens) - 1), tokens.append(true_token), depths.append(depth + 1)
            if next_true is None:
                break
            true_node = next_true
        tree = DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths), torch.zeros(len(tokens)))
        self.trees.append(tree)
        return tree


# A Python process in which jetspec_hf (and the repository's source folders) cannot be imported: what a user
# without the package has, for remote-code tests.
_BLOCK_JETSPEC = """
import sys

class BlockJetspec:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jetspec_hf", "modeling"):
            raise ImportError(f"{name} is blocked in this test")

sys.meta_path.insert(0, BlockJetspec())
try:
    import jetspec_hf  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("jetspec_hf is importable: the test would not test remote code")
"""


def run_without_jetspec(script: str, args, workdir) -> None:
    """Run `script` (which prints REMOTE_OK at the end) with `args` in a fresh process without jetspec_hf."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP")}
    env.update(HF_MODULES_CACHE=str(workdir / "hf_modules"), HF_HUB_OFFLINE="1", JETSPEC_HF_NO_GENERATE_HOOK="1")
    result = subprocess.run(
        [sys.executable, "-c", _BLOCK_JETSPEC + script, *map(str, args)],
        cwd=workdir,  # nothing of the repository on sys.path
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and "REMOTE_OK" in result.stdout, result.stdout + result.stderr[-4000:]
