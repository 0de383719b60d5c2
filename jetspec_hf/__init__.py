"""jetspec-hf: JetSpec causal parallel tree drafting for lossless speculative decoding in Hugging Face `generate()`.

Importing the package registers the head with the Auto classes and routes
`target.generate(..., assistant_model=<JetSpec head>)` to tree decoding (see `jetspec_hf.routing`).
"""

import os

from transformers import AutoConfig, AutoModel

from .generation import JetSpecCandidateGenerator, JetSpecStats, fast_draft_dtype, tree_generate
from .modeling import JetSpecConfig, JetSpecDraftHead, default_target_layer_ids
from .routing import check_head_fits_target, install_generate_hook, uninstall_generate_hook
from .tree import DraftTree, build_tree, walk_tree

__version__ = "0.1.0"

AutoConfig.register(JetSpecConfig.model_type, JetSpecConfig, exist_ok=True)
AutoModel.register(JetSpecConfig, JetSpecDraftHead, exist_ok=True)

if os.environ.get("JETSPEC_HF_NO_GENERATE_HOOK", "0") != "1":
    install_generate_hook()

__all__ = [
    "DraftTree",
    "JetSpecCandidateGenerator",
    "JetSpecConfig",
    "JetSpecDraftHead",
    "JetSpecStats",
    "build_tree",
    "check_head_fits_target",
    "default_target_layer_ids",
    "fast_draft_dtype",
    "install_generate_hook",
    "tree_generate",
    "uninstall_generate_hook",
    "walk_tree",
]
