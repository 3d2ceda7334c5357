"""deeppool: burst-parallel training and GPU multiplexing.

``deeppool.plan(module, example_inputs, gpus=...)`` plans a model from Python;
``deeppool.run(plan, model=module, background=...)`` runs one (``model`` for a
plan whose module was built in Python; a background job in its idle
windows); ``deeppool.parallelize(module, plan)`` runs one inside the user's own
training loop and ``deeppool.kfac(bp)`` adds K-FAC to that loop (``deeppool.Plan.load(path)`` reads a plan
file); the packages
are ``planner``, ``executor``, ``library``, ``multiplex`` and ``cluster_sim``.
"""

from deeppool.errors import DeeppoolError

__version__ = "0.1.0"


def plan(*args, **kwargs):
    """Plan an ``nn.Module``: see :func:`deeppool.planner.api.plan`."""
    from deeppool.planner.api import plan as plan_module

    return plan_module(*args, **kwargs)


def run(*args, **kwargs):
    """Run a plan on local ranks, optionally with a background job: see :func:`deeppool.multiplex.api.run`."""
    from deeppool.multiplex.api import run as run_plan

    return run_plan(*args, **kwargs)


def parallelize(*args, **kwargs):
    """This rank's part of a plan, for the user's own training loop: see :func:`deeppool.library.parallelize`."""
    from deeppool.library import parallelize as parallelize_module

    return parallelize_module(*args, **kwargs)


def kfac(*args, **kwargs):
    """K-FAC between ``bp.step(...)`` and ``opt.step()``: see :func:`deeppool.library.kfac.kfac`."""
    from deeppool.library import kfac as kfac_preconditioner

    return kfac_preconditioner(*args, **kwargs)


def __getattr__(name: str):
    if name == "Plan":  # loaded on first use, so ``deeppool --help`` stays light
        from deeppool.plans import Plan

        return Plan
    raise AttributeError(f"module 'deeppool' has no attribute '{name}'")


__all__ = ["DeeppoolError", "Plan", "__version__", "kfac", "parallelize", "plan", "run"]
