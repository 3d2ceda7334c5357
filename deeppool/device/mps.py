"""A private MPS control daemon for ``--mux mps`` (GPU only; imports without CUDA).

:meth:`MpsDaemon.running` starts ``nvidia-cuda-mps-control -d`` with its own
``CUDA_MPS_PIPE_DIRECTORY`` and ``CUDA_MPS_LOG_DIRECTORY`` (temporary
directories, so it never meets another user's daemon), exports them to the
processes started inside the context (the ranks and, through them, the
background children, which are MPS clients), and on exit sends ``quit`` and
removes the directories. The background client gets
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (:func:`client_env`), fixed when its
CUDA context is created. NVIDIA recommends exclusive-process compute mode,
which needs root: deeppool does not change the compute mode.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from deeppool.errors import DeeppoolError

CONTROL = "nvidia-cuda-mps-control"
PIPE, LOG, PERCENT = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"

Run = Callable[..., subprocess.CompletedProcess]


def control_available() -> bool:
    """Is ``nvidia-cuda-mps-control`` on PATH?"""
    return shutil.which(CONTROL) is not None


def client_env(percentage: int) -> dict[str, str]:
    """The background client's environment: the daemon's pipe (inherited) and its share of the SMs."""
    return {PERCENT: str(percentage)}


class MpsDaemon:
    def __init__(self, root: Path, run: Run = subprocess.run, *, on_path: bool = True) -> None:
        """``run`` runs the control (``subprocess.run``, or a stand-in); ``on_path``: the control must be on PATH
        (a stand-in is not)."""
        self.pipe, self.log = root / "pipe", root / "log"
        self.pipe.mkdir(parents=True)
        self.log.mkdir(parents=True)
        self._run, self._on_path = run, on_path

    @property
    def env(self) -> dict[str, str]:
        return {PIPE: str(self.pipe), LOG: str(self.log)}

    def start(self) -> None:
        if self._on_path and not control_available():
            raise DeeppoolError(f"--mux mps needs {CONTROL} on PATH: install the CUDA MPS tools or use --mux priority")
        done = self._run([CONTROL, "-d"], env={**os.environ, **self.env}, capture_output=True, text=True)
        if done.returncode != 0:
            raise DeeppoolError(f"{CONTROL} -d failed ({done.returncode}): {done.stderr.strip() or 'see ' + str(self.log)}")

    def stop(self) -> None:
        self._run([CONTROL], input="quit\n", env={**os.environ, **self.env}, capture_output=True, text=True)

    @classmethod
    @contextlib.contextmanager
    def running(cls, run: Run = subprocess.run, *, on_path: bool = True) -> Iterator[MpsDaemon]:
        root = Path(tempfile.mkdtemp(prefix="deeppool-mps-"))
        daemon = cls(root, run, on_path=on_path)
        saved = {key: os.environ.get(key) for key in daemon.env}
        try:
            daemon.start()
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        try:
            os.environ.update(daemon.env)
            yield daemon
        finally:
            daemon.stop()
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            shutil.rmtree(root, ignore_errors=True)
