"""Publishing a JetSpec/DFlash draft head on the Hugging Face Hub, with a model card that says what it is.

* `model_card(head, target_model=...)` renders the card (`README.md`): front matter (`library_name: jetspec-hf`,
  `base_model`, tags, license), the target and its revision, the head's architecture, how it was trained, what
  acceptance was measured, how to use it with and without this package, and how to export it for vLLM/SGLang.
* `push_head_to_hub(head, repo_id, target_model=...)` uploads the head through transformers' own
  `PreTrainedModel.push_to_hub` (one commit of `config.json`, `model.safetensors`, `README.md` and, with
  `remote_code=True`, the self-contained `modeling_jetspec.py` + `configuration_jetspec.py` with an `auto_map` in
  `config.json`, so that `AutoModel.from_pretrained(repo, trust_remote_code=True)` works without this package).

Nothing here uploads by itself. `push_to_hub` gets its `README.md` from the module-level function
`transformers.utils.hub.create_and_tag_model_card` (which otherwise fetches the repo's current card, or writes
transformers' generic template); for the duration of the push that one function is replaced by one that returns our
card, merged with any `tags`. The Auto-class registration (`register_for_auto_class`, class-level state) and the
`auto_map`/`target_model` written into the head's config are restored afterwards, also when the push fails.

Training with `Trainer(..., push_to_hub=True)` uploads through the same transformers helpers but writes its own
(Trainer) card; publish the trained head with `push_head_to_hub(trainer.model, ...)` instead, or afterwards.
"""

from __future__ import annotations

import copy
import json
import math
import threading
import warnings
from collections.abc import Iterable, Mapping

import transformers.utils.hub as transformers_hub
from huggingface_hub import ModelCard, ModelCardData

LIBRARY_NAME = "jetspec-hf"
TAGS = ["speculative-decoding", "jetspec", "draft-head"]

# Class-level state (`_auto_class`) and a module-level function of transformers are swapped during a push: pushes
# from several threads of one process take turns.
_PUSH_LOCK = threading.RLock()

_TRAINING_LABELS = {
    "data": "Data",
    "dataset": "Data",
    "datasets": "Data",
    "loss": "Loss",
    "anchors": "Anchors",
    "epochs": "Epochs",
    "steps": "Steps",
    "lr": "Learning rate",
    "learning_rate": "Learning rate",
    "batch_size": "Batch size",
    "hardware": "Hardware",
}

# Canonical column names of a measurement (aliases on the left), in display order.
_MEASURED_ALIASES = {
    "budget": "tree_budget",
    "width": "tree_width",
    "depth": "tree_depth",
    "temp": "temperature",
    "data": "dataset",
    "gpu": "hardware",
    "accepted_length": "tau",
}
_MEASURED_ORDER = ["dataset", "hardware", "temperature", "tree_budget", "tree_width", "tree_depth", "tau", "speedup"]
_MEASURED_LABELS = {
    "dataset": "Dataset",
    "hardware": "Hardware",
    "temperature": "Temperature",
    "tree_budget": "Tree budget",
    "tree_width": "Width",
    "tree_depth": "Depth",
    "tau": "tau (accepted length)",
    "speedup": "Speedup",
}


# --------------------------------------------------------------------------------------------------------------------
# Model card
# --------------------------------------------------------------------------------------------------------------------


def _cell(value) -> str:
    """One table cell: readable numbers, lists joined, no line breaks, pipes escaped."""
    if value is None:
        text = "-"
    elif isinstance(value, bool):
        text = "yes" if value else "no"
    elif isinstance(value, float):
        text = f"{value:.4g}" if math.isfinite(value) else str(value)
    elif isinstance(value, Mapping):
        text = ", ".join(f"{k}={_cell(v)}" for k, v in value.items())
    elif isinstance(value, (list, tuple, set)):
        text = ", ".join(_cell(v) for v in value)
    else:
        text = str(value)
    return " ".join(text.split()).replace("|", "\\|")


