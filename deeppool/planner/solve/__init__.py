"""From a profile to a plan: the one cost model, the GPU counts a layer may use, the ILP and its cluster
objective, the baselines it is compared against, and :func:`~deeppool.planner.solve.build.build_plan`."""
