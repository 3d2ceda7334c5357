"""The training features around the engine: what a run keeps, checks, adapts and writes.

Checkpoints, the single-process ``--check`` reference, per-step figures and stragglers, a policy's
adaptation, the run's summary, its progress file, the names of the files it writes and their live
TensorBoard view. It builds on :mod:`deeppool.executor.engine`, never on ``api`` or ``launch`` above it.
"""
