"""``launch``: the ranks inherit ``$DEEPPOOL_PLAN`` and ``$OMP_NUM_THREADS``, and the launching process gets its
environment back afterwards, whether the run succeeded or failed (the coordinator's driver and tests launch
several runs from one process)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from deeppool.executor.config import RunConfig
from deeppool.executor.launch.launch import PLAN_VARIABLE, RunFailed, launch
from tests.executor.plans import cycle, make_plan_for

MODEL = Path(__file__).resolve().parents[1] / "library" / "models" / "cnn.py"
SCRIPT = """import os, sys
from pathlib import Path
Path(sys.argv[1]).write_text(os.environ["DEEPPOOL_PLAN"] + "\\n" + os.environ["OMP_NUM_THREADS"])
sys.exit(int(sys.argv[2]))
"""


@pytest.mark.slow
def test_the_plan_variable_is_the_ranks_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plan = make_plan_for(MODEL, global_batch=2, gpus=1, assign=cycle(1))
    plan.save(tmp_path / "plan.json")
    (tmp_path / "script.py").write_text(SCRIPT)
    monkeypatch.delenv(PLAN_VARIABLE, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = RunConfig(out_dir=tmp_path / "out")
    seen = tmp_path / "seen.txt"

    launch(plan, tmp_path / "plan.json", nproc=1, config=config, script_args=[str(seen), "0"],
           script=tmp_path / "script.py")
    assert seen.read_text().splitlines() == [str((tmp_path / "plan.json").resolve()), "1"]
    assert PLAN_VARIABLE not in os.environ

    monkeypatch.setenv(PLAN_VARIABLE, "the user's own")
    monkeypatch.delenv("OMP_NUM_THREADS")
    with pytest.raises(RunFailed, match="rank 0 exited with code 3"):
        launch(plan, tmp_path / "plan.json", nproc=1, config=config, script_args=[str(seen), "3"],
               script=tmp_path / "script.py")
    assert seen.read_text().splitlines()[0] == str((tmp_path / "plan.json").resolve())
    assert os.environ[PLAN_VARIABLE] == "the user's own"  # restored after a failed run too
    assert "OMP_NUM_THREADS" not in os.environ
