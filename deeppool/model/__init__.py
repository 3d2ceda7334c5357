"""The model as deeppool runs it: loading a model file or factory, tracing it into a layer graph, and
running its layers on slices of a batch (randomness per sample, BatchNorm synchronised within a layer's
group, custom autograd functions, in-place ops). The planner, the executor, the multiplexer and the library
all import it; it imports only :mod:`deeppool.plans` and :mod:`deeppool.errors`."""
