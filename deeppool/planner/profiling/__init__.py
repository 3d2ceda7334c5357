"""Where layer times come from: measured on this host (the profiler, its cache and statistics, the network
probe) or estimated from a device model; the result is a :class:`~deeppool.planner.profiling.profile.Profile`."""
