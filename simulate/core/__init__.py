"""The simulator's core: dtypes and rounding, indexing, tensors and views, memory and its
capacities, engine instructions and their semantics, the trace, the per-launch run context,
calling conventions and targets. It imports neither the cost model (``simulate.perf``) nor
any front-end (``simulate.legacy``); ``make lint`` enforces that."""
