"""Tree speculative decoding as a `generate()` decoding method.

`tree_generate` has the signature of transformers' `_sample` and is handed to `generate(custom_generate=...)`, so
`generate()` does all its usual preparation (generation config, logits processors, stopping criteria, cache, 2-D
mask and positions) and this module only runs the decoding loop. One step reads top to bottom:

    draft   - one head forward over [anchor, MASK x (block_size-1)] gives per-depth draft log-probs
    build   - best-first token tree under a node budget
    verify  - ONE target forward over every tree node, with an ancestor mask and positions root + depth
    accept  - walk the tree following the token the target itself picks at each node
    commit  - keep the walked path in the target cache, drop the rest, feed its tapped hidden states to the head

Whatever the draft, every committed token is the one plain decoding would pick (argmax, or one draw from the
processed distribution with the same random stream), so the output is that of `generate()` without the head.
"""

import time
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .tree import DraftTree, build_tree, walk_tree


@dataclass
class JetSpecStats:
    """What one `generate()` call did. Reachable as `head.last_generate_stats` after the call."""

    accepted_lengths: list[int] = field(default_factory=list)  # tokens committed by each verify step (acc + 1)
    tree_sizes: list[int] = field(default_factory=list)  # nodes verified in each step, root included
    target_forwards: int = 0  # prefill included
    head_forwards: int = 0
    new_tokens: int = 0
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0  # head forward + draft logits
    build_seconds: float = 0.0  # tree building
    verify_seconds: float = 0.0  # target tree forward
    accept_seconds: float = 0.0  # walk, logits processors, sampling, stopping criteria, cache surgery

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify forward (the paper's accepted length, bonus token included)."""
        return sum(self.accepted_lengths) / max(len(self.accepted_lengths), 1)

    def as_dict(self) -> dict:
        return {**self.__dict__, "tau": self.tau}


class JetSpecCandidateGenerator:
    """Owns drafting: the head's context cache across steps, the per-depth draft distributions and the tree.

    The decoding loop calls `extend_context` with the tapped target hidden states of newly committed positions, then
    `draft` and `build_tree` once per step. Subclasses can draft trees another way (tests build oracle trees).
    """

    def __init__(self, head, target, tree_budget: int, tree_width: int, tree_depth: int):
        self.head = head
        self.input_embeddings = target.get_input_embeddings()
        output_embeddings = target.get_output_embeddings()
        # The draft never changes the output (the target verifies every token), so it runs in the head's dtype end to
        # end: a bf16 head beside an fp32 target projects its slots with a bf16 copy of the target's lm_head. On CPUs
        # with AMX that projection (the largest part of drafting) is ~5x faster than in fp32.
        weight = output_embeddings.weight.detach()
        bias = getattr(output_embeddings, "bias", None)
        self.draft_projection = (weight.to(head.dtype), None if bias is None else bias.detach().to(head.dtype))
        self.vocab_size = weight.shape[0]
        self.target_layer_ids = list(head.config.target_layer_ids)
        self.tree_budget, self.tree_width, self.tree_depth = tree_budget, tree_width, tree_depth
        self.cache = DynamicCache()  # context keys/values only: block keys/values are cropped after every forward
        self.pending_context: list[torch.Tensor] = []
        self.stats = JetSpecStats()

    def extend_context(self, hidden_rows: torch.Tensor) -> None:
        """`hidden_rows` `[k, len(taps) * H]`: concatenated taps of k newly committed positions, in order."""
        self.pending_context.append(hidden_rows)

    @torch.no_grad()
    def draft(self, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList, max_depth: int) -> torch.Tensor:
        """Per-depth draft log-probs `[max_depth, V]` for the block anchored at `input_ids[0, -1]`."""
        head, config = self.head, self.head.config
        if max_depth == 0:  # only the root is left to verify: nothing to draft
            return torch.empty(0, self.vocab_size)
        context = torch.cat(self.pending_context).to(head.device, head.dtype)[None]
        self.pending_context = []
        num_cached = self.cache.get_seq_length()
        block_ids = torch.full((1, config.block_size), config.mask_token_id, dtype=torch.long, device=input_ids.device)
        block_ids[0, 0] = input_ids[0, -1]
        noise_embeds = self.input_embeddings(block_ids).to(head.device, head.dtype)
        positions = torch.arange(num_cached, num_cached + context.shape[1] + config.block_size, device=head.device)
        out = head(noise_embeds, context, position_ids=positions[None], past_key_values=self.cache, use_cache=True)
        self.cache.crop(-config.block_size)
        self.stats.head_forwards += 1
        slots = out.last_hidden_state[0, 1 : 1 + max_depth]  # slot d drafts depth d (in-place heads)
        weight, bias = self.draft_projection
        logits = nn.functional.linear(slots.to(weight.device), weight, bias).float()
        if len(logits_processor):
            # Warp the draft like the target (temperature, top-k/p, penalties) so the tree follows what gets picked.
            logits = logits_processor(input_ids.expand(max_depth, -1), logits)
        return torch.log_softmax(logits, dim=-1)

    def build_tree(self, root_token: int, draft_logprobs: torch.Tensor) -> DraftTree:
        return build_tree(root_token, draft_logprobs.cpu(), self.tree_budget, self.tree_width)


def fast_draft_dtype(target_dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """The dtype to load a head in for drafting beside a target of `target_dtype` on `device`.

    bf16 for an fp32 target on a CPU with native bf16 matrix units (AMX tiles or AVX512-bf16): drafting precision never
    changes the output, and there the draft is several times cheaper in bf16. Otherwise the target's dtype.
    """
    device = torch.device(device)
    cpu = device.type == "cpu"
    cpu_has_bf16 = cpu and (torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())
    return torch.bfloat16 if target_dtype == torch.float32 and cpu_has_bf16 else target_dtype


def tree_attention_mask(
    tree: DraftTree, prefix_keep: torch.Tensor | None, past_len: int, dtype, device
) -> torch.Tensor:
    """Additive `[1, 1, n, past_len + n]` mask: every node sees the (unpadded) prefix, itself and its ancestors."""
    n = len(tree)
    keep = torch.ones(n, past_len + n, dtype=torch.bool)
    if prefix_keep is not None:
        keep[:, :past_len] = prefix_keep[:past_len]
    keep[:, past_len:] = tree.ancestor_mask()
    mask = torch.zeros(1, 1, n, past_len + n, dtype=dtype)
    return mask.masked_fill_(~keep, torch.finfo(dtype).min).to(device)


def keep_path_in_cache(cache: Cache, past_len: int, path: list[int]) -> None:
    """Compact the verified tree in the target cache to the accepted path: `past_len + path[i]` -> `past_len + i`.

    The path's nodes were computed at positions `root + depth`, which are their final positions, so the result is
    exactly the cache that plain decoding of these tokens would have built.
    """
    # Nodes already in place (the root, and a path that runs down the first-created branch) need no copy.
    first_moved = next((i for i, node in enumerate(path) if node != i), len(path))
    new_len = past_len + len(path)
    sources = {}  # one index tensor per device, not per layer
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        if first_moved < len(path):
            device = layer.keys.device
            if device not in sources:
                sources[device] = past_len + torch.tensor(path[first_moved:], device=device)
            src = sources[device]
            # index_select copies the rows out first, so overlapping source and destination slots are safe.
            layer.keys.narrow(2, past_len + first_moved, len(src)).copy_(layer.keys.index_select(2, src))
            layer.values.narrow(2, past_len + first_moved, len(src)).copy_(layer.values.index_select(2, src))
        layer.keys = layer.keys[:, :, :new_len]
        layer.values = layer.values[:, :, :new_len]
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = new_len


def check_tree_cache(cache: Cache, max_tokens: int) -> None:
    """Trees branch the cache, so only layers whose keys we can gather and crop are supported."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicSlidingWindowLayer:
            if max_tokens > layer.sliding_window - 1:
                raise ValueError(
                    f"layer {i} of the target uses sliding-window attention (window {layer.sliding_window}); tree "
                    f"decoding supports it only while prompt + max_new_tokens + tree budget ({max_tokens}) fits in "
                    "the window. Lower max_new_tokens or tree_budget."
                )
        elif type(layer) is not DynamicLayer:
            raise ValueError(
                f"cache layer {type(layer).__name__} (layer {i}) is not supported by JetSpec tree decoding: use the "
                "default dynamic cache (no cache_implementation='static'/'offloaded'/'quantized')"
            )


def check_generation_config(generation_config: GenerationConfig, batch_size: int) -> None:
    """Settings the tree loop cannot honour get an error naming the setting, before any forward."""
    unsupported = {
        "num_beams": generation_config.num_beams not in (None, 1),
        "num_return_sequences": generation_config.num_return_sequences not in (None, 1),
        "output_attentions": bool(generation_config.output_attentions),
        "output_hidden_states": bool(generation_config.output_hidden_states),
        "use_cache=False": generation_config.use_cache is False,
        "prefill_chunk_size": generation_config.prefill_chunk_size is not None,
        "prompt_lookup_num_tokens": generation_config.prompt_lookup_num_tokens is not None,
        "assistant_early_exit": generation_config.assistant_early_exit is not None,
        "use_mtp": bool(getattr(generation_config, "use_mtp", False)),
    }
    for name, bad in unsupported.items():
        if bad:
            value = getattr(generation_config, name.split("=")[0])
            raise ValueError(f"JetSpec tree decoding does not support `{name}` (got {value})")
    if batch_size != 1:
        raise ValueError(f"JetSpec tree decoding supports batch size 1 only, got a batch of {batch_size} sequences")


def tree_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer=None,
    candidate_generator: JetSpecCandidateGenerator | None = None,
    jetspec_streamer=None,
    **model_kwargs,
) -> GenerateDecoderOnlyOutput | torch.LongTensor:
    """The decoding method handed to `generate(custom_generate=tree_generate, candidate_generator=...)`.

    `generate()` does not pass its streamer to custom decoding methods (it only puts the prompt), so the routing
    wrapper hands it over again as `jetspec_streamer`.
    """
    if candidate_generator is None:
        raise ValueError(
            "tree_generate needs a `candidate_generator` (pass assistant_model=<JetSpec head> to generate)"
        )
    if synced_gpus:
        raise ValueError("JetSpec tree decoding does not support `synced_gpus`")
    check_generation_config(generation_config, input_ids.shape[0])
    streamer = jetspec_streamer if jetspec_streamer is not None else streamer
    cache_name = "cache" if "cache" in model_kwargs else "past_key_values"  # transformers 5.24 renamed the argument
    cache = model_kwargs[cache_name]
    stats = candidate_generator.stats
    taps = [layer + 1 for layer in candidate_generator.target_layer_ids]  # hidden_states[0] is the embedding output
    tap_kwargs = {"output_hidden_states": taps} if taps else {}
    return_dict = generation_config.return_dict_in_generate
    scores = () if return_dict and generation_config.output_scores else None
    raw_logits = () if return_dict and generation_config.output_logits else None

    def tapped_rows(outputs, rows) -> torch.Tensor:
        return torch.cat([outputs.hidden_states[t][0, rows] for t in taps], dim=-1)

    # Prefill: one ordinary forward over the prompt.
    start = time.perf_counter()
    check_tree_cache(cache, generation_config.max_length + candidate_generator.tree_budget)
    prompt_len = input_ids.shape[1]
    pad_keep = model_kwargs.get("attention_mask")
    pad_keep = pad_keep[0].bool().cpu() if pad_keep is not None else None  # None: no padding anywhere
    model_inputs = model.prepare_inputs_for_generation(input_ids, is_first_iteration=True, **model_kwargs)
    outputs = model(**model_inputs, **tap_kwargs, return_dict=True)
    stats.target_forwards += 1
    if taps:
        prompt_rows = pad_keep.nonzero()[:, 0] if pad_keep is not None else torch.arange(prompt_len)
        candidate_generator.extend_context(tapped_rows(outputs, prompt_rows.to(input_ids.device)))
    stats.prefill_seconds += time.perf_counter() - start

    sequence = input_ids
    finished = False

    def pick(next_token_logits: torch.Tensor) -> int:
        """The token plain decoding would produce from the target's logits (`[1, V]`, float32) after `sequence`."""
        nonlocal scores, raw_logits
        next_scores = logits_processor(sequence, next_token_logits) if len(logits_processor) else next_token_logits
        if generation_config.do_sample:
            token = torch.multinomial(nn.functional.softmax(next_scores, dim=-1), num_samples=1)
        else:
            token = torch.argmax(next_scores, dim=-1, keepdim=True)
        if scores is not None:
            scores += (next_scores,)
        if raw_logits is not None:
            raw_logits += (next_token_logits,)
        return int(token)

    def commit(token: int) -> bool:
        """Append and stream `token`; say whether generation stops after it."""
        nonlocal sequence, finished
        sequence = torch.cat([sequence, sequence.new_tensor([[token]])], dim=-1)
        if streamer is not None:
            streamer.put(torch.tensor([token]))
        finished = bool(stopping_criteria(sequence, scores).any())
        return finished

    commit(pick(outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)))
    del outputs

    while not finished:
        past_len = sequence.shape[1] - 1  # the root (last committed token) is not in the cache yet
        if pad_keep is not None:
            pad_keep = torch.cat([pad_keep, torch.ones(sequence.shape[1] - pad_keep.shape[0], dtype=torch.bool)])
        root_position = int(pad_keep.sum()) - 1 if pad_keep is not None else past_len
        # Drafting deeper than the tokens still allowed only costs compute.
        max_depth = max(min(candidate_generator.tree_depth, generation_config.max_length - sequence.shape[1] - 1), 0)

        start = time.perf_counter()
        draft = candidate_generator.draft(sequence, logits_processor, max_depth)
        drafted = time.perf_counter()
        tree = candidate_generator.build_tree(int(sequence[0, -1]), draft)
        built = time.perf_counter()

        outputs = model(
            input_ids=tree.tokens[None].to(sequence.device),
            attention_mask=tree_attention_mask(tree, pad_keep, past_len, model.dtype, sequence.device),
            position_ids=(root_position + tree.depths)[None].to(sequence.device),
            use_cache=True,
            **{cache_name: cache},
            **tap_kwargs,
            return_dict=True,
        )
        verified = time.perf_counter()

        # Rows are cast to float32 lazily, for the visited nodes only: casting all n rows of a half-precision model
        # costs a large allocation per step (~30 ms for 256 nodes x 49152 vocab on a small CPU).
        node_logits = outputs.logits[0]
        path, committed = walk_tree(
            tree.children(),
            lambda node: pick(node_logits[node : node + 1].to(dtype=torch.float32, device=sequence.device)),
            commit,
        )
        keep_path_in_cache(cache, past_len, path)
        if taps:
            candidate_generator.extend_context(tapped_rows(outputs, torch.tensor(path, device=sequence.device)))
        del outputs
        accepted = time.perf_counter()

        stats.target_forwards += 1
        stats.accepted_lengths.append(len(committed))
        stats.tree_sizes.append(len(tree))
        stats.draft_seconds += drafted - start
        stats.build_seconds += built - drafted
        stats.verify_seconds += verified - built
        stats.accept_seconds += accepted - verified

    stats.new_tokens = sequence.shape[1] - prompt_len
    if streamer is not None:
        streamer.end()
    if return_dict:
        return GenerateDecoderOnlyOutput(sequences=sequence, scores=scores, logits=raw_logits, **{cache_name: cache})
    return sequence
