"""examples/hf_user_loop.py: a Hugging Face GPT-2 trained by its own loop on a burst plan of 2 gloo ranks,
started by `deeppool run --script`; its checkpoint is the Hugging Face model's (save_pretrained)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.executor.plans import cycle, make_plan_for

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "hf_user_loop.py"


@pytest.mark.slow
def test_the_hugging_face_example_learns_on_a_burst_plan(tmp_path: Path) -> None:
    plan = make_plan_for(EXAMPLE, global_batch=8, gpus=2, assign=cycle(2, 1, 2))
    assert {layer.gpus for layer in plan.layers} == {1, 2}
    plan.save(tmp_path / "hf-plan.json")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_LOOP_STEPS": "12",
           "HF_LOOP_OUT": str(tmp_path / "hf-trained")}
    done = subprocess.run([sys.executable, "-m", "deeppool.cli", "run", "--script", str(EXAMPLE), "hf-plan.json",
                           "--out", "run"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", done.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5, done.stdout
    from transformers import GPT2LMHeadModel

    GPT2LMHeadModel.from_pretrained(tmp_path / "hf-trained")  # the saved model loads back into transformers
