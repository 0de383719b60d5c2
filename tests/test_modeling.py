"""The draft head against its checkpoint format and an independent reference implementation.

* Directories written by hand from the authors' documented DFlash-style format (`config.json` + `model.safetensors`)
  load with `JetSpecDraftHead.from_pretrained` unchanged and bit-exactly.
* The forward equals transformers' in-tree DFlash drafter (`MuseGlimmerAssistantModel`, same architecture, with
  `encoder.fc` / `encoder.output_norm_enc` for our `fc` / `hidden_norm`), bidirectional and block-causal, with and
  without a context cache.
* `save_dflash_format`, `save_pretrained`, the Auto classes and remote code round-trip bit-exactly.
* Corrupt or partial checkpoints fail loudly.
"""

import json
import os
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel
from transformers.cache_utils import DynamicCache

import jetspec_hf
from jetspec_hf import JetSpecConfig, JetSpecDraftHead
from jetspec_hf.export import save_dflash_format

from tiny_models import run_without_jetspec

# Tiny sizes in the Qwen3 layout: GQA (4 query heads over 2 key/value heads), QK-norm, three taps.
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP = 32, 2, 4, 2, 8, 64
TAPS = [1, 3, 4]
BLOCK = 4
ROPE_THETA = 1000000.0


# --------------------------------------------------------------------------------------------------------------------
# The authors' format, written from its documentation (not through our code)
# --------------------------------------------------------------------------------------------------------------------


def authors_config(causal=True, dtype="float32", taps=TAPS) -> dict:
    """A `config.json` as the authors publish it: a Qwen3 config plus the draft fields (and their own auto_map)."""
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": MLP,
        "rms_norm_eps": 1e-6,
        "rope_theta": ROPE_THETA,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "vocab_size": 100,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "use_cache": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": LAYERS,
        "layer_types": ["full_attention"] * LAYERS,
        "torch_dtype": dtype,
        "block_size": BLOCK,
        "num_target_layers": 6,
        "dflash_config": {"target_layer_ids": list(taps), "mask_token_id": 99},
    }
    if causal is not None:  # None: the flag is absent (the authors' DFlash heads)
        config["dflash_config"]["causal_head"] = causal
    return config


def authors_tensors(dtype=torch.float32, taps=TAPS, seed=0) -> dict[str, torch.Tensor]:
    """Random tensors under the documented names and shapes ([out, in] for linear layers, no biases)."""
    gen = torch.Generator().manual_seed(seed)

    def matrix(*shape):
        return (0.15 * torch.randn(*shape, generator=gen)).to(dtype)

    def norm(size):
        return (1.0 + 0.2 * torch.randn(size, generator=gen)).to(dtype)

    tensors = {}
    for i in range(LAYERS):
        p = f"layers.{i}."
        tensors[p + "self_attn.q_proj.weight"] = matrix(HEADS * HEAD_DIM, HIDDEN)
        tensors[p + "self_attn.k_proj.weight"] = matrix(KV_HEADS * HEAD_DIM, HIDDEN)
        tensors[p + "self_attn.v_proj.weight"] = matrix(KV_HEADS * HEAD_DIM, HIDDEN)
        tensors[p + "self_attn.o_proj.weight"] = matrix(HIDDEN, HEADS * HEAD_DIM)
        tensors[p + "self_attn.q_norm.weight"] = norm(HEAD_DIM)
        tensors[p + "self_attn.k_norm.weight"] = norm(HEAD_DIM)
        tensors[p + "mlp.gate_proj.weight"] = matrix(MLP, HIDDEN)
        tensors[p + "mlp.up_proj.weight"] = matrix(MLP, HIDDEN)
        tensors[p + "mlp.down_proj.weight"] = matrix(HIDDEN, MLP)
        tensors[p + "input_layernorm.weight"] = norm(HIDDEN)
        tensors[p + "post_attention_layernorm.weight"] = norm(HIDDEN)
    tensors["fc.weight"] = matrix(HIDDEN, len(taps) * HIDDEN)
    tensors["hidden_norm.weight"] = norm(HIDDEN)
    tensors["norm.weight"] = norm(HIDDEN)
    return tensors


def write_authors_dir(path, causal=True, dtype=torch.float32, config=None, tensors=None):
    path.mkdir(parents=True, exist_ok=True)
    config = config if config is not None else authors_config(causal, str(dtype).removeprefix("torch."))
    tensors = tensors if tensors is not None else authors_tensors(dtype)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, tensors


