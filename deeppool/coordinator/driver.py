"""One coordinator job's work: ``python -m deeppool.coordinator.driver SPEC.json`` (a supervisor's step).

It runs as the job's account, in the job's folder. It first stages the
model file (and the guest's): opened once, checked again against the
server's allowed roots by what was opened, and copied into the job's folder
(:func:`~deeppool.coordinator.isolation.stage_model`); the copy is what is
planned and trained, so a file swapped after submission, or after the check,
never runs. A foreground job is planned for the GPUs it was granted (the
device model the server names; ``a100`` by default) and run on that many
local ranks. When background jobs were lent its idle windows, the first
trains there through the multiplexer, always in processes of its own (never
a thread of a rank): ``mps`` on a GPU with the MPS tools, else ``gate``; a
plan that leaves no idle window runs alone and says so. A background job
given whole GPUs is planned and run on them as a job of its own. A job for several ``nodes``
runs in a Slurm allocation of that many, over all of them
(:func:`deeppool.coordinator.slurm.run_across`). With ``check``, every step
is compared with single-process training (``deeppool run --check``). The run's ``summary.json`` lands
in the job's folder; the coordinator reads the background's progress from it.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deeppool.coordinator.isolation import REFUSED, RunAs, private_dir, stage_model, write_private
from deeppool.coordinator.jobs import JobKind
from deeppool.coordinator.launcher import resources_for
from deeppool.coordinator.supervisor import JobFiles


def stop_file(folder: Path, job_id: int) -> Path:
    """The file whose appearance stops an elastic job resumably (written by the server, as the job's account,
    beside the job's folder: never in it)."""
    return folder / f"job-{job_id}.stop"


GUEST_RUNNER = "deeppool.coordinator.guest"
"""What a host's rank runs to start a guest lent the running job: it stages the guest's model (as the account,
checked against the allowed roots) and trains it as the rank's background child."""
ATTEMPT = "attempt.json"
"""In the job's folder: when the attempt's driver started, how long it planned and whether the plan was cached."""

if TYPE_CHECKING:
    from deeppool.coordinator.slurm import SlurmAllocation


@dataclass(frozen=True, kw_only=True)
class DriverSpec:
    model: str
    gpus: int
    batch: int
    steps: int
    amplification: float | None
    out: Path
    device_model: str = "a100"
    background_model: str | None = None
    background_batch: int = 8
    background_broker: str | None = None
    """a guest of another account: its processes are the host supervisor's broker's to start (this socket)"""
    check: bool = False
    nodes: int = 1
    allowed_roots: tuple[Path, ...] = ()
    """where model files may come from (checked again at launch); empty: anywhere"""
    script: str | None = None
    """The job's own training script, run on every rank with the plan (``deeppool run --script``)."""
    input_shape: tuple[int, ...] = ()
    """a factory model's input (the job's ``input_shape``, ``input_dtype``, ``vocab_size``)"""
    input_dtype: str = "float32"
    vocab_size: int = 0
    stop_file: str | None = None
    """An elastic job's: it checkpoints to ``out/checkpoints`` and stops resumably after the step at which this
    file appears, and resumes from its last checkpoint when started again (on any GPU count)."""
    gain: float = 1.0
    """AdaScale's gain at this batch (the coordinator's, when it changed the job's batch): the learning rate is
    ``deeppool run``'s default times it."""
    measure_gns: bool = False
    """measure the gradient noise scale (``--monitor gns``) when the plan has a layer group to measure it on"""
    guests_control: str | None = None
    """the control file of the guests the coordinator lends the running job (:mod:`deeppool.multiplex.guests`);
    None: none join it (it has a guest from its start, or is a script job, or spans several nodes)"""

    def to_json(self) -> dict[str, Any]:
        return {**self.__dict__, "out": str(self.out), "allowed_roots": [str(r) for r in self.allowed_roots],
                "input_shape": list(self.input_shape)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DriverSpec:
        roots = tuple(Path(r) for r in data.get("allowed_roots", ()))
        return cls(**{**data, "out": Path(data["out"]), "allowed_roots": roots,
                      "input_shape": tuple(data.get("input_shape", ()))})


def drive(spec: DriverSpec) -> dict[str, Any]:
    from deeppool import options
    from deeppool.coordinator.slurm import run_across
    from deeppool.executor.config import Adaptation, Monitor, OptimizerConfig, RunConfig
    from deeppool.multiplex.api import run
    from deeppool.multiplex.options import RUN_BACKGROUND
    from deeppool.planner.api import plan_model
    from deeppool.planner.request import CostSource, PlanRequest, probed_source
    from deeppool.plans import ModelSpec, Plan
    from deeppool.plans.jsonio import write_json

    allocation = slurm_allocation(spec.nodes)
    spec.out.mkdir(parents=True, exist_ok=True)
    (spec.out / REFUSED).unlink(missing_ok=True)  # an earlier attempt's
    staged = stage_model(spec.model, spec.allowed_roots, spec.out / "model")
    model = ModelSpec.parse(staged, input_shape=spec.input_shape, input_dtype=spec.input_dtype,
                            vocab_size=spec.vocab_size)
    started = time.time()
    cached = spec.out / "plans" / f"{spec.gpus}gpus-{spec.batch}-{_plan_key(spec, staged)}.json"
    hit = cached.is_file()
    if hit:  # a width this job has had: not planned again
        plan = Plan.load(cached)
    else:
        source = probed_source(CostSource(device_model=spec.device_model), spec.gpus,
                               lambda line: print(line, flush=True))
        plan = plan_model(model, PlanRequest(gpus=spec.gpus, global_batch=spec.batch,
                                             amplification=spec.amplification), source).plan
        cached.parent.mkdir(exist_ok=True)
        plan.save(cached)
    plan.save(spec.out / "plan.json")
    write_json(spec.out / ATTEMPT, {"started_at": started, "plan_s": time.time() - started, "plan_cached": hit,
                                    "gpus": spec.gpus, "batch": spec.batch})
    background = None
    if spec.background_model is not None:
        if plan.predicted.idle_windows:
            background = _guest(spec, plan)
        else:
            print("the plan leaves no idle window: the background job was not run", flush=True)
    monitor = Monitor.GNS if spec.measure_gns and _grouped(plan) else Monitor.NONE
    config = RunConfig(steps=spec.steps, warmup=min(5, spec.steps - 1), out_dir=spec.out / "run", check=spec.check,
                       checkpoint=_checkpoint(spec), optimizer=OptimizerConfig(lr=OptimizerConfig().lr * spec.gain),
                       adaptation=Adaptation(monitor=monitor))
    if spec.script is not None:
        return _script(spec, plan, config, lent=background is not None, one_node=allocation is None)
    if allocation is None:
        return run(plan, plan_path=spec.out / "plan.json", background=background, config=config, checked=True,
                   guests=_guests(spec, background))
    run_across(allocation, spec.out / "plan.json", plan.gpus,
               options.argv(RunConfig, config) + options.argv(RUN_BACKGROUND, background))
    return json.loads((spec.out / "run" / "summary.json").read_text())


def _plan_key(spec: DriverSpec, staged: str) -> str:
    """What a plan depends on besides its GPUs and batch: the staged model (its bytes, or the factory's name and
    inputs), the device model and the amplification cap."""
    path = Path(staged)
    model = path.read_bytes() if path.is_file() else staged.encode()
    settings = json.dumps([spec.device_model, spec.amplification, spec.input_shape, spec.input_dtype,
                           spec.vocab_size]).encode()
    return hashlib.sha256(model + b"\0" + settings).hexdigest()[:16]


def _grouped(plan: Any) -> bool:
    """Whether some layer's gradients are all-reduced over two or more GPUs (the noise scale is measured there)."""
    return any(layer.gpus > 1 and layer.allreduce_ms > 0 for layer in plan.layers)


def _checkpoint(spec: DriverSpec) -> Any:
    """An elastic job's checkpoints (written only when it is stopped), resumed from when there is one."""
    from deeppool.executor.config import CheckpointConfig

    if spec.stop_file is None or spec.check:
        return None
    return CheckpointConfig(directory=spec.out / "checkpoints", resume=True, stop_file=Path(spec.stop_file))


def _guests(spec: DriverSpec, background: Any) -> Any:
    """Where the ranks find the guests lent the running job (none with a guest from the start)."""
    from deeppool.multiplex.guests import GuestsConfig

    if spec.guests_control is None or background is not None:
        return None
    return GuestsConfig(control=Path(spec.guests_control), runner=GUEST_RUNNER)


def _guest(spec: DriverSpec, plan: Any) -> Any:
    """The guest's background config, checked (:func:`deeppool.multiplex.preflight.check`); None, said in the
    log, when it cannot run: a guest never fails its host. One of another account is the broker's to start
    (``gate``, on the CPU); one of the host's account is staged and started here (``mps`` on a GPU with the MPS
    tools, else ``gate``)."""
    from deeppool.device.cuda import CudaGpu
    from deeppool.device.mps import control_available
    from deeppool.errors import DeeppoolError
    from deeppool.multiplex import preflight
    from deeppool.multiplex.config import BackgroundConfig, MuxMode

    assert spec.background_model is not None
    try:
        if spec.background_broker is not None:
            background = BackgroundConfig(model=Path(spec.background_model), batch=spec.background_batch,
                                          mode=MuxMode.GATE, broker=Path(spec.background_broker),
                                          checkpoint_dir=spec.out / "background")
        else:
            mps = CudaGpu().available() and control_available()
            staged = stage_model(spec.background_model, spec.allowed_roots, spec.out / "background-model")
            background = BackgroundConfig(model=Path(staged), batch=spec.background_batch,
                                          mode=MuxMode.MPS if mps else MuxMode.GATE,
                                          checkpoint_dir=spec.out / "background", preflight_apart=True)
        preflight.check(plan, background)
    except DeeppoolError as err:
        print(f"the background job was not run: {err}", flush=True)
        return None
    return background


def _script(spec: DriverSpec, plan: Any, config: Any, *, lent: bool, one_node: bool) -> dict[str, Any]:
    """A script job: the user's script on every rank, as ``deeppool run --script`` starts it (one node;
    the script's loop has no idle-window listener, so a background job lent its windows does not run)."""
    from deeppool.errors import DeeppoolError
    from deeppool.executor.launch.launch import launch

    if not one_node:
        raise DeeppoolError("a script job runs on one node: serve it without --launcher slurm")
    if lent:
        print("a script job lends no idle windows: the background job was not run", flush=True)
    script = stage_model(spec.script, spec.allowed_roots, spec.out / "script")
    launch(plan, spec.out / "plan.json", nproc=plan.gpus, config=config, script=Path(script))
    return {"script": spec.script, "gpus": plan.gpus}


def slurm_allocation(nodes: int) -> SlurmAllocation | None:
    """None for a job on one node; else the Slurm allocation of ``nodes`` nodes this runs in, or the refusal."""
    from deeppool.coordinator.slurm import SlurmAllocation
    from deeppool.errors import DeeppoolError

    if nodes == 1:
        return None
    allocation = SlurmAllocation.here()
    if allocation is None or len(allocation.nodes) != nodes:
        given = "no Slurm allocation" if allocation is None else f"an allocation of {len(allocation.nodes)}"
        raise DeeppoolError(f"the job spans {nodes} nodes but runs in {given}: serve with --launcher slurm")
    return allocation


def main() -> None:
    from deeppool.errors import DeeppoolError

    spec = DriverSpec.from_json(json.loads(Path(sys.argv[1]).read_text()))
    try:
        summary = drive(spec)
    except DeeppoolError as err:
        print(f"error: {err}", file=sys.stderr)
        from deeppool.coordinator.isolation import ModelRefused

        if isinstance(err, ModelRefused):  # which refusal, for the job's reason (the server maps it to its text)
            (spec.out / REFUSED).write_text(json.dumps({"why": err.why}))
        sys.exit(err.exit_code)
    (spec.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))


if __name__ == "__main__":
    main()


@dataclass(frozen=True, kw_only=True)
class DriverSteps:
    """The coordinator's :data:`~deeppool.coordinator.runtime.Steps`: one driver step per attempt.

    The job's outputs go to ``folder/job-N`` (0700, the job's account's); the attempt's spec to
    ``folder/job-N.A.driver.json`` (0600, the account's: the server never writes into a job's folder).
    ``check``: every run is compared with single-process training, step by step (to validate a cluster).
    ``nodes``: the machines a foreground job spans (as the runtime's). ``run_as``: the account each job
    runs as; ``allowed_roots``: where model files may come from, checked again when the job starts. A guest
    of another account is given the socket of its host supervisor's broker, which starts its processes
    (:mod:`deeppool.coordinator.guest`). A job's attempt runs on the GPUs, batch, steps and learning rate its
    last resize set (:mod:`deeppool.coordinator.elastic`), else those it asked for.
    """

    folder: Path
    device_model: str = "a100"
    check: bool = False
    nodes: int = 1
    run_as: RunAs = RunAs()
    allowed_roots: tuple[Path, ...] = ()
    elastic: bool = False
    """foreground jobs with a model (not a script) run resizable: a stop file, checkpoints, resume"""
    measure_gns: bool = False
    """elastic jobs measure their gradient noise scale (a co-adaptive policy changes their batch by it)"""

    def __call__(self, job: Any, attempt: int, guests: Any) -> list[list[str]]:
        out = self.folder / f"job-{job.id}"
        account = self.run_as.account(job.owner)
        private_dir(out, account)
        guest = guests[0] if guests else None
        broker = None
        if guest is not None and not self.run_as.same_account(job.owner, guest.owner):
            broker = str(JobFiles(folder=self.folder, job_id=job.id, attempt=attempt).guest_socket)
        elastic = self.elastic and job.kind is JobKind.FOREGROUND and job.script is None
        spec = DriverSpec(model=job.model, gpus=job.held, batch=job.current_batch, steps=job.run_steps or job.steps,
                          stop_file=str(stop_file(self.folder, job.id)) if elastic else None,
                          gain=job.run_gain or 1.0, measure_gns=self.measure_gns,
                          amplification=job.amplification, out=out, device_model=self.device_model,
                          background_model=guest.model if guest is not None else None,
                          background_batch=guest.batch if guest is not None else 8, background_broker=broker,
                          check=self.check,
                          nodes=resources_for(job, self.nodes).nodes, allowed_roots=self.allowed_roots,
                          script=job.script, input_shape=tuple(job.input_shape or ()),
                          input_dtype=job.input_dtype or "float32", vocab_size=job.vocab_size or 0)
        if guest is None and job.kind is JobKind.FOREGROUND and job.script is None and spec.nodes == 1:
            control = JobFiles(folder=self.folder, job_id=job.id, attempt=attempt).guests_control
            spec = replace(spec, guests_control=str(control))
        path = self.folder / f"job-{job.id}.{attempt}.driver.json"
        write_private(path, json.dumps(spec.to_json()).encode(), account)
        return [[sys.executable, "-m", "deeppool.coordinator.driver", str(path)]]
