"""Datasets for the ``mlp`` test model (12 features, 5 classes) that record what each process reads.

With ``DEEPPOOL_TEST_RECORD=DIR`` set, ``dataset[i]`` appends ``i`` to ``DIR/rank<RANK>.txt``.
"""

import os
from pathlib import Path

import torch
from torch.utils.data import Dataset


class Recording(Dataset):
    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(size, 12, generator=g)
        self.y = torch.randint(0, 5, (size,), generator=g)
        self.record = os.environ.get("DEEPPOOL_TEST_RECORD")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.record:
            with open(Path(self.record) / f"rank{os.environ.get('RANK', '0')}.txt", "a") as log:
                log.write(f"{index}\n")
        return self.x[index], self.y[index]


def dataset() -> Recording:
    """20 samples: 3 global batches of 6 per epoch, 2 samples dropped."""
    return Recording(20)