def assert_state_equal(model, tensors):
    state = model.state_dict()
    assert set(state) == set(tensors)
    for name, tensor in tensors.items():
        assert state[name].dtype == tensor.dtype, name
        assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize("causal", [True, False, None], ids=["causal_head", "bidirectional", "flag_missing"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_authors_format_loads_unchanged(tmp_path, causal, dtype):
    path, tensors = write_authors_dir(tmp_path / "ckpt", causal=causal, dtype=dtype)
    head = JetSpecDraftHead.from_pretrained(path)
    config = head.config

    assert isinstance(head, JetSpecDraftHead) and isinstance(config, JetSpecConfig)
    assert config.causal is bool(causal)  # a missing flag means the bidirectional DFlash head
    assert config.target_layer_ids == TAPS and config.mask_token_id == 99
    assert config.block_size == BLOCK and config.num_target_layers == 6 and config.max_tree_depth == BLOCK - 1
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (HIDDEN, LAYERS, MLP)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert config.rope_parameters["rope_theta"] == ROPE_THETA
    assert config.rope_parameters["rope_type"] == "default"
    assert config.rms_norm_eps == 1e-6 and config.vocab_size == 100
    assert getattr(config, "auto_map", None) is None  # their remote-code pointer is not ours to republish
    assert not hasattr(config, "dflash_config")
    assert head.dtype == dtype
    assert_state_equal(head, tensors)


def test_vllm_style_causal_key_is_read(tmp_path):
    config = authors_config(causal=None)
    config["dflash_config"]["causal"] = True
    path, _ = write_authors_dir(tmp_path / "ckpt", config=config)
    assert JetSpecDraftHead.from_pretrained(path).config.causal is True


# --------------------------------------------------------------------------------------------------------------------
# Forward against transformers' in-tree DFlash drafter
# --------------------------------------------------------------------------------------------------------------------


def reference_model(tensors):
    """`MuseGlimmerAssistantModel` with the same sizes, holding the same tensors (renamed where its names differ)."""
    from transformers.models.muse_glimmer_assistant import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    config = MuseGlimmerAssistantConfig(
        hidden_size=HIDDEN,
        intermediate_size=MLP,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        max_position_embeddings=4096,
        layer_types=["full_attention"] * LAYERS,
        block_size=BLOCK,
        mask_token_id=99,
        target_layer_ids=TAPS,
    )
    config._attn_implementation = "eager"
    model = MuseGlimmerAssistantModel(config).eval()
    renames = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
    model.load_state_dict({renames.get(k, k): v for k, v in tensors.items()}, strict=True)
    return model


def reference_mask(num_context: int, block: int, causal: bool) -> dict:
    """Additive mask `[1, 1, block, num_context + block]`: slot i sees every context key, and slots 0..i (causal) or
    every slot (bidirectional)."""
    allowed = torch.zeros(block, num_context + block, dtype=torch.bool)
    for i in range(block):
        allowed[i, :num_context] = True
        allowed[i, num_context : num_context + (i + 1 if causal else block)] = True
    mask = torch.zeros(block, num_context + block).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return {"full_attention": mask[None, None]}


def close(actual, expected):
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@torch.no_grad()
def test_forward_matches_reference(tmp_path, causal, attn):
    path, tensors = write_authors_dir(tmp_path / "ckpt", causal=causal)
    head = JetSpecDraftHead.from_pretrained(path, attn_implementation=attn).eval()
    reference = reference_model(tensors)

    torch.manual_seed(1)
    batch, n_context = 2, 7
    block = torch.randn(batch, BLOCK, HIDDEN)
    context = torch.randn(batch, n_context, len(TAPS) * HIDDEN)

    ours = head(block, context).last_hidden_state
    # Bidirectional: the reference's own default mask path. Causal: the mask written from the rule above.
    expected = reference(block, context, attention_mask=reference_mask(n_context, BLOCK, True) if causal else None)
    close(ours, expected.last_hidden_state)

    # The mask matters: the other attention pattern gives a visibly different result.
    other = reference(block, context, attention_mask=reference_mask(n_context, BLOCK, not causal)).last_hidden_state
    assert (ours - other).abs().max() > 1e-3

    # Context cache, as a decode loop uses it: step 1 caches 5 context rows (its block keys are cropped), step 2
    # feeds the 2 new rows + the block. Both must equal one uncached forward over all 7 rows, and the reference's
    # cached run.
    cache, ref_cache = DynamicCache(), DynamicCache()
    first_block = torch.randn(batch, BLOCK, HIDDEN)
    step1 = head(first_block, context[:, :5], past_key_values=cache, use_cache=True).last_hidden_state
    ref_step1 = reference(
        first_block, context[:, :5], attention_mask=reference_mask(5, BLOCK, causal), past_key_values=ref_cache
    )
    close(step1, ref_step1.last_hidden_state)
    close(step1, head(first_block, context[:, :5]).last_hidden_state)
    for c in (cache, ref_cache):
        c.crop(-BLOCK)
        assert c.get_seq_length() == 5

    step2 = head(block, context[:, 5:], past_key_values=cache, use_cache=True).last_hidden_state
    ref_step2 = reference(
        block, context[:, 5:], attention_mask=reference_mask(n_context, BLOCK, causal), past_key_values=ref_cache
    )
    close(step2, ours)
    close(step2, expected.last_hidden_state)
    close(step2, ref_step2.last_hidden_state)
    assert cache.get_seq_length() == n_context + BLOCK  # the caller crops the block keys


# --------------------------------------------------------------------------------------------------------------------
# Export and round trips
# --------------------------------------------------------------------------------------------------------------------


def loaded_head(tmp_path, causal=True, dtype=torch.float32):
    path, tensors = write_authors_dir(tmp_path / "src", causal=causal, dtype=dtype)
    return JetSpecDraftHead.from_pretrained(path), tensors


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_dflash_format_round_trip(tmp_path, causal, dtype):
    head, tensors = loaded_head(tmp_path, causal, dtype)
    out = tmp_path / "export"
    save_dflash_format(head, out)

    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"] == {
        "target_layer_ids": TAPS,
        "mask_token_id": 99,
        "causal_head": causal,
        "causal": causal,
    }
    assert config["block_size"] == BLOCK and config["num_target_layers"] == 6
    assert config["rope_theta"] == ROPE_THETA and config["rope_scaling"] is None
    assert config["torch_dtype"] == config["dtype"] == str(dtype).removeprefix("torch.")
    assert "auto_map" not in config and "rope_parameters" not in config
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "hidden_act",
        "attention_bias",
        "tie_word_embeddings",
    ):
        assert key in config, key
    assert config["tie_word_embeddings"] is False

    # Engines parse the file as a plain Qwen3 config (transformers' own class), draft fields as extra attributes.
    qwen3 = AutoConfig.from_pretrained(out)
    assert type(qwen3).__name__ == "Qwen3Config"
    assert qwen3.rope_parameters == {"rope_type": "default", "rope_theta": ROPE_THETA}
    assert (qwen3.hidden_size, qwen3.num_hidden_layers, qwen3.head_dim) == (HIDDEN, LAYERS, HEAD_DIM)
    assert qwen3.dflash_config["causal"] is causal and qwen3.block_size == BLOCK

    written = load_file(str(out / "model.safetensors"))
    assert set(written) == set(tensors)  # exactly the head's tensors: no rotary buffers, no embedding, no lm_head
    assert all(torch.equal(written[k], v) and written[k].dtype == dtype for k, v in tensors.items())

    reloaded = JetSpecDraftHead.from_pretrained(out)
    assert reloaded.config.causal is causal and reloaded.config.target_layer_ids == TAPS
    assert reloaded.config.rope_parameters == head.config.rope_parameters
    assert_state_equal(reloaded, tensors)


