"""The RMSNorm kernels in the ``nki`` 0.6 dialect (Neuron SDK 2.31 – 2.32): the same file and
function names as :mod:`nki_rmsnorm.kernels.legacy`, so a diff between the two shows only
the dialect. They import NKI from :mod:`nki_rmsnorm.kernels.nki06._nki` and plan with
:mod:`nki_rmsnorm.plan`; :mod:`nki_rmsnorm.kernels` resolves the entry points."""
