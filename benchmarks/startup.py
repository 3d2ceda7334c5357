"""Start-up of ``deeppool run``: seconds from the command's launch to the end of the first step, and to its exit.

    python benchmarks/startup.py [--nproc 2,4] [--repeats 5] [--steps 1] [--batch 32] [--tree PATH] [--label NAME]
                                 [--baseline-tree PATH | --baseline-commit COMMIT] [--json FILE] [--keep]
                                 [--write-docs]

Each rank count gets a data-parallel plan of this file's MLP (``deeppool plan --strategy dp --device-model
a100``: estimated, nothing measured; every rank trains every layer), written by the tree that runs it. Then
``deeppool run PLAN --steps K --out DIR`` runs as a subprocess, only through the command line, from a
working directory outside every tree. Its figures (wall clock from its launch, ``time.time`` just before
the process starts):

* **first step**: the end of the first optimizer step, read from the run's own record: rank 0 writes
  ``DIR/progress.json`` (``{"steps_done": 1, ...}``, atomically) right after step 1, and that file's
  modification time is the moment it was written. With ``--steps 1`` (the default) it is written once, so
  it is read after the exit; with more steps the file is polled every 10 ms and the first version saying
  ``steps_done: 1`` is kept (a sample where a later version came first is reported as missed);
* **exit**: when the command's process has exited (the ranks torn down, the summary written);
* **CPU**: user + system seconds of the command and of every process it waited for (the ranks), to the
  exit (``getrusage(RUSAGE_CHILDREN)``): on a shared machine, less disturbed by the other load.

``--tree PATH`` runs another checkout's deeppool (e.g. ``git worktree add /tmp/before COMMIT``) instead of
this one: the command is that tree's ``[project.scripts] deeppool`` entry run by this Python with
``PYTHONPATH=PATH``, which the ranks inherit (the editable install's finder comes after ``PYTHONPATH``).
``--baseline-commit COMMIT`` checks that commit out in a temporary git worktree and measures it the same way;
``--baseline-tree PATH`` also measures that tree, as *before* (this tree, or ``--tree``, is *after*),
interleaved in one invocation: every repeat runs each rank count on both trees, the order alternating. So
that no figure comes from the wrong code, this file is also the plan's model file and, when imported (in the
launcher and in every rank), records which ``deeppool`` package that process imported; a run in which some
process imported another tree's is an error. Each (tree, rank count) first runs once untimed (cold caches,
bytecode compiled).

Printed: per rank count and tree, the median and the range (min-max) over ``--repeats`` runs of the
seconds to the first step's end, to the slowest rank's import of the model file and to the exit, and of
the CPU seconds; with a baseline, the change of the medians. ``--json`` saves every run's raw figures;
``--write-docs`` writes the table into ``docs/performance.md`` (region ``startup``).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from pathlib import Path

PROBE = "DEEPPOOL_STARTUP_PROBE"
"""Environment: the folder where every process that imports this model file records its ``deeppool``."""

_MLP = runpy.run_path(str(Path(__file__).resolve().parent / "models" / "mlp.py"))
model, inputs, targets, loss = (_MLP[name] for name in ("model", "inputs", "targets", "loss"))
"""The model file's convention, served by ``benchmarks/models/mlp.py``'s MLP."""


def _record_import() -> None:
    """In a run's process: which deeppool this process imported, its rank (none: the launcher) and when."""
    folder = os.environ.get(PROBE)
    if not folder or __name__ == "__main__":
        return
    package = sys.modules.get("deeppool")
    record = {"pid": os.getpid(), "rank": os.environ.get("RANK"), "time": time.time(),
              "deeppool": getattr(package, "__file__", None)}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{os.getpid()}-{time.monotonic_ns()}.json"), "w") as handle:
        json.dump(record, handle)


_record_import()


# -- the benchmark (the measured processes import this file as their model: they define, never run, what follows) -
import argparse
import resource
import shutil
import statistics
import subprocess
import tempfile
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
POLL_S = 0.01