def test_save_dflash_format_options(tmp_path):
    head, tensors = loaded_head(tmp_path)
    head.config.tree_width = 3
    save_dflash_format(head, tmp_path / "bin", safe_serialization=False)
    assert sorted(os.listdir(tmp_path / "bin")) == ["config.json", "pytorch_model.bin"]
    reloaded = JetSpecDraftHead.from_pretrained(tmp_path / "bin")
    assert_state_equal(reloaded, tensors)
    assert reloaded.config.tree_width == 3  # JetSpec-only defaults survive as extra top-level keys

    # Non-default RoPE goes to the legacy `rope_scaling` dict and comes back as the same `rope_parameters`.
    head.config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": ROPE_THETA}
    save_dflash_format(head, tmp_path / "linear")
    config = json.loads((tmp_path / "linear" / "config.json").read_text())
    assert config["rope_theta"] == ROPE_THETA and config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    assert JetSpecDraftHead.from_pretrained(tmp_path / "linear").config.rope_parameters == head.config.rope_parameters

    head.config.mask_token_id = None  # engines cannot fill the block without it
    with pytest.raises(ValueError, match="mask_token_id"):
        save_dflash_format(head, tmp_path / "nomask")
    assert not (tmp_path / "nomask").exists()


def test_save_pretrained_and_auto_classes_round_trip(tmp_path):
    head, tensors = loaded_head(tmp_path, causal=True)
    out = tmp_path / "ours"
    head.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "jetspec" and config["architectures"] == ["JetSpecDraftHead"]
    assert "auto_map" not in config and "dflash_config" not in config
    assert not any(name.endswith(".py") for name in os.listdir(out))

    reloaded = JetSpecDraftHead.from_pretrained(out)
    assert_state_equal(reloaded, tensors)
    ignore = {"_name_or_path", "architectures"}
    assert {k: v for k, v in reloaded.config.to_dict().items() if k not in ignore} == {
        k: v for k, v in head.config.to_dict().items() if k not in ignore
    }

    assert jetspec_hf.JetSpecDraftHead is JetSpecDraftHead  # the import registered the Auto classes
    assert type(AutoConfig.from_pretrained(out)) is JetSpecConfig
    auto = AutoModel.from_pretrained(out)
    assert type(auto) is JetSpecDraftHead
    assert_state_equal(auto, tensors)


