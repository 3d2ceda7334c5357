"""cluster_sim: a discrete-event simulator of a GPU cluster running a job trace.

It reuses the planner's cost model and Plans (never a copy of them) to answer
"what would this cluster do with this trace under this policy": data parallel,
burst parallel, and burst parallel with idle GPU time lent to background jobs.
See ``docs/simulator.md`` for the model and its assumptions.
"""
