"""Model definitions that ship to the Hub: the JetSpec config and draft head (torch + transformers only)."""

from .configuration_jetspec import JetSpecConfig, default_target_layer_ids
from .modeling_jetspec import JetSpecDraftHead, block_attention_mask

__all__ = ["JetSpecConfig", "JetSpecDraftHead", "block_attention_mask", "default_target_layer_ids"]
