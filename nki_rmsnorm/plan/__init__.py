"""Pure-Python planning shared by both NKI dialects' kernels: regimes, tile sizes and SBUF
budgets (:mod:`nki_rmsnorm.plan.forward`, :mod:`nki_rmsnorm.plan.backward`). Nothing here
imports NKI, so the plans can be checked against capacities without running a kernel."""
