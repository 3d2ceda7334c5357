"""Ctrl-C in every long-running command: one line ``interrupted``, exit 130 within 5 s, no process, no output left.

Each command is started as a real process in its own session and sent SIGINT (to its whole process group,
as a terminal's Ctrl-C is) once it has started its work.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DEADLINE_S = 5.0


@dataclass(frozen=True)
class Case:
    name: str
    args: tuple[str, ...]
    outputs: tuple[str, ...]
    after_s: float
    """Seconds after the start to press Ctrl-C: past the imports, into the work."""
    ready: str = ""
    """A glob under the command's folder that appears once the work has begun: Ctrl-C as soon as it does
    (within ``after_s``), instead of after a fixed wait."""


CASES = (
    Case("plan", ("plan", str(REPO / "examples/resnet50.py"), "--gpus", "8", "--batch", "32", "--cache-dir", "cache",
                  "--network", "local", "--out", "p.json", "--gantt", "p.png"), ("p.json", "p.png"), 8.0),
    Case("profile", ("profile", str(REPO / "examples/resnet50.py"), "--out", "profile.json", "--cache-dir", "cache"),
         ("profile.json",), 8.0),
    Case("simulate", ("simulate", "workload-6", "--gpus", "64", "--out", "sim", "--cache-dir", "cache"), ("sim",),
         30.0, "cache/graphs/*.json"),
    Case("simulate-deeppool", ("simulate-deeppool", "--out", "scenario", "--cache-dir", "cache"), ("scenario",),
         30.0, "cache/graphs/*.json"),
    Case("run", ("run", "small.json", "--steps", "100000", "--out", "run"), ("run",), 60.0, "run/progress.json"),
    Case("multiplex bench", ("multiplex", "bench", "small.json", "--background", str(REPO / "examples/background_mlp.py"),
                             "--out", "mux", "--steps", "100000"), ("mux",), 60.0, "mux/*/progress.json"),
    Case("profile-network", ("profile-network", "--out", "net.json"), ("net.json",), 6.0),
    Case("serve", ("serve", "--port", "PORT", "--gpus", "2", "--paused"), (), 5.0),  # paused: root needs no --job-user
)
COVERED = {"profile", "multiplex bench", "profile-network", "simulate"}
"""In the heavy tier: ``plan`` measures locally by default, so its case interrupts the same profiler (9 s each);
``multiplex bench`` starts its ranks through the launcher ``run``'s case interrupts, and ``profile-network``
its probe ranks through the same ``die_on_interrupt`` (12 s and 7 s); ``simulate`` plans its models in the pool of
workers ``simulate-deeppool``'s case interrupts."""


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("plan")
    subprocess.run([sys.executable, "-m", "deeppool.cli", "plan", "tests.models.factories:small_cnn", "--input-shape",
                    "3,32,32", "--gpus", "4", "--batch", "64", "--device-model", "a100", "--out", "small.json"],
                   cwd=folder, check=True, capture_output=True, env=_env())
    return folder / "small.json"


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.heavy) if case.name in COVERED else case
                                  for case in CASES], ids=lambda case: case.name)
def test_ctrl_c_stops_the_command_says_so_and_leaves_nothing(case: Case, small_plan: Path, tmp_path: Path) -> None:
    _press_ctrl_c(case, small_plan, tmp_path, presses=1)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c.name in ("simulate-deeppool", "run")], ids=lambda c: c.name)
def test_a_second_ctrl_c_while_stopping_changes_nothing(case: Case, small_plan: Path, tmp_path: Path) -> None:
    """Users press twice. The second press lands while the first one's clean-up runs (a pool of workers, ranks);
    it once escaped that clean-up and ended the command by the signal (exit -2)."""
    _press_ctrl_c(case, small_plan, tmp_path, presses=2)


