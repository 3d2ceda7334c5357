"""``deeppool replay``: a slice of a trace run on a live coordinator and in the simulator, compared.

:mod:`~deeppool.replay.slicing` scales the slice (arrivals, GPU counts, models, steps);
:mod:`~deeppool.replay.live` submits it to a running coordinator and records what happened;
:mod:`~deeppool.replay.compare` fits speed models to the live run and simulates the same jobs with them;
:mod:`~deeppool.replay.adaptive` does so under ``pollux`` from the coordinator's own fits;
:mod:`~deeppool.replay.lending` gives a lending policy's (``...:burst+bg``) simulation the hosts' plans and the
live loans' efficiency;
:mod:`~deeppool.replay.plot` draws both runs' allocations. The package sits above the coordinator's client
and the simulator and imports neither's internals.
"""
