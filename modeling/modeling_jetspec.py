"""The JetSpec draft head.

A JetSpec head is a DFlash-style drafter: a few Qwen3 decoder layers whose attention reads, besides the drafted block,
the fused hidden states tapped from several layers of a frozen target model. One forward over the block
`[anchor, MASK x (block_size - 1)]` gives a hidden state for every block slot; the target's own `lm_head` turns slot `d`
into the draft distribution for tree depth `d`. The only difference between the JetSpec head and the DFlash head is the
attention among block slots: block-causal (JetSpec, `config.causal=True`) or bidirectional (DFlash).

The module layout and parameter names are those of the authors' checkpoints (`layers.*`, `fc`, `hidden_norm`, `norm`),
so their `model.safetensors` loads as is.

This file ships to the Hub next to the weights (remote code): it imports only torch, transformers and its sibling
configuration file.
"""

from collections.abc import Callable

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)

from .configuration_jetspec import JetSpecConfig


def apply_rotary_to_context_and_block(query, key, cos, sin):
    """RoPE where keys span [context ; block] but queries only the block: queries take the last q_len positions."""
    # Under autocast the projections come out in the autocast dtype while cos/sin follow the input: match them so
    # queries, keys and values share one dtype.
    cos, sin = cos.unsqueeze(1).to(query.dtype), sin.unsqueeze(1).to(query.dtype)
    q_len = query.shape[-2]
    query = query * cos[..., -q_len:, :] + rotate_half(query) * sin[..., -q_len:, :]
    key = key * cos + rotate_half(key) * sin
    return query, key


