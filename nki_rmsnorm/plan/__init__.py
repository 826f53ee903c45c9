"""Pure-Python planning shared by both NKI dialects' kernels: regimes, tile sizes and SBUF
budgets (:mod:`nki_rmsnorm.plan.forward`, :mod:`nki_rmsnorm.plan.backward`). Nothing here
runs NKI, so the plans can be checked against capacities without running a kernel; the
containers derive from ``NKIObject`` (:mod:`nki_rmsnorm.plan.nki_object`) so that NKI 0.6
kernels may use them."""
