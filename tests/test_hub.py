"""`jetspec_hf.hub`: the model card, and `push_head_to_hub` against a file-based stand-in for the Hub (no network).

The stand-in replaces the one object transformers' `PushToHubMixin.push_to_hub` talks to, the module-level
`transformers.utils.hub.hf_api()` (`create_repo`, then `create_commit` with `CommitOperationAdd`s): `FakeHub` makes a
folder per repo and copies the committed files into it, so the upload is then loaded back like a downloaded snapshot:

* `JetSpecDraftHead.from_pretrained(folder)` bit-exactly, and its tree `generate` equals plain greedy `generate`;
* `AutoModel.from_pretrained(folder, trust_remote_code=True)` in a fresh process where `jetspec_hf` cannot be imported,
  bit-exactly, with transformers' own `speculation_type="dflash"` chain mode equal to plain `generate` (the card's
  second usage snippet).

`HF_HUB_OFFLINE=1` guards every test: a call that escapes the stand-in fails fast with `OfflineModeIsEnabled`.
`Trainer(push_to_hub=True)` would need the Hub for its own card and checkpoints; it is documented in
`jetspec_hf.hub`'s docstring instead of tested.
"""

import json
import os
import shutil
import textwrap
import uuid
from pathlib import Path

import huggingface_hub
import pytest
import torch
import transformers.modeling_utils
import transformers.utils.hub
from huggingface_hub import CommitInfo, CommitOperationAdd, ModelCard, RepoUrl
from huggingface_hub.errors import EntryNotFoundError, OfflineModeIsEnabled
from safetensors.torch import load_file

import jetspec_hf
import jetspec_hf.hub as hub
from jetspec_hf import JetSpecConfig, JetSpecDraftHead, JetSpecStats
from jetspec_hf.hub import measurement_from_stats, model_card, push_head_to_hub

from tiny_models import run_without_jetspec, tiny_head, tiny_target

REPO_ID = "me/jetspec-tiny"
TARGET = "tiny-org/tiny-qwen3"
MODELING_DIR = Path(jetspec_hf.modeling.__file__).parent
TRAINING = {
    "data": "UltraChat-200k + ShareGPT (target-regenerated)",
    "loss": "cross-entropy, decay gamma=7",
    "anchors": 512,
    "epochs": 6,
    "lr": 6e-4,
    "hardware": "8x H200",
}
MEASURED = [
    {
        "tau": 6.37,
        "speedup": 4.21,
        "budget": 64,
        "width": 7,
        "hardware": "1x H200",
        "dataset": "MT-Bench",
        "temperature": 0.0,
    },
    {
        "tau": 5.02,
        "speedup": 3.3,
        "tree_budget": 32,
        "tree_width": 4,
        "hardware": "1x H200",
        "dataset": "GSM8K",
        "temperature": 1.0,
    },
]


# --------------------------------------------------------------------------------------------------------------------
# The stand-in
# --------------------------------------------------------------------------------------------------------------------