def _press_ctrl_c(case: Case, small_plan: Path, tmp_path: Path, *, presses: int) -> None:
    (tmp_path / "small.json").write_bytes(small_plan.read_bytes())
    stderr = tmp_path / "stderr.txt"
    with stderr.open("w") as errors:
        args = [str(_free_port()) if arg == "PORT" else arg for arg in case.args]
        process = subprocess.Popen([sys.executable, "-m", "deeppool.cli", *args], cwd=tmp_path, env=_env(),
                                   stdout=subprocess.DEVNULL, stderr=errors, start_new_session=True)
        _wait_for_work(case, process, tmp_path)
        assert process.poll() is None, f"{case.name} ended before Ctrl-C: {stderr.read_text()}"
        pressed = time.monotonic()
        os.killpg(process.pid, signal.SIGINT)
        for _ in range(presses - 1):
            time.sleep(0.3)
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)
        code = process.wait(timeout=30)
        took = time.monotonic() - pressed
    lines = stderr.read_text().strip().splitlines()
    said = [line for line in lines if not (case.name == "serve" and line.startswith("deeppool serve: "))]
    assert (code, said) == (130, ["interrupted"])  # serve also prints its start and stop lines
    assert took <= DEADLINE_S, f"{case.name} took {took:.1f} s to stop"
    assert _processes_naming(tmp_path, until=pressed + DEADLINE_S) == [], "processes left running"
    assert [name for name in case.outputs if (tmp_path / name).exists()] == []


def _wait_for_work(case: Case, process: subprocess.Popen, folder: Path) -> None:
    """``case.after_s`` seconds; or, for a case with a ``ready`` glob, until it matches (at most that long)."""
    if not case.ready:
        time.sleep(case.after_s)
        return
    deadline = time.monotonic() + case.after_s
    while not list(folder.glob(case.ready)) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(folder.glob(case.ready)), f"{case.name}: no {case.ready} within {case.after_s:.0f} s"


def _processes_naming(folder: Path, *, until: float) -> list[int]:
    """Processes whose command line or working folder is in ``folder`` (ranks run in sessions of their own)."""
    found = _scan(folder)
    while found and time.monotonic() < until:
        time.sleep(0.1)
        found = _scan(folder)
    return found


def _scan(folder: Path) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if str(folder) in os.readlink(entry / "cwd") or str(folder).encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def test_only_outputs_begun_in_the_block_are_removed_and_only_on_an_interrupt(tmp_path: Path) -> None:
    from deeppool.interrupt import Interrupted, removed_if_interrupted

    kept, begun, folder = tmp_path / "kept.json", tmp_path / "begun.json", tmp_path / "run"
    kept.write_text("earlier")
    with pytest.raises(KeyboardInterrupt), removed_if_interrupted(kept, begun, folder, None):
        begun.write_text("half")
        (folder / "sub").mkdir(parents=True)
        raise KeyboardInterrupt
    assert (kept.read_text(), begun.exists(), folder.exists()) == ("earlier", False, False)
    with pytest.raises(Interrupted), removed_if_interrupted(begun):
        begun.write_text("half")
        raise Interrupted()
    assert not begun.exists()
    with pytest.raises(ValueError), removed_if_interrupted(begun):
        begun.write_text("a failure's output is kept")
        raise ValueError
    assert begun.exists()


SURFACED_AS_IMPORT_ERROR = """
import os, signal, typer
from pathlib import Path
from deeppool.entry import run_app
from deeppool.interrupt import removes_if_interrupted

app = typer.Typer()


@app.command()
@removes_if_interrupted("out")
def work(out: Path) -> None:
    out.mkdir()
    try:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C reaches the handler, which ignores the next ones ...
    except KeyboardInterrupt:  # ... and an extension's initialisation catches it, as pybind11 does
        raise ImportError("initialization failed") from None


@app.command()
@removes_if_interrupted("out")
def other(out: Path) -> None:
    out.mkdir()
    raise ImportError("a real import error")


run_app(app)
"""


@pytest.mark.parametrize(("command", "expected"), [("work", (130, "interrupted")), ("other", (1, "ImportError"))])
def test_an_interrupt_that_surfaces_as_another_exception_is_still_an_interrupt(tmp_path: Path, command: str,
                                                                             expected: tuple[int, str]) -> None:
    """Ctrl-C while highspy was being imported raised ``ImportError: initialization failed`` and printed a
    traceback (exit 1), and left the output the command had begun (`simulate-deeppool`'s folder, once in a
    suite run). An exception after Ctrl-C reached the process is the interrupt; without one, an exception is
    what it is, and a failure's output is kept."""
    script = tmp_path / "app.py"
    script.write_text(SURFACED_AS_IMPORT_ERROR)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(script), command, str(out)], capture_output=True, text=True,
                          timeout=60, env=_env(), check=False)
    code, said = expected
    assert done.returncode == code and said in done.stderr.strip().splitlines()[-1], done.stderr
    assert out.exists() == (command == "other")
