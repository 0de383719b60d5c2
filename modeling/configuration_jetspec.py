"""Configuration of the JetSpec draft head.

This file ships to the Hub next to the weights (remote code): it imports only torch/transformers.
"""

import math

from transformers import PreTrainedConfig


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The authors' default tap rule: one tap per draft layer, spaced evenly over layers 1..L-3.

    With one draft layer the middle layer is tapped. For L=36 and 5 draft layers this gives
    [1, 9, 17, 25, 33], the set the JetSpec paper uses for Qwen3-8B.
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = (end - start) / (num_draft_layers - 1)
    return [int(math.floor(start + i * span + 0.5)) for i in range(num_draft_layers)]


class JetSpecConfig(PreTrainedConfig):
    r"""
    Configuration of a [`JetSpecDraftHead`]: a few Qwen3-style decoder layers that read fused hidden states tapped
    from a frozen target model as extra key/value context, and draft a whole block of tokens in one forward.

    Args:
        vocab_size (`int`): vocabulary size of the *target* (the head borrows the target's `embed_tokens` and
            `lm_head`; the value is kept to check that a head fits its target).
        hidden_size (`int`): must equal the target's hidden size (block inputs come from the target's embeddings and
            draft logits from the target's `lm_head`).
        num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, intermediate_size, hidden_act,
        rms_norm_eps, rope_parameters, max_position_embeddings, attention_bias, attention_dropout: the usual
            decoder-layer fields (Qwen3 layout: QK-norm, GQA, SwiGLU MLP).
        block_size (`int`): the drafted block is `[anchor, MASK x (block_size - 1)]`; depth `d` of the tree is read
            from block slot `d`, so the tree is at most `block_size - 1` deep.
        num_target_layers (`int`): number of decoder layers of the target, used by the default tap rule and to check
            that a head fits its target.
        target_layer_ids (`list[int]`): 0-based indices of the target decoder layers whose outputs are tapped.
        mask_token_id (`int`): token whose *target* embedding fills the non-anchor block slots.
        causal (`bool`): `True` for the JetSpec head (block-causal attention among block slots), `False` for the
            DFlash head (bidirectional block).
        tree_budget (`int`): default node budget of the draft tree, root included (budget 64 = 63 draft tokens).
        tree_width (`int`): default number of candidate tokens per depth (top-W). `1` gives a chain.
        tree_depth (`int`, *optional*): default maximum tree depth; `None` means `block_size - 1`.
        target_model (`str`, *optional*): name or path of the target the head was trained for (informational).

    Directories in the authors' DFlash-style format (`model_type: "qwen3"`, `architectures: ["DFlashDraftModel"]`,
    `dflash_config: {target_layer_ids, mask_token_id, causal_head}`) load unchanged: `dflash_config` is unpacked
    into the flat fields above. A missing `causal_head`/`causal` flag means a bidirectional (DFlash) head, as in the
    authors' code.
    """

    model_type = "jetspec"
    default_theta = 1000000.0  # RoPE base when a config gives none (Qwen3's)
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 5
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    block_size: int = 16
    num_target_layers: int = 36
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    causal: bool = True
    tree_budget: int = 64
    tree_width: int = 7
    tree_depth: int | None = None
    target_model: str | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        dflash_config = kwargs.pop("dflash_config", None)
        if dflash_config is not None:
            # The authors' format nests the draft-specific fields; vLLM reads `causal`, the authors' code `causal_head`.
            self.target_layer_ids = dflash_config.get("target_layer_ids", self.target_layer_ids)
            self.mask_token_id = dflash_config.get("mask_token_id", self.mask_token_id)
            self.causal = bool(dflash_config.get("causal_head", dflash_config.get("causal", False)))
            # Their auto_map points to a remote-code file that is not ours; saving would publish a dangling pointer.
            kwargs.pop("auto_map", None)
        for legacy in ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "use_cache"):
            kwargs.pop(legacy, None)  # Qwen3 fields of the authors' config that a draft head never uses
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_layer_ids is None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (anchor + at least one drafted slot), got {self.block_size}")
        super().__post_init__(**kwargs)

    @property
    def max_tree_depth(self) -> int:
        """Deepest tree level the head was trained to draft: one level per non-anchor block slot."""
        return self.block_size - 1


__all__ = ["JetSpecConfig", "default_target_layer_ids"]