class FakeHub:
    """What `PushToHubMixin.push_to_hub` needs of `HfApi`, backed by folders `root/<repo_id>/`."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.repos: list[dict] = []
        self.commits: list[dict] = []

    def create_repo(self, repo_id, *, token=None, private=None, repo_type=None, exist_ok=False, **kwargs):
        (self.root / repo_id).mkdir(parents=True, exist_ok=exist_ok)
        self.repos.append({"repo_id": repo_id, "private": private, "token": token, **kwargs})
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_commit(
        self,
        repo_id,
        operations,
        *,
        commit_message,
        commit_description=None,
        token=None,
        create_pr=False,
        revision=None,
        **kwargs,
    ):
        paths = []
        for op in operations:
            assert isinstance(op, CommitOperationAdd), op
            dest = self.root / repo_id / op.path_in_repo
            dest.parent.mkdir(parents=True, exist_ok=True)
            source = op.path_or_fileobj
            if isinstance(source, (str, Path)):
                shutil.copyfile(source, dest)
            else:
                dest.write_bytes(source if isinstance(source, bytes) else source.read())
            paths.append(op.path_in_repo)
        oid = uuid.uuid4().hex
        self.commits.append(
            {"repo_id": repo_id, "paths": sorted(paths), "message": commit_message, "revision": revision}
        )
        return CommitInfo(
            commit_url=f"https://huggingface.co/{repo_id}/commit/{oid}",
            commit_message=commit_message,
            commit_description=commit_description or "",
            oid=oid,
        )

    def __getattr__(self, name):  # any other Hub call is a surprise
        raise AssertionError(f"unexpected Hub call: {name}")


def no_card_fetch(*args, **kwargs):
    raise AssertionError("push_head_to_hub must not fetch the repo's card: it uploads its own")


def new_repo_has_no_card(*args, **kwargs):  # what `ModelCard.load` meets in a freshly created repo
    raise EntryNotFoundError("README.md not found")


def patch_hub(monkeypatch, hub_object):
    """The seams: `hf_api()` of transformers' hub utils (push_to_hub) and its alias in modeling_utils
    (save_pretrained(push_to_hub=True)); offline mode as the guard."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read once at import
    monkeypatch.setattr(transformers.utils.hub, "hf_api", lambda: hub_object)
    monkeypatch.setattr(transformers.modeling_utils, "hf_api", lambda: hub_object)


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def assert_registration_untouched(head):
    assert JetSpecDraftHead._auto_class is None and JetSpecConfig._auto_class is None
    assert "auto_map" not in vars(head.config)
    assert head.config.target_model is None
    assert transformers.utils.hub.create_and_tag_model_card is ORIGINAL_CARD_FN


ORIGINAL_CARD_FN = transformers.utils.hub.create_and_tag_model_card


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """One push of a tiny causal head (the expensive part), shared by the tests that inspect the upload."""
    root = tmp_path_factory.mktemp("fake_hub")
    target = tiny_target("qwen3")
    head = tiny_head(target, causal=True, seed=1)
    reference = {name: tensor.detach().clone() for name, tensor in head.state_dict().items()}
    fake = FakeHub(root)
    with pytest.MonkeyPatch.context() as monkeypatch:
        patch_hub(monkeypatch, fake)
        monkeypatch.setattr(huggingface_hub.ModelCard, "load", no_card_fetch)
        result = push_head_to_hub(
            head,
            REPO_ID,
            target_model=TARGET,
            target_revision="0123abcd",
            training=TRAINING,
            measured=MEASURED,
            private=True,
            token="hf_fake_token",
            commit_message="Upload JetSpec head",
            license="apache-2.0",
        )
    return {
        "root": root,
        "folder": root / REPO_ID,
        "head": head,
        "target": target,
        "reference": reference,
        "hub": fake,
        "result": result,
    }


# --------------------------------------------------------------------------------------------------------------------
# The card
# --------------------------------------------------------------------------------------------------------------------


