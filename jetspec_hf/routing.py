"""Routing `target.generate(..., assistant_model=<JetSpec head>)` to tree decoding.

transformers offers no hook for a tree-verifying assistant: `generate()` only runs linear candidates, and its
assisted path would call the head as if it were a language model. It does offer a public decoding-method
argument, `custom_generate=<callable>`, which keeps all of `generate()`'s preparation. The one wrapper below turns
a call with a JetSpec head into that form; every other call reaches the original `generate` unchanged.

The wrapper is installed when `jetspec_hf` is imported (it must exist before `target.generate` is looked up, which
happens before the call's arguments, a head among them, are evaluated). Turn it off with
`jetspec_hf.uninstall_generate_hook()` or `JETSPEC_HF_NO_GENERATE_HOOK=1`; without it, the same loop runs with
`target.generate(ids, custom_generate=jetspec_hf.tree_generate, candidate_generator=...)`.
"""

import copy
import functools
import inspect

from transformers import GenerationConfig, GenerationMixin, StoppingCriteriaList, StopStringCriteria

from .generation import JetSpecCandidateGenerator, tree_generate

TREE_ARGUMENTS = ("tree_budget", "tree_width", "tree_depth")


def is_jetspec_head(model) -> bool:
    # Duck-typed: a head loaded as remote code (trust_remote_code) is a different class object than ours.
    return bool(getattr(model, "is_jetspec_draft_head", False))


def check_head_fits_target(head, target) -> None:
    """Raise, naming what mismatched, when `head` was not built for `target` (before any forward runs)."""
    head_config, target_config = head.config, target.config.get_text_config()
    if target.config.is_encoder_decoder:
        raise ValueError("JetSpec heads draft for decoder-only targets; this target is an encoder-decoder model")
    problems = []
    if head_config.hidden_size != target_config.hidden_size:
        problems.append(f"hidden size: head {head_config.hidden_size}, target {target_config.hidden_size}")
    target_vocab = target.get_input_embeddings().weight.shape[0]
    if head_config.vocab_size != target_vocab:
        problems.append(f"vocabulary size: head {head_config.vocab_size}, target {target_vocab}")
    num_layers = target_config.num_hidden_layers
    if head_config.num_target_layers != num_layers:
        problems.append(
            f"number of target layers: head trained for {head_config.num_target_layers}, target has {num_layers}"
        )
    bad_taps = [i for i in head_config.target_layer_ids if not 0 <= i <= num_layers - 2]
    if bad_taps:
        # transformers returns the last layer's output already final-normed, so taps stop one layer earlier.
        problems.append(f"target_layer_ids {bad_taps} out of range: valid taps are 0..{num_layers - 2}")
    if len(head_config.target_layer_ids) * head_config.hidden_size != head.fc.in_features:
        problems.append(
            f"{len(head_config.target_layer_ids)} taps do not match the fusion layer ({head.fc.in_features} inputs)"
        )
    if head_config.mask_token_id is None:
        problems.append("mask_token_id is missing from the head config")
    elif not 0 <= head_config.mask_token_id < target_vocab:
        problems.append(
            f"mask_token_id {head_config.mask_token_id} is outside the target vocabulary (size {target_vocab})"
        )
    if problems:
        raise ValueError("this JetSpec head does not fit the target model: " + "; ".join(problems))


def check_target_can_verify(target) -> None:
    if target.config._attn_implementation not in ("eager", "sdpa"):
        raise ValueError(
            f"tree verification needs an attention implementation that takes a 4-D mask; the target uses "
            f"{target.config._attn_implementation!r}. Call target.set_attn_implementation('sdpa') first."
        )


def resolve_tree_arguments(head_config, tree_budget=None, tree_width=None, tree_depth=None) -> dict:
    """Per-call tree settings over the head config's defaults, validated."""
    budget = head_config.tree_budget if tree_budget is None else tree_budget
    width = head_config.tree_width if tree_width is None else tree_width
    depth = head_config.tree_depth if tree_depth is None else tree_depth
    depth = head_config.block_size - 1 if depth is None else depth
    if not 0 <= depth <= head_config.block_size - 1:
        raise ValueError(
            f"tree_depth={depth} is outside 0..{head_config.block_size - 1}: a head with block_size "
            f"{head_config.block_size} drafts at most {head_config.block_size - 1} levels"
        )
    if budget < 1 or width < 1:
        raise ValueError(f"tree_budget and tree_width must be >= 1, got tree_budget={budget}, tree_width={width}")
    return {"tree_budget": int(budget), "tree_width": int(width), "tree_depth": int(depth)}


def move_stop_strings_to_criteria(target, arguments: dict) -> None:
    """`generate()` drops its `tokenizer` argument before calling a custom decoding method, so it could not build
    the `stop_strings` criterion itself: build it here and hand it over as an ordinary stopping criterion."""
    tokenizer = arguments.pop("tokenizer", None)
    config = arguments.get("generation_config") or target.generation_config
    stop_strings = arguments.pop("stop_strings", None) or config.stop_strings
    if not stop_strings:
        return
    if tokenizer is None:
        raise ValueError("stop_strings need the model's tokenizer: pass tokenizer=... to generate()")
    criteria = StoppingCriteriaList(arguments.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    arguments["stopping_criteria"] = criteria
    if config.stop_strings:
        arguments["generation_config"] = config = copy.deepcopy(config)
        config.stop_strings = None


def install_generate_hook() -> None:
    """Wrap `GenerationMixin.generate` once (idempotent) so a JetSpec `assistant_model` runs tree decoding."""
    original = GenerationMixin.generate
    if getattr(original, "_jetspec_original", None) is not None:
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        arguments = signature.bind_partial(self, *args, **kwargs).arguments
        head = arguments.get("assistant_model")
        generation_config = arguments.get("generation_config") or GenerationConfig()
        speculation_type = kwargs.get("speculation_type", getattr(generation_config, "speculation_type", None))
        if not is_jetspec_head(head) or speculation_type == "dflash":
            return original(self, *args, **kwargs)  # untouched, transformers' own DFlash chain path included

        arguments = dict(arguments)
        arguments.pop("self")
        arguments.update(arguments.pop("kwargs", {}))
        if arguments.get("custom_generate") is not None:
            raise ValueError("pass either a JetSpec assistant_model or custom_generate, not both")
        tree_arguments = resolve_tree_arguments(
            head.config, **{name: arguments.pop(name) for name in TREE_ARGUMENTS if name in arguments}
        )
        check_head_fits_target(head, self)
        check_target_can_verify(self)
        move_stop_strings_to_criteria(self, arguments)
        candidate_generator = JetSpecCandidateGenerator(head, self, **tree_arguments)
        arguments.update(
            assistant_model=None,
            custom_generate=tree_generate,
            candidate_generator=candidate_generator,
            jetspec_streamer=arguments.get("streamer"),  # generate() keeps the streamer from custom methods
        )
        result = original(self, **arguments)
        head.last_generate_stats = candidate_generator.stats
        return result

    generate._jetspec_original = original
    GenerationMixin.generate = generate


def uninstall_generate_hook() -> None:
    """Restore transformers' own `GenerationMixin.generate`."""
    original = getattr(GenerationMixin.generate, "_jetspec_original", None)
    if original is not None:
        GenerationMixin.generate = original