class Tree(NamedTuple):
    """A checkout whose deeppool is measured: ``label`` (before / after), its path and commit."""

    label: str
    path: Path
    commit: str

    @classmethod
    def at(cls, label: str, path: Path) -> Tree:
        path = path.resolve()
        if not (path / "deeppool" / "__init__.py").is_file():
            raise SystemExit(f"error: {path} holds no deeppool package (want a checkout of the repository)")
        return cls(label=label, path=path, commit=_commit(path))

    def command(self) -> list[str]:
        """The tree's ``deeppool`` command: its ``[project.scripts]`` entry, run by this Python."""
        scripts = tomllib.loads((self.path / "pyproject.toml").read_text())["project"]["scripts"]
        module, _, function = scripts["deeppool"].partition(":")
        code = f"import sys; from {module} import {function} as main; sys.argv[0] = 'deeppool'; sys.exit(main())"
        return [sys.executable, "-c", code]

    def env(self, probe: Path | None = None) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(self.path)}
        env.pop(PROBE, None)
        if probe is not None:
            env[PROBE] = str(probe)
        return env


class Sample(NamedTuple):
    """One timed run: seconds from launch to the first step's end, to the slowest rank's model import, to exit."""

    tree: str
    nproc: int
    repeat: int
    first_step_s: float | None
    model_import_s: float
    exit_s: float
    cpu_s: float
    """CPU seconds (user + system) of the command and every process it waited for (its ranks), to its exit."""
    load: float
    deeppool: list[str]


def _commit(path: Path) -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(path), *args], check=False, capture_output=True,
                              text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return f"{head} (with uncommitted changes)" if git("status", "--porcelain", "--untracked-files=no") else head