def test_model_card_content():
    target = tiny_target("qwen3")
    head = tiny_head(target, causal=True)
    text = model_card(
        head, target_model=TARGET, target_revision="0123abcd", training=TRAINING, measured=MEASURED, license="mit"
    )
    card = ModelCard(text)
    assert card.data.library_name == "jetspec-hf"
    assert card.data.base_model == TARGET
    assert card.data.tags == ["speculative-decoding", "jetspec", "draft-head"]
    assert card.data.license == "mit"

    body = card.text
    assert f"`{TARGET}`" in body and "`0123abcd`" in body
    assert "JetSpec (causal)" in body and "block-causal" in body
    assert "| Draft layers | 2 |" in body and "| Hidden size | 32 |" in body
    assert "| Block size | 6 (anchor + 5 drafted slots) |" in body
    assert "| Tapped target layers | [0, 2] of 4 |" in body and "| Mask token id | 95 |" in body
    # training table
    assert "| Loss | cross-entropy, decay gamma=7 |" in body and "| Data | UltraChat-200k" in body
    assert "| Anchors | 512 |" in body and "| Learning rate | 0.0006 |" in body and "| Hardware | 8x H200 |" in body
    # measured table: aliases (budget/width) land in the canonical columns
    assert "| Dataset | Hardware | Temperature | Tree budget | Width | tau (accepted length) | Speedup |" in body
    assert "| MT-Bench | 1x H200 | 0 | 64 | 7 | 6.37 | 4.21x |" in body
    assert "| GSM8K | 1x H200 | 1 | 32 | 4 | 5.02 | 3.30x |" in body
    assert "not measured" not in body
    # usage and export
    assert 'revision="0123abcd"' in body
    assert "target.generate(ids, assistant_model=head, max_new_tokens=256)" in body
    assert 'JetSpecDraftHead.from_pretrained("<this-repo>"' in body
    assert 'AutoModel.from_pretrained("<this-repo>", trust_remote_code=True' in body
    assert 'speculation_type="dflash"' in body
    assert "jetspec_hf.export.save_dflash_format" in body and "docs/export.md" in body

    # A bidirectional head, nothing measured, no training given, no remote code.
    dflash = tiny_head(target, causal=False)
    text = model_card(dflash, target_model=TARGET, repo_id="me/dflash", remote_code=False)
    assert "DFlash (bidirectional)" in text and "JetSpec (causal)" not in text
    assert "**not measured**" in text and "Training details: not given." in text
    assert "Revision: not pinned" in text and "license:" not in text
    assert "does not ship modeling code" in text and "trust_remote_code" not in text
    assert 'JetSpecDraftHead.from_pretrained("me/dflash"' in text


def test_measured_accepts_generate_stats():
    stats = JetSpecStats(accepted_lengths=[4, 6, 5], tree_sizes=[16, 16, 13], target_forwards=4, new_tokens=15)
    entry = measurement_from_stats(stats, tree_budget=16, hardware="CPU")
    assert entry["tau"] == 5.0 and entry["mean_tree_size"] == 15.0 and entry["verify_steps"] == 3
    text = model_card(tiny_head(tiny_target("qwen3")), target_model=TARGET, measured=stats)
    assert "| 5 | 15 | 3 |" in text  # tau, mean tree size, verify steps
    with pytest.raises(TypeError, match="measurement"):
        model_card(tiny_head(tiny_target("qwen3")), target_model=TARGET, measured=[3.5])


def test_trainer_push_is_documented():
    # Trainer(push_to_hub=True) needs the real Hub (its own card, checkpoint pushes); the module says what to do.
    assert "Trainer" in hub.__doc__ and "push_head_to_hub(trainer.model" in hub.__doc__


# --------------------------------------------------------------------------------------------------------------------
# The upload
# --------------------------------------------------------------------------------------------------------------------