def _table(header: list[str], rows: Iterable[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _label(key: str, labels: Mapping[str, str]) -> str:
    return labels.get(key, str(key).replace("_", " ").capitalize())


def measurement_from_stats(stats, **info) -> dict:
    """A `measured` entry from a `JetSpecStats` (e.g. `head.last_generate_stats`), plus settings such as
    `tree_budget`, `tree_width`, `hardware`, `dataset`, `temperature`, `speedup` given as keywords."""
    entry = dict(info)
    entry.setdefault("tau", stats.tau)
    if stats.tree_sizes:
        entry.setdefault("mean_tree_size", sum(stats.tree_sizes) / len(stats.tree_sizes))
    entry.setdefault("verify_steps", len(stats.accepted_lengths))
    return entry


def _measurements(measured) -> list[dict]:
    if measured is None:
        return []
    if isinstance(measured, Mapping) or hasattr(measured, "accepted_lengths"):
        measured = [measured]
    entries = []
    for entry in measured:
        if hasattr(entry, "accepted_lengths") and hasattr(entry, "tau"):  # a JetSpecStats
            entry = measurement_from_stats(entry)
        elif not isinstance(entry, Mapping):
            raise TypeError(f"a measurement must be a dict or a JetSpecStats, got {type(entry).__name__}")
        entries.append({_MEASURED_ALIASES.get(k, k): v for k, v in entry.items()})
    return entries


def _measured_section(measured) -> str:
    entries = _measurements(measured)
    if not entries:
        return "Acceptance: **not measured** yet for this head."
    seen = []
    for entry in entries:
        seen += [k for k in entry if k not in seen]
    columns = [k for k in _MEASURED_ORDER if k in seen] + [k for k in seen if k not in _MEASURED_ORDER]
    rows = []
    for entry in entries:
        row = []
        for key in columns:
            value = entry.get(key)
            if key == "speedup" and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = f"{value:.2f}x"
            row.append(value)
        rows.append(row)
    return (
        "tau is the mean number of tokens committed per target (verify) forward, bonus token included; the tree "
        "budget counts tree nodes, root included. Speculative decoding is lossless: the output is the target's own "
        "(greedy or sampled) output, only faster.\n\n" + _table([_label(k, _MEASURED_LABELS) for k in columns], rows)
    )


def _training_section(training) -> str:
    if not training:
        return "Training details: not given."
    if not isinstance(training, Mapping):
        raise TypeError(f"`training` must be a dict, got {type(training).__name__}")
    return _table(["Setting", "Value"], [[_label(k, _TRAINING_LABELS), v] for k, v in training.items()])


def _python_str(value: str) -> str:
    return json.dumps(str(value))  # a double-quoted Python string literal


def model_card(
    head,
    *,
    target_model: str,
    target_revision: str | None = None,
    training: Mapping | None = None,
    measured=None,
    license: str | None = None,  # noqa: A002 - the Hub metadata field is called `license`
    repo_id: str | None = None,
    remote_code: bool = True,
) -> str:
    """The Hub model card (`README.md` text, YAML front matter included) of a JetSpec/DFlash draft head.

    Args:
        head: a `JetSpecDraftHead` (or the same class loaded as remote code).
        target_model: Hub id (or path) of the target model the head drafts for; becomes `base_model`.
        target_revision: the target's revision (commit/branch/tag) the head was trained against.
        training: a dict such as `{"data": ..., "loss": ..., "anchors": ..., "epochs": ..., "lr": ...,
            "hardware": ...}`; whatever is given is rendered as a table.
        measured: a dict, a list of dicts, or `JetSpecStats` (see `measurement_from_stats`), with keys such as `tau`,
            `speedup`, `tree_budget` (`budget`), `tree_width` (`width`), `hardware`, `dataset`, `temperature`;
            rendered as a table. Absent: the card says "not measured".
        license: Hub license id (e.g. `"apache-2.0"`); written to the front matter when given.
        repo_id: the repo the card is for, used in the usage snippets (default: a placeholder).
        remote_code: whether the repo ships the modeling files (`auto_map`), i.e. loads without this package.
    """
    config = head.config
    repo = repo_id or "<this-repo>"
    causal = bool(config.causal)
    tree_depth = config.tree_depth if config.tree_depth is not None else config.block_size - 1
    num_params = sum(p.numel() for p in head.parameters())
    dtype = str(getattr(head, "dtype", "")).removeprefix("torch.")

    card_data = ModelCardData(library_name=LIBRARY_NAME, base_model=target_model, tags=list(TAGS), license=license)
    front_matter = card_data.to_yaml()

    kind = "JetSpec (causal)" if causal else "DFlash (bidirectional)"
    block_attention = (
        "block-causal: block slot *i* attends to slots 0..*i* (JetSpec), so a slot's draft can condition on the "
        "slots before it"
        if causal
        else "bidirectional: every block slot attends to every slot (DFlash)"
    )
    architecture = _table(
        ["Field", "Value"],
        [
            ["Head type", kind],
            ["Block attention", block_attention],
            ["Draft layers", config.num_hidden_layers],
            ["Hidden size", config.hidden_size],
            ["Attention heads (query / key-value)", f"{config.num_attention_heads} / {config.num_key_value_heads}"],
            ["Head dim", config.head_dim],
            ["MLP size", config.intermediate_size],
            ["Block size", f"{config.block_size} (anchor + {config.block_size - 1} drafted slots)"],
            ["Tapped target layers", f"{list(config.target_layer_ids)} of {config.num_target_layers}"],
            ["Mask token id", config.mask_token_id],
            ["Vocabulary size (target's)", config.vocab_size],
            [
                "Default tree",
                f"budget {config.tree_budget} nodes, width {config.tree_width}, depth {tree_depth}",
            ],
            ["Parameters", f"{num_params:,} ({dtype})" if dtype else f"{num_params:,}"],
        ],
    )

    revision_text = f" at revision `{target_revision}`" if target_revision else ""
    revision_kwarg = f", revision={_python_str(target_revision)}" if target_revision else ""
    target_py, repo_py = _python_str(target_model), _python_str(repo)

    with_package = f"""```python
# pip install jetspec-hf
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from jetspec_hf import JetSpecDraftHead  # importing jetspec_hf routes generate(assistant_model=head) to tree decoding

tokenizer = AutoTokenizer.from_pretrained({target_py}{revision_kwarg})
target = AutoModelForCausalLM.from_pretrained(
    {target_py}{revision_kwarg}, dtype=torch.bfloat16, device_map="auto", attn_implementation="sdpa"
)
head = JetSpecDraftHead.from_pretrained({repo_py}, dtype=torch.bfloat16).to(target.device)

messages = [{{"role": "user", "content": "Write a haiku about speculative decoding."}}]
ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt").to(target.device)
out = target.generate(ids, assistant_model=head, max_new_tokens=256)  # tree_budget=..., tree_width=... per call
print(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
print(head.last_generate_stats.tau)  # mean tokens committed per target forward
```"""

    if remote_code:
        without_package = f"""This repository ships its modeling code (`modeling_jetspec.py`,
`configuration_jetspec.py`; torch and transformers only) and `config.json` has an `auto_map`, so the head loads
without `jetspec-hf` and drafts through transformers' own DFlash chain mode (one chain per step instead of a tree:
lower acceptance, same lossless output):

```python
import torch
from transformers import AutoModel, AutoModelForCausalLM

target = AutoModelForCausalLM.from_pretrained({target_py}{revision_kwarg}, dtype=torch.bfloat16, device_map="auto")
head = AutoModel.from_pretrained({repo_py}, trust_remote_code=True, dtype=torch.bfloat16).to(target.device)
# ids: the tokenized prompt, as above
out = target.generate(ids, assistant_model=head, speculation_type="dflash", max_new_tokens=256)
```

When `jetspec-hf` is installed, its registered classes take precedence over the remote code."""
    else:
        without_package = (
            "This repository does not ship modeling code (no `auto_map` in `config.json`): install `jetspec-hf` to "
            "load it. With the package installed, transformers' own DFlash chain mode also works: "
            '`target.generate(ids, assistant_model=head, speculation_type="dflash")`.'
        )

    wrong_if_causal = " (wrong for this causal head: still lossless, but fewer tokens accepted)" if causal else ""
    export = f"""Serving engines with a DFlash-style drafter (vLLM, SGLang) read the authors' DFlash checkpoint format
(`model_type: "qwen3"`, `architectures: ["DFlashDraftModel"]`, `dflash_config`), not this repository's
`model_type: "jetspec"`. Convert with `jetspec_hf.export.save_dflash_format`:

```python
from jetspec_hf import JetSpecDraftHead
from jetspec_hf.export import save_dflash_format

save_dflash_format(JetSpecDraftHead.from_pretrained({repo_py}), "dflash-export")  # config.json + model.safetensors
```

and give the engine `dflash-export` as the draft model of its `dflash` speculative method, with the target as the
main model. The export writes the causal flag under both `dflash_config.causal_head` and `dflash_config.causal`; an
engine that finds neither treats the head as bidirectional{wrong_if_causal}.
Engines with a chain drafter serve the head correctly but verify one chain per step; JetSpec's tree gain needs tree
verification (as in `jetspec-hf`'s `generate`). See `docs/export.md` in the jetspec-hf repository."""

    title = repo_id.split("/")[-1] if repo_id else f"{kind.split()[0]} draft head for {target_model}"
    body = f"""
# {title}

A **{kind}** draft head for lossless speculative decoding of
[`{target_model}`](https://huggingface.co/{target_model}){revision_text}. One head forward drafts a whole block of
{config.block_size - 1} tokens from the target's tapped hidden states; `jetspec-hf` builds a token tree from the
per-depth drafts and verifies it with one target forward per step.

## Target model

- Model: `{target_model}`
- Revision: {f"`{target_revision}`" if target_revision else "not pinned"}
- The head uses the target's own token embeddings and `lm_head` (it owns neither): it only works with this target.

## Architecture

{architecture}

## Training

{_training_section(training)}

## Measured acceptance

{_measured_section(measured)}

## Usage

### With `jetspec-hf` (tree drafting)

{with_package}

### Without the package (remote code)

{without_package}

## Export to vLLM / SGLang

{export}
"""
    return f"---\n{front_matter}\n---\n{body}"


# --------------------------------------------------------------------------------------------------------------------
# Push
# --------------------------------------------------------------------------------------------------------------------


def _save_class_attr(cls, name):
    return (name in vars(cls), vars(cls).get(name))


def _restore_class_attr(cls, name, saved):
    owned, value = saved
    if owned:
        setattr(cls, name, value)
    elif name in vars(cls):
        delattr(cls, name)


def push_head_to_hub(
    head,
    repo_id: str,
    *,
    target_model: str,
    target_revision: str | None = None,
    training: Mapping | None = None,
    measured=None,
    private: bool | None = None,
    token: bool | str | None = None,
    commit_message: str | None = None,
    remote_code: bool = True,
    license: str | None = None,  # noqa: A002
    **push_kwargs,
):
    """Upload `head` with its model card to the Hub repo `repo_id` (created if missing) in one commit.

    The upload is `head.push_to_hub(repo_id, ...)` of transformers (`PushToHubMixin.push_to_hub`): `config.json`,
    `model.safetensors` (the head's own tensors only), `README.md` = `model_card(...)` and, with `remote_code=True`,
    the modeling files plus `auto_map` in `config.json` for `AutoModel.from_pretrained(repo,
    trust_remote_code=True)`. `config.json` also records `target_model` when the head's config has none.

    `private`, `token`, `commit_message` and `push_kwargs` (`revision`, `create_pr`, `commit_description`,
    `max_shard_size`, `tags`) go to `push_to_hub`. Returns what it returns: the `CommitInfo` (a `str` of the commit
    URL). The head, its config and the classes are left as they were (Auto-class registration, `auto_map`,
    `target_model`), also when the push fails.
    """
    card_text = model_card(
        head,
        target_model=target_model,
        target_revision=target_revision,
        training=training,
        measured=measured,
        license=license,
        repo_id=repo_id,
        remote_code=remote_code,
    )
    config = head.config
    if config.target_model is not None and config.target_model != target_model:
        warnings.warn(
            f"the head's config names target {config.target_model!r}, the card names {target_model!r}", stacklevel=2
        )

    def card_for_push(repo_id, tags=None, token=None):  # stands in for transformers' create_and_tag_model_card
        card = ModelCard(card_text)
        for tag in tags or []:
            if tag not in card.data.tags:
                card.data.tags.append(tag)
        return card

    if not callable(getattr(transformers_hub, "create_and_tag_model_card", None)):
        raise RuntimeError(
            "this transformers version has no transformers.utils.hub.create_and_tag_model_card, through which "
            "push_to_hub gets its README.md: jetspec_hf.hub needs updating"
        )
    model_class, config_class = type(head), type(config)
    with _PUSH_LOCK:
        saved_model_auto = _save_class_attr(model_class, "_auto_class")
        saved_config_auto = _save_class_attr(config_class, "_auto_class")
        saved_card_fn = transformers_hub.create_and_tag_model_card
        had_auto_map = "auto_map" in vars(config)
        saved_auto_map = copy.deepcopy(vars(config).get("auto_map"))
        saved_target = config.target_model
        try:
            if remote_code:
                config_class.register_for_auto_class("AutoConfig")
                model_class.register_for_auto_class("AutoModel")
                config.auto_map = {}  # only the two entries written by this save, none from a previous load
            else:
                # A head loaded as remote code is registered already: do not copy code or write a stale `auto_map`.
                model_class._auto_class = None
                config_class._auto_class = None
                if had_auto_map:
                    del config.auto_map
            if config.target_model is None:
                config.target_model = target_model
            transformers_hub.create_and_tag_model_card = card_for_push
            return head.push_to_hub(repo_id, private=private, token=token, commit_message=commit_message, **push_kwargs)
        finally:
            transformers_hub.create_and_tag_model_card = saved_card_fn
            _restore_class_attr(model_class, "_auto_class", saved_model_auto)
            _restore_class_attr(config_class, "_auto_class", saved_config_auto)
            config.target_model = saved_target
            if had_auto_map:
                config.auto_map = saved_auto_map
            elif "auto_map" in vars(config):
                del config.auto_map


__all__ = ["measurement_from_stats", "model_card", "push_head_to_hub"]
