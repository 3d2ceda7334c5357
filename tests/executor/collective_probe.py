"""One rank's collectives, as the executor makes them: ``python -m tests.executor.collective_probe BACKEND``.

With the GPU backend on a one-GPU host this is the documented single-rank check (NCCL refuses two
ranks on one GPU): a world of one, bound through the device seam, runs a real all-reduce, and an
asynchronous one launched on a side stream and waited for as :mod:`deeppool.executor.engine.gradients` does.
With gloo (CI) the same code runs up to the device. Prints ``collective ok <backend> <device>``.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist

from deeppool.device.cuda import CudaGpu, backend_is_gpu
from deeppool.executor.engine.comm import TorchComm
from deeppool.executor.engine.gradients import GradientReducer
from deeppool.device.seam import side_stream
from tests.net import free_port


def main(backend: str) -> None:
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    gpu = CudaGpu() if backend_is_gpu(backend) else None
    device = gpu.bind(0) if gpu is not None else torch.device("cpu")
    summed = torch.arange(4.0, device=device)
    dist.all_reduce(summed)
    assert summed.tolist() == [0.0, 1.0, 2.0, 3.0], summed
    grads = [torch.full((300,), 2.0, device=device), torch.ones(5, device=device)]
    reducer = GradientReducer(TorchComm([(0,)], timeout_s=60.0), bucket_bytes=64,
                              side=side_stream(gpu, device))
    reducer.add((0,), grads)
    reducer.finish()
    assert grads[0].sum().item() == 600.0 and grads[1].sum().item() == 5.0
    dist.destroy_process_group()
    print(f"collective ok {backend} {device}")


if __name__ == "__main__":
    main(sys.argv[1])