# --------------------------------------------------------------------------------------------------------------------
# Remote code: a process where jetspec_hf cannot be imported
# --------------------------------------------------------------------------------------------------------------------

REMOTE_SCRIPT = textwrap.dedent(
    """

    import torch
    from transformers import AutoModel

    checkpoint, inputs, output = sys.argv[1:]
    head = AutoModel.from_pretrained(checkpoint, trust_remote_code=True).eval()
    assert type(head).__name__ == "JetSpecDraftHead", type(head)
    assert type(head).__module__.startswith("transformers_modules."), type(head).__module__
    assert head.is_jetspec_draft_head
    assert not any(name.split(".")[0] == "jetspec_hf" for name in sys.modules)
    block, context = torch.load(inputs)
    with torch.no_grad():
        torch.save(head(block, context).last_hidden_state, output)
    print("REMOTE_OK")
    """
)


@torch.no_grad()
def test_remote_code_loads_without_the_package(tmp_path):
    head, tensors = loaded_head(tmp_path, causal=True)
    head.eval()
    out = tmp_path / "remote"
    try:
        JetSpecConfig.register_for_auto_class()
        JetSpecDraftHead.register_for_auto_class("AutoModel")
        head.save_pretrained(out)
    finally:  # class-level state: later saves in this process must not copy remote code
        JetSpecConfig._auto_class = None
        JetSpecDraftHead._auto_class = None

    files = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "modeling_jetspec.py", "configuration_jetspec.py"} <= files
    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_jetspec.JetSpecConfig",
        "AutoModel": "modeling_jetspec.JetSpecDraftHead",
    }

    torch.manual_seed(3)
    block, context = torch.randn(1, BLOCK, HIDDEN), torch.randn(1, 6, len(TAPS) * HIDDEN)
    torch.save((block, context), tmp_path / "inputs.pt")
    expected = head(block, context).last_hidden_state

    run_without_jetspec(REMOTE_SCRIPT, [out, tmp_path / "inputs.pt", tmp_path / "output.pt"], tmp_path)
    torch.testing.assert_close(torch.load(tmp_path / "output.pt"), expected, atol=1e-6, rtol=1e-6)

    # With the package installed the local class wins, even for a directory with auto_map and trust_remote_code.
    local = AutoModel.from_pretrained(out, trust_remote_code=True)
    assert type(local) is JetSpecDraftHead
    assert_state_equal(local, tensors)


# --------------------------------------------------------------------------------------------------------------------
# Corrupt or partial checkpoints
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_weights_file_raises(tmp_path, damage):
    path, _ = write_authors_dir(tmp_path / "ckpt")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    # truncated: a valid header whose tensors run past the end of the file; garbage: no header at all
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x17\x03garbage" * 100)
    with pytest.raises(Exception) as info:
        JetSpecDraftHead.from_pretrained(path)
    error = f"{type(info.value).__name__}: {info.value}".lower()
    assert "safetensor" in error or "model.safetensors" in error, error


def test_missing_key_raises(tmp_path):
    tensors = authors_tensors()
    del tensors["fc.weight"]
    path, _ = write_authors_dir(tmp_path / "ckpt", tensors=tensors)
    with pytest.raises(ValueError, match=r"missing_keys: fc\.weight"):
        JetSpecDraftHead.from_pretrained(path)


@pytest.mark.parametrize("extra", ["layers.0.self_attn.q_proj.bias", "lm_head.weight"])
def test_unexpected_key_raises(tmp_path, extra):
    tensors = authors_tensors()
    tensors[extra] = torch.zeros(HEADS * HEAD_DIM if extra.endswith("bias") else (100, HIDDEN))
    path, _ = write_authors_dir(tmp_path / "ckpt", tensors=tensors)
    with pytest.raises(ValueError, match=rf"unexpected_keys: {extra.replace('.', r'[.]')}"):
        JetSpecDraftHead.from_pretrained(path)


def test_fc_width_mismatch_raises(tmp_path):
    # The config names two taps but fc was trained on three: fc.weight is [H, 3H], the model expects [H, 2H].
    config = authors_config()
    config["dflash_config"]["target_layer_ids"] = [1, 3]
    path, _ = write_authors_dir(tmp_path / "ckpt", config=config)
    with pytest.raises((RuntimeError, ValueError), match="mismatch"):
        JetSpecDraftHead.from_pretrained(path)
    # Asked to ignore the mismatch, transformers would re-initialise fc at random: our override refuses.
    with pytest.raises(ValueError, match=r"mismatched_keys: .*fc\.weight"):
        JetSpecDraftHead.from_pretrained(path, ignore_mismatched_sizes=True)
