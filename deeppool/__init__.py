"""deeppool: burst-parallel training and GPU multiplexing.

``deeppool.plan(module, example_inputs, gpus=...)`` plans a model from Python;
the packages are ``planner``, ``executor`` and ``cluster_sim``.
"""

from deeppool.errors import DeeppoolError

__version__ = "0.1.0"


def plan(*args, **kwargs):
    """Plan an ``nn.Module``: see :func:`deeppool.planner.api.plan`."""
    from deeppool.planner.api import plan as plan_module

    return plan_module(*args, **kwargs)


__all__ = ["DeeppoolError", "__version__", "plan"]