def make_plan(tree: Tree, nproc: int, batch: int, work: Path) -> Path:
    """A data-parallel plan of this file's model for ``nproc`` ranks, by ``tree``'s ``deeppool plan``."""
    path = work / f"plan-{tree.label}-{nproc}.json"
    command = [*tree.command(), "plan", str(Path(__file__).resolve()), "--gpus", str(nproc), "--batch", str(batch),
               "--device-model", "a100", "--strategy", "dp", "--out", str(path)]
    done = subprocess.run(command, check=False, cwd=work, env=tree.env(), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {tree.label}'s deeppool plan failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return path


def run_once(tree: Tree, plan: Path, nproc: int, steps: int, out: Path, repeat: int) -> Sample:
    """``deeppool run`` once, timed from its launch; the deeppool every process imported is checked."""
    probe = out / "probe"
    command = [*tree.command(), "run", str(plan), "--nproc", str(nproc), "--steps", str(steps), "--out", str(out)]
    progress = out / "progress.json"
    first: tuple[int, int] | None = None  # (steps_done, mtime ns) of the first progress.json seen
    out.parent.mkdir(parents=True, exist_ok=True)
    with (out.parent / f"{out.name}.log").open("w") as log:
        used = _children_cpu()
        started = time.time()
        process = subprocess.Popen(command, cwd=out.parent, env=tree.env(probe), stdout=log, stderr=subprocess.STDOUT)
        while steps > 1 and process.poll() is None:
            first = first or _progress(progress)
            time.sleep(POLL_S)
        code = process.wait()
        exited = time.time()
        used = _children_cpu() - used
    if code != 0:
        raise SystemExit(f"error: {tree.label}'s deeppool run exited {code}; its output:\n"
                         f"{(out.parent / f'{out.name}.log').read_text()[-3000:]}")
    first = first or _progress(progress)
    first_step = None if first is None or first[0] != 1 else first[1] / 1e9 - started
    records = [json.loads(p.read_text()) for p in sorted(probe.glob("*.json"))]
    files = sorted({str(r["deeppool"]) for r in records})
    ranks = sorted(int(r["rank"]) for r in records if r["rank"] is not None)
    want = tree.path / "deeppool" / "__init__.py"
    if files != [str(want)] or ranks != list(range(nproc)):
        raise SystemExit(f"error: {tree.label}'s run imported deeppool from {files} in ranks {ranks} "
                         f"(want {want} in ranks 0..{nproc - 1})")
    model_import = max(r["time"] for r in records if r["rank"] is not None) - started
    return Sample(tree=tree.label, nproc=nproc, repeat=repeat, first_step_s=first_step, model_import_s=model_import,
                  exit_s=exited - started, cpu_s=used, load=os.getloadavg()[0], deeppool=files)


def _children_cpu() -> float:
    """CPU seconds of this process's waited-for children and theirs (the benchmark runs one command at a time)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _progress(path: Path) -> tuple[int, int] | None:
    """(steps done, modification time in ns) of the run's progress file, or None before it exists."""
    try:
        with path.open() as handle:  # the version opened: the writer replaces the file, never rewrites it
            return json.load(handle)["steps_done"], os.fstat(handle.fileno()).st_mtime_ns
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def measure(trees: list[Tree], nprocs: list[int], repeats: int, steps: int, batch: int, work: Path) -> list[Sample]:
    plans = {(t.label, n): make_plan(t, n, batch, work) for t in trees for n in nprocs}
    for tree in trees:
        for nproc in nprocs:  # untimed: cold page cache, bytecode compiled
            run_once(tree, plans[tree.label, nproc], nproc, steps, work / f"{tree.label}-{nproc}-warm", -1)
    samples = []
    for repeat in range(repeats):
        for nproc in nprocs:
            for tree in trees if repeat % 2 == 0 else trees[::-1]:
                sample = run_once(tree, plans[tree.label, nproc], nproc, steps,
                                  work / f"{tree.label}-{nproc}-{repeat}", repeat)
                samples.append(sample)
                print(f"  {tree.label} {nproc} ranks, run {repeat + 1}/{repeats}: first step "
                      f"{_seconds(sample.first_step_s)} s, exit {sample.exit_s:.2f} s (load {sample.load:.1f})",
                      file=sys.stderr, flush=True)
    return samples


def _seconds(value: float | None) -> str:
    return "missed" if value is None else f"{value:.2f}"


def spread(values: list[float | None]) -> dict[str, float | int | None]:
    """Median, min and max of the values measured (a missed first step is left out and counted)."""
    kept = [v for v in values if v is not None]
    if not kept:
        return {"median": None, "min": None, "max": None, "n": 0, "missed": len(values)}
    return {"median": statistics.median(kept), "min": min(kept), "max": max(kept), "n": len(kept),
            "missed": len(values) - len(kept)}


def summarise(samples: list[Sample], trees: list[Tree], nprocs: list[int]) -> dict[str, dict[str, dict]]:
    summary: dict[str, dict[str, dict]] = {}
    for nproc in nprocs:
        for tree in trees:
            mine = [s for s in samples if s.tree == tree.label and s.nproc == nproc]
            summary[f"{tree.label}/{nproc}"] = {
                "first_step_s": spread([s.first_step_s for s in mine]),
                "model_import_s": spread([s.model_import_s for s in mine]),
                "exit_s": spread([s.exit_s for s in mine]),
                "cpu_s": spread([s.cpu_s for s in mine]),
            }
    return summary


def table(summary: dict[str, dict[str, dict]], trees: list[Tree], nprocs: list[int], repeats: int) -> Table:
    from rich.table import Table

    shown = Table(title=f"deeppool run start-up, seconds from launch: median (min-max) of {repeats} runs")
    for header in ("ranks", "tree", "first step ends", "slowest rank imports the model", "exit", "CPU s to exit"):
        shown.add_column(header, justify="left" if header == "tree" else "right")

    def cell(figures: dict) -> str:
        if figures["median"] is None:
            return "missed"
        missed = f", {figures['missed']} missed" if figures["missed"] else ""
        return f"{figures['median']:.2f} ({figures['min']:.2f}-{figures['max']:.2f}{missed})"

    for nproc in nprocs:
        for tree in trees:
            row = summary[f"{tree.label}/{nproc}"]
            shown.add_row(str(nproc), f"{tree.label}: {tree.commit}", cell(row["first_step_s"]),
                          cell(row["model_import_s"]), cell(row["exit_s"]), cell(row["cpu_s"]))
    return shown


def verdict(summary: dict[str, dict[str, dict]], samples: list[Sample], trees: list[Tree], nprocs: list[int]) -> str:
    """With a baseline, per rank count: the change of the medians, and the median (min-max) of the ratios of
    the runs paired by repeat (run next to each other, so under the same load, more or less)."""
    if len(trees) < 2:
        return ""
    before, after = trees[0].label, trees[1].label
    lines = [(f"{after} against {before}: the change of the medians; paired: the median (min-max) of the "
              f"ratios {after}/{before} of the runs paired by repeat")]
    for nproc in nprocs:
        pairs = {}
        for sample in samples:
            if sample.nproc == nproc:
                pairs.setdefault(sample.repeat, {})[sample.tree] = sample
        parts = []
        for key, name in (("first_step_s", "first step"), ("exit_s", "exit"), ("cpu_s", "CPU")):
            old, new = summary[f"{before}/{nproc}"][key]["median"], summary[f"{after}/{nproc}"][key]["median"]
            ratios = [getattr(p[after], key) / getattr(p[before], key) for p in pairs.values()
                      if len(p) == 2 and getattr(p[after], key) is not None and getattr(p[before], key) is not None]
            if old is not None and new is not None and ratios:
                parts.append(f"{name} {new - old:+.2f} s, paired {statistics.median(ratios):.2f}x "
                             f"({min(ratios):.2f}-{max(ratios):.2f})")
        lines.append(f"  {nproc} ranks: " + ", ".join(parts))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", default="2,4", help="rank counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per rank count and tree")
    parser.add_argument("--steps", type=int, default=1, help="deeppool run --steps")
    parser.add_argument("--batch", type=int, default=32, help="the plans' global batch")
    parser.add_argument("--tree", type=Path, default=REPO, help="the checkout whose deeppool runs (default: this one)")
    parser.add_argument("--label", default="after", help="the measured tree's name in the table and the JSON")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="also measure this checkout's deeppool, as 'before', interleaved")
    parser.add_argument("--baseline-commit", default=None,
                        help="also measure this commit of the repository, as 'before' (checked out in a temporary "
                             "git worktree, removed after)")
    parser.add_argument("--json", type=Path, default=None, help="save every run's figures here")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders (plans, logs, out)")
    parser.add_argument("--write-docs", action="store_true",
                        help="also write the table into docs/performance.md (region 'startup')")
    args = parser.parse_args()
    from rich.console import Console

    from deeppool.docregions import Stamp, markdown, text_block, write_region

    nprocs = [int(n) for n in args.nproc.split(",")]
    if args.baseline_tree is not None and args.baseline_commit is not None:
        raise SystemExit("error: give --baseline-tree or --baseline-commit, not both")
    stamp = Stamp.started()
    work = Path(tempfile.mkdtemp(prefix="deeppool-startup-"))
    baseline = args.baseline_tree
    if args.baseline_commit is not None:
        baseline = work / "baseline"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(baseline),
                        args.baseline_commit], check=True)
    trees = [Tree.at(args.label, args.tree)]
    if baseline is not None:
        trees.insert(0, Tree.at("before", baseline))
        if args.label == "before":
            raise SystemExit("error: with a baseline, the measured tree cannot be labelled 'before'")
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"machine: {os.cpu_count()} CPU cores, load average {load} at the start; "
          f"deeppool run --steps {args.steps}, data-parallel MLP plans, global batch {args.batch}")
    for tree in trees:
        print(f"{tree.label}: {tree.path} at {tree.commit}")
    try:
        samples = measure(trees, nprocs, args.repeats, args.steps, args.batch, work)
    finally:
        if args.baseline_commit is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline)], check=False)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    summary = summarise(samples, trees, nprocs)
    shown = table(summary, trees, nprocs, args.repeats)
    caption = (f"First step: the run's progress.json written after step 1 (its modification time); exit: the "
               f"command's process ended; CPU: user + system seconds of the command and its ranks, which the "
               f"machine's other load disturbs less than wall time. Every process's deeppool import checked "
               f"against its tree. Load average {load} at the start, {os.getloadavg()[0]:.2f} at the end.")
    Console(width=160).print(shown)
    print(caption)
    change = verdict(summary, samples, trees, nprocs)
    if change:
        print(change)
    if args.json is not None:
        args.json.write_text(json.dumps({
            "trees": [{"label": t.label, "path": str(t.path), "commit": t.commit} for t in trees],
            "nproc": nprocs, "repeats": args.repeats, "steps": args.steps, "batch": args.batch,
            "machine": {"cpus": os.cpu_count(), "load_start": stamp.load_start, "load_end": os.getloadavg()[0]},
            "summary": summary, "samples": [s._asdict() for s in samples],
        }, indent=1) + "\n")
    if args.write_docs:
        body = f"{markdown(shown)}\n\n{caption}" + (f"\n\n{text_block(change)}" if change else "")
        write_region(REPO / "docs" / "performance.md", "startup", body, stamp)


if __name__ == "__main__":
    main()
