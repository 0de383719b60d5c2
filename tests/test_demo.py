"""The README's main job runs end to end on the real SmolLM2 model and reports identical outputs."""

import os

import pytest
import torch

from jetspec_hf import demo

pytestmark = pytest.mark.skipif(os.environ.get("JETSPEC_HF_SKIP_MODEL_TESTS") == "1", reason="model tests disabled")


def test_demo_runs_and_outputs_are_identical(capsys):
    assert demo.main(["--max-new-tokens", "12", "--prompt", "What is 2+2?"]) == 0
    out = capsys.readouterr().out
    assert "same tokens as plain: True" in out and "outputs identical: True" in out
    assert "tau" in out and "speedup" in out
    assert torch.get_num_threads() == 1  # --threads defaults to 1, like the bench
