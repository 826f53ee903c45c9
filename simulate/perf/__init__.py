"""The cost model and the profiler: they read a trace from ``simulate.core`` and never import
a front-end."""
