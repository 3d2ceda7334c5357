"""A chain MLP whose middle layer fails on one rank, to test fault handling.

``DEEPPOOL_TEST_FAULT=<raise|kill|hang|stop>:<rank>:<call>`` makes rank ``<rank>``
raise, SIGKILL itself, hang (sleep) or SIGSTOP itself at the ``<call>``-th call
of the layer (tracing calls it 3 times).
"""

import os
import signal
import time

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

_CALLS = [0]


def maybe_fail(x: torch.Tensor) -> torch.Tensor:
    _CALLS[0] += 1
    spec = os.environ.get("DEEPPOOL_TEST_FAULT", "")
    if spec:
        kind, rank, call = spec.split(":")
        if os.environ.get("RANK") == rank and _CALLS[0] == int(call):
            if kind == "raise":
                raise RuntimeError("injected failure")
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "hang":
                time.sleep(3600)
            if kind == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
    return x * 1.0


torch.fx.wrap("maybe_fail")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(maybe_fail(torch.relu(self.fc1(x))))


def model() -> nn.Module:
    return Net()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 8, generator=g),)


def targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 4, (batch_size,), generator=g)


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