def block_attention_mask(
    num_context: int,
    block_size: int,
    causal: bool,
    dtype: torch.dtype,
    device: torch.device,
    padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive `[b, 1, block_size, num_context + block_size]` mask for one drafted block.

    Every slot sees the whole context (all of it lies strictly before the anchor). Among block slots, slot `i` sees
    slots `0..i` for the causal (JetSpec) head and every slot for the bidirectional (DFlash) head. `padding_mask`
    (`[b, num_context + block_size]`, 1 = keep) removes padded context rows.
    """
    slot = torch.arange(block_size, device=device)
    keep = torch.ones(block_size, num_context + block_size, dtype=torch.bool, device=device)
    if causal:
        keep[:, num_context:] = slot[None, :] <= slot[:, None]
    keep = keep[None, None]
    if padding_mask is not None:
        keep = keep & padding_mask[:, None, None, :].bool()
    mask = torch.zeros(keep.shape, dtype=dtype, device=device)
    return mask.masked_fill_(~keep, torch.finfo(dtype).min)


class JetSpecAttention(nn.Module):
    """Qwen3 attention whose keys/values are `[projected context ; block]` and whose queries are the block only."""

    def __init__(self, config: JetSpecConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        # Only read by flash-attention kernels (which take no explicit mask): bottom-right aligned causal attention
        # over [context ; block] is exactly the block-causal pattern.
        self.is_causal = config.causal
        self.q_proj = nn.Linear(
            config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias
        )
        self.k_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.v_proj = nn.Linear(
            config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias
        )
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None = None,
        **kwargs,
    ) -> torch.Tensor:
        batch, q_len, _ = hidden_states.shape
        kv_states = torch.cat([context, hidden_states], dim=1)
        query = self.q_norm(self.q_proj(hidden_states).view(batch, q_len, -1, self.head_dim)).transpose(1, 2)
        key = self.k_norm(self.k_proj(kv_states).view(batch, kv_states.shape[1], -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(kv_states).view(batch, kv_states.shape[1], -1, self.head_dim).transpose(1, 2)
        query, key = apply_rotary_to_context_and_block(query, key, *position_embeddings)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, _ = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        return self.o_proj(attn_output.reshape(batch, q_len, -1).contiguous())


class JetSpecDecoderLayer(nn.Module):
    """Pre-norm residual block; the context is not normed here (the head normed it once after fusion)."""

    def __init__(self, config: JetSpecConfig, layer_idx: int):
        super().__init__()
        self.self_attn = JetSpecAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, context, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), context, position_embeddings, attention_mask, past_key_values, **kwargs
        )
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class JetSpecDraftHead(PreTrainedModel):
    """The JetSpec (or DFlash) draft head. Owns neither `embed_tokens` nor `lm_head`: both are the target's.

    `forward` follows the contract of transformers' in-tree DFlash drafter, so the head also serves
    `target.generate(..., assistant_model=head, speculation_type="dflash")` (chain drafting, no package needed);
    `import jetspec_hf` adds tree drafting to `target.generate(..., assistant_model=head)`.
    """

    config_class = JetSpecConfig
    config: JetSpecConfig
    base_model_prefix = "jetspec"
    main_input_name = "noise_embeds"
    supports_gradient_checkpointing = False
    _no_split_modules = ["JetSpecDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_attention_backend = True
    # Duck-typed marker read by jetspec_hf's generate() routing: a head loaded as remote code is another class object.
    is_jetspec_draft_head = True
    accepts_loss_kwargs = False  # forward() takes **kwargs for attention backends, not for loss normalisation

    def __init__(self, config: JetSpecConfig):
        super().__init__(config)
        self.layers = nn.ModuleList(JetSpecDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    def fuse_context(self, context_hidden_states: torch.Tensor) -> torch.Tensor:
        """Concatenated target taps `[b, n, len(taps) * H]` -> one context feature `[b, n, H]` per token."""
        return self.hidden_norm(self.fc(context_hidden_states))

    def forward(
        self,
        noise_embeds: torch.Tensor,
        context_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        r"""
        noise_embeds (`[b, q, H]`): target embeddings of the drafted slots, e.g. `[anchor, MASK x (block_size-1)]`
            (several blocks side by side at training time).
        context_hidden_states (`[b, n, len(target_layer_ids) * H]`): concatenated taps of the context tokens that
            are not in `past_key_values` yet.
        attention_mask: `None` or a 2-D padding mask over `[cached ; context ; block]` keys: the head builds the
            one-block mask (block-causal or bidirectional per `config.causal`). A 4-D additive float mask
            `[b, 1, q, cached + n + q]` is used as given (packed training blocks).
        position_ids (`[b, n + q]`): positions of `[context ; block]`; defaults to `cached + arange(n + q)`.
        past_key_values: a cache of *context* keys/values. Block keys/values are appended by this forward too; the
            caller crops them (they must never persist across steps).
        """
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        # Read once, before any layer updates the cache: every layer must build its mask from the same cached length
        # (reading it per layer after layer 0 has been updated is the bug the authors fixed).
        num_cached = past_key_values.get_seq_length() if past_key_values is not None else 0
        context = self.fuse_context(context_hidden_states)
        num_context, q_len = context.shape[1], noise_embeds.shape[1]
        if position_ids is None:
            position_ids = torch.arange(num_cached, num_cached + num_context + q_len, device=noise_embeds.device)[None]

        if self.config._attn_implementation.startswith("flash"):
            if attention_mask is not None and (attention_mask.dim() == 4 or not attention_mask.bool().all()):
                raise ValueError(
                    "flash attention takes no 4-D or padding mask: use attn_implementation='sdpa' or 'eager'"
                )
            attention_mask = None  # is_causal (bottom-right aligned) / non-causal reproduces the block mask
        elif attention_mask is None or attention_mask.dim() == 2:
            attention_mask = block_attention_mask(
                num_cached + num_context,
                q_len,
                self.config.causal,
                noise_embeds.dtype,
                noise_embeds.device,
                padding_mask=attention_mask,
            )

        hidden_states = noise_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for layer in self.layers:
            hidden_states = layer(
                hidden_states, context, position_embeddings, attention_mask, past_key_values, **kwargs
            )
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), past_key_values=past_key_values)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, but a partial checkpoint is an error, not a silently random head."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        problems = {
            k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v
        }
        if problems:
            details = "; ".join(
                f"{k}: {', '.join(map(str, v[:8]))}{' ...' if len(v) > 8 else ''}" for k, v in problems.items()
            )
            where = args[0] if args else kwargs.get("pretrained_model_name_or_path", "checkpoint")
            raise ValueError(f"{where} is not a complete {cls.__name__} checkpoint ({details})")
        return (model, info) if want_info else model


try:  # When the jetspec-hf package is installed, importing it routes generate(assistant_model=head) to tree drafting.
    import jetspec_hf  # noqa: F401
except ImportError:
    pass

__all__ = ["JetSpecDraftHead", "block_attention_mask"]