def test_push_uploads_one_commit_with_card_code_and_head_tensors(pushed):
    fake, folder, head = pushed["hub"], pushed["folder"], pushed["head"]
    assert isinstance(pushed["result"], str) and pushed["result"].startswith(
        f"https://huggingface.co/{REPO_ID}/commit/"
    )
    assert fake.repos == [{"repo_id": REPO_ID, "private": True, "token": "hf_fake_token"}]
    files = ["README.md", "config.json", "configuration_jetspec.py", "model.safetensors", "modeling_jetspec.py"]
    assert fake.commits == [{"repo_id": REPO_ID, "paths": files, "message": "Upload JetSpec head", "revision": None}]
    assert sorted(os.listdir(folder)) == files

    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_jetspec.JetSpecConfig",
        "AutoModel": "modeling_jetspec.JetSpecDraftHead",
    }
    assert config["model_type"] == "jetspec" and config["architectures"] == ["JetSpecDraftHead"]
    assert config["target_model"] == TARGET and config["block_size"] == 6 and config["causal"] is True

    # Only the head's own parameters: no rotary buffer, no embedding, no lm_head of the target.
    tensors = load_file(folder / "model.safetensors")
    assert set(tensors) == {name for name, _ in head.named_parameters()}
    for name, tensor in tensors.items():
        assert torch.equal(tensor, pushed["reference"][name]), name

    for name in ("modeling_jetspec.py", "configuration_jetspec.py"):
        assert (folder / name).read_bytes() == (MODELING_DIR / name).read_bytes()

    card = ModelCard.load(folder / "README.md")
    assert (
        card.data.library_name == "jetspec-hf" and card.data.base_model == TARGET and card.data.license == "apache-2.0"
    )
    assert card.data.tags == ["speculative-decoding", "jetspec", "draft-head"]
    assert f"# {REPO_ID.split('/')[-1]}" in card.text
    assert "| Draft layers | 2 |" in card.text and "| Block size | 6 (anchor + 5 drafted slots) |" in card.text
    assert "| Loss | cross-entropy, decay gamma=7 |" in card.text and "| Data | UltraChat-200k" in card.text
    assert "| MT-Bench | 1x H200 | 0 | 64 | 7 | 6.37 | 4.21x |" in card.text
    assert f'JetSpecDraftHead.from_pretrained("{REPO_ID}"' in card.text
    assert f'AutoModel.from_pretrained("{REPO_ID}", trust_remote_code=True' in card.text

    # Nothing leaked: registration, auto_map, target_model and the card function are as before the push.
    assert_registration_untouched(head)


@torch.no_grad()
def test_uploaded_head_loads_bit_exactly_and_tree_generate_is_lossless(pushed):
    jetspec_hf.install_generate_hook()  # idempotent; another module may have uninstalled it
    target = pushed["target"]
    head = JetSpecDraftHead.from_pretrained(pushed["folder"]).eval()
    assert type(head) is JetSpecDraftHead
    state = head.state_dict()
    assert set(state) == set(pushed["reference"])
    for name, tensor in pushed["reference"].items():
        assert torch.equal(state[name], tensor), name

    ids = torch.tensor([[1, 5, 7, 9, 11, 13, 3]])
    plain = target.generate(ids, max_new_tokens=8, do_sample=False)
    tree = target.generate(ids, assistant_model=head, max_new_tokens=8, do_sample=False)
    assert torch.equal(tree, plain)
    assert isinstance(head.last_generate_stats, JetSpecStats) and head.last_generate_stats.new_tokens == 8
    assert head.last_generate_stats.head_forwards >= 1  # the tree path ran, not plain decoding


REMOTE_SCRIPT = textwrap.dedent(
    """

    import torch
    from transformers import AutoModel, AutoModelForCausalLM

    folder, target_dir, reference, outputs = sys.argv[1:]
    head = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(head).__name__ == "JetSpecDraftHead", type(head)
    assert type(head).__module__.startswith("transformers_modules."), type(head).__module__
    state = head.state_dict()
    expected = torch.load(reference)
    assert set(state) == set(expected), set(state) ^ set(expected)
    assert all(torch.equal(state[k], v) for k, v in expected.items())

    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    ids = torch.tensor([[1, 5, 7, 9, 11, 13, 3]])
    with torch.no_grad():
        plain = target.generate(ids, max_new_tokens=8, do_sample=False)
        chain = target.generate(ids, assistant_model=head, speculation_type="dflash", max_new_tokens=8, do_sample=False)
    torch.save({"plain": plain, "chain": chain}, outputs)
    assert not any(name.split(".")[0] == "jetspec_hf" for name in sys.modules)
    print("REMOTE_OK")
    """
)


