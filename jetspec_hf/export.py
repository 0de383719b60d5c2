"""Export a JetSpec/DFlash draft head in the authors' DFlash-style checkpoint format.

Serving engines that ship a ``method: dflash``-style drafter (vLLM, SGLang) read drafters in the format of the
authors' releases, not in this package's ``model_type: "jetspec"`` format:

* ``config.json`` is a Qwen3 decoder config (``"model_type": "qwen3"``, ``"architectures": ["DFlashDraftModel"]``,
  ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
  ``intermediate_size``, ``rms_norm_eps``, ``rope_theta``, ``rope_scaling``, ...) plus the draft fields: top-level
  ``block_size`` and ``num_target_layers``, and ``"dflash_config": {"target_layer_ids", "mask_token_id",
  "causal_head", "causal"}``.
* ``model.safetensors`` holds the head's own tensors under the names ``layers.{i}.self_attn.*``,
  ``layers.{i}.mlp.*``, ``layers.{i}.{input_layernorm,post_attention_layernorm}``, ``fc`` (no bias),
  ``hidden_norm`` and ``norm``. The head owns no embedding and no ``lm_head``: the engine takes both from the target.

The causal flag is written twice on purpose: the authors' code reads ``dflash_config.causal_head`` and vLLM reads
``dflash_config.causal``; an engine that finds neither treats the head as a bidirectional DFlash head, which for a
JetSpec head is silently wrong drafts (lower acceptance, never wrong output, since verification is lossless).

Serving the export with a chain (``dflash``) drafter works for both heads, but JetSpec's advantage is *tree*
drafting: only an engine that verifies a token tree in one target forward gets the longer accepted lengths. The
written directory also loads back with ``JetSpecDraftHead.from_pretrained`` (``dflash_config`` is unpacked into the
flat config fields). No ``auto_map`` is written: the authors' remote-code file is not part of this package.
"""

from __future__ import annotations

import json
import os

import torch
import transformers

from .modeling import JetSpecDraftHead

CONFIG_NAME = "config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
WEIGHTS_NAME = "pytorch_model.bin"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dflash_config_dict(head: JetSpecDraftHead) -> dict:
    """The `config.json` content of `head` in the authors' DFlash-style format (see the module docstring)."""
    config = head.config
    if config.mask_token_id is None:
        raise ValueError(
            "the head has no mask_token_id: DFlash-style drafters fill the block slots with the target embedding of "
            "that token, so engines cannot run an export without it (set head.config.mask_token_id)"
        )
    rope = dict(config.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    if any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"per-layer-type rope_parameters cannot be written as Qwen3 rope_theta/rope_scaling: {rope}")
    rope_theta = rope.pop("rope_theta")
    # Legacy (transformers 4.x / vLLM) layout: `rope_theta` at the top level, `rope_scaling` null for plain RoPE.
    rope_scaling = None if rope.get("rope_type", "default") == "default" and len(rope) <= 1 else rope
    dtype = _dtype_name(head.dtype)
    n = config.num_hidden_layers
    out = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": n,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings,
        "initializer_range": config.initializer_range,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "attention_bias": config.attention_bias,
        "attention_dropout": config.attention_dropout,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": n,
        "layer_types": ["full_attention"] * n,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "torch_dtype": dtype,
        "dtype": dtype,
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": {
            "target_layer_ids": [int(i) for i in config.target_layer_ids],
            "mask_token_id": int(config.mask_token_id),
            "causal_head": bool(config.causal),  # read by the authors' code
            "causal": bool(config.causal),  # read by vLLM
        },
        # JetSpec-only defaults; engines ignore unknown keys and `JetSpecConfig` reads them back.
        "tree_budget": config.tree_budget,
        "tree_width": config.tree_width,
        "tree_depth": config.tree_depth,
        "transformers_version": transformers.__version__,
    }
    if config.target_model is not None:
        out["target_model"] = config.target_model
    return out


def save_dflash_format(
    head: JetSpecDraftHead, save_directory: str | os.PathLike, safe_serialization: bool = True
) -> str:
    """Write `head` to `save_directory` in the authors' DFlash-style format, for vLLM/SGLang `dflash` drafters.

    Writes `config.json` (Qwen3 fields, `architectures: ["DFlashDraftModel"]`, top-level `block_size` and
    `num_target_layers`, `dflash_config` with `target_layer_ids`, `mask_token_id` and the causal flag under both
    `causal_head` (authors' code) and `causal` (vLLM); no `auto_map`) and `model.safetensors` (or
    `pytorch_model.bin` with `safe_serialization=False`) with exactly the head's parameters, in the head's dtype:
    no rotary buffers, no embedding, no `lm_head`.

    Engines with a chain `dflash` drafter can serve the export; JetSpec's gain over DFlash needs an engine that drafts
    and verifies a token *tree*. The directory reloads with `JetSpecDraftHead.from_pretrained`. Returns the path.
    """
    config = dflash_config_dict(head)  # validates before anything is written
    state = {name: tensor.detach().to("cpu").contiguous() for name, tensor in head.state_dict().items()}
    expected = {name for name, _ in head.named_parameters()}
    if set(state) != expected:  # persistent buffers would be unknown keys to every other loader
        raise ValueError(f"unexpected tensors in the head's state dict: {sorted(set(state) ^ expected)}")
    dtypes = {t.dtype for t in state.values()}
    if len(dtypes) != 1:
        raise ValueError(f"the head mixes dtypes {sorted(map(str, dtypes))}: cast it to one dtype before exporting")

    os.makedirs(save_directory, exist_ok=True)
    for stale in (SAFE_WEIGHTS_NAME, WEIGHTS_NAME, "model.safetensors.index.json", "pytorch_model.bin.index.json"):
        path = os.path.join(save_directory, stale)
        if os.path.isfile(path):
            os.remove(path)  # a leftover file of the other format would shadow or contradict the new one
    if safe_serialization:
        from safetensors.torch import save_file

        save_file(state, os.path.join(save_directory, SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
    else:
        torch.save(state, os.path.join(save_directory, WEIGHTS_NAME))
    with open(os.path.join(save_directory, CONFIG_NAME), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    return str(save_directory)


__all__ = ["dflash_config_dict", "save_dflash_format"]
