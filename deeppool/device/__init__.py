"""The device seam (:mod:`deeppool.device.seam`): streams, events, graphs, synchronisation, memory,
the collective backend and the MPS daemon behind one interface, with the real implementation
(:mod:`deeppool.device.cuda`) and a faithful fake for CPU tests (:mod:`deeppool.device.fake`).

Importing this package needs no CUDA (nor torch). See ``docs/gpu.md``.
"""

GPU_BACKEND = "nccl"
"""The ``torch.distributed`` backend of GPU ranks (``--backend`` names it)."""