def test_uploaded_folder_loads_as_remote_code_without_the_package(pushed, tmp_path):
    target = pushed["target"]
    target.save_pretrained(tmp_path / "target")
    torch.save(pushed["reference"], tmp_path / "reference.pt")
    ids = torch.tensor([[1, 5, 7, 9, 11, 13, 3]])
    with torch.no_grad():
        expected = target.generate(ids, max_new_tokens=8, do_sample=False)

    args = [pushed["folder"], tmp_path / "target", tmp_path / "reference.pt", tmp_path / "outputs.pt"]
    run_without_jetspec(REMOTE_SCRIPT, args, tmp_path)
    outputs = torch.load(tmp_path / "outputs.pt")
    assert torch.equal(outputs["plain"], expected)
    assert torch.equal(outputs["chain"], expected)  # the card's "without the package" snippet is lossless


# --------------------------------------------------------------------------------------------------------------------
# Options, state and the guard
# --------------------------------------------------------------------------------------------------------------------


def test_no_leak_into_later_saves_and_plain_pushes(pushed, tmp_path, monkeypatch):
    head = pushed["head"]
    head.save_pretrained(tmp_path / "plain")
    assert sorted(os.listdir(tmp_path / "plain")) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert "auto_map" not in config and config.get("target_model") is None

    # transformers' own push path through the same stand-in: its generic card, no code, no auto_map.
    fake = FakeHub(tmp_path / "hub")
    patch_hub(monkeypatch, fake)
    monkeypatch.setattr(huggingface_hub.ModelCard, "load", new_repo_has_no_card)
    head.push_to_hub("me/plain")
    folder = tmp_path / "hub" / "me" / "plain"
    assert sorted(os.listdir(folder)) == ["README.md", "config.json", "model.safetensors"]
    assert ModelCard((folder / "README.md").read_text()).data.library_name == "transformers"
    assert "auto_map" not in json.loads((folder / "config.json").read_text())


def test_push_without_remote_code_keeps_existing_registration(tmp_path, monkeypatch):
    target = tiny_target("qwen3")
    head = tiny_head(target, causal=False, target_model=TARGET)
    fake = FakeHub(tmp_path)
    patch_hub(monkeypatch, fake)
    monkeypatch.setattr(huggingface_hub.ModelCard, "load", no_card_fetch)
    head.config.auto_map = {"AutoModel": "somewhere.Else"}  # as if loaded from a repo with remote code
    JetSpecDraftHead.register_for_auto_class("AutoModel")  # as a remote-code class is registered on load
    try:
        push_head_to_hub(head, "me/no-code", target_model=TARGET, remote_code=False, tags=["extra-tag"])
        assert JetSpecDraftHead._auto_class == "AutoModel" and head.config.auto_map == {"AutoModel": "somewhere.Else"}
    finally:
        JetSpecDraftHead._auto_class = None  # what test_modeling's remote-code test leaves behind too
        del head.config.auto_map
    folder = tmp_path / "me" / "no-code"
    assert sorted(os.listdir(folder)) == ["README.md", "config.json", "model.safetensors"]
    config = json.loads((folder / "config.json").read_text())
    assert "auto_map" not in config and config["causal"] is False and config["target_model"] == TARGET
    card = ModelCard((folder / "README.md").read_text())
    assert card.data.tags == ["speculative-decoding", "jetspec", "draft-head", "extra-tag"]
    assert "DFlash (bidirectional)" in card.text and "does not ship modeling code" in card.text
    assert fake.commits[0]["message"] == "Upload JetSpecDraftHead"  # transformers' default


def test_offline_guard_fails_fast_and_restores_state():
    # No stand-in: the real HfApi is reached and offline mode stops it before any request leaves the machine.
    assert not isinstance(transformers.utils.hub.hf_api(), FakeHub)
    head = tiny_head(tiny_target("qwen3"))
    with pytest.raises(OfflineModeIsEnabled):
        push_head_to_hub(head, "me/never", target_model=TARGET, token="hf_fake_token")
    assert_registration_untouched(head)
