"""Planning shared by both NKI dialects' kernels: regimes, tile sizes and SBUF budgets
(:mod:`nki_rmsnorm.plan.forward`, :mod:`nki_rmsnorm.plan.backward`). No NKI instruction runs
here, so the plans can be checked against capacities without running a kernel; the kernels
call the planners during specialization, so they are written in the NKI meta-programming
language (:mod:`nki_rmsnorm.plan.forward` says how). Containers derive from ``NKIObject``
(:mod:`nki_rmsnorm.plan.nki_object`); checks are ``kernel_assert``
(:mod:`nki_rmsnorm.plan.kernel_assert`); dtype sizes come from
:mod:`nki_rmsnorm.plan.dtypes`."""
