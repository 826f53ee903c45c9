"""NKI kernels (NKI only: they import NKI through :mod:`nki_rmsnorm.nki`).

Two calling conventions over the same code:

* return convention (SDK ≥ 2.21; what ``nki.jit`` kernels called directly use):
  ``rmsnorm_fwd``, ``rmsnorm_add_fwd`` (fused residual add) and ``rmsnorm_bwd`` create their
  HBM outputs and return them;
* output-parameter convention (``torch_neuronx.nki_jit``, ``jax_neuronx.nki_call``):
  ``rmsnorm_fwd_out``, ``rmsnorm_add_fwd_out`` and ``rmsnorm_bwd_out`` write the caller's
  preallocated outputs in place and return nothing; an output's dtype is its buffer's.

The NumPy launchers in :mod:`nki_rmsnorm.ops` validate, reshape and call them.
"""

from nki_rmsnorm.kernels.rmsnorm_bwd import rmsnorm_bwd, rmsnorm_bwd_out
from nki_rmsnorm.kernels.rmsnorm_fwd import (
    rmsnorm_add_fwd,
    rmsnorm_add_fwd_out,
    rmsnorm_fwd,
    rmsnorm_fwd_out,
)

__all__ = ["rmsnorm_add_fwd", "rmsnorm_add_fwd_out", "rmsnorm_bwd", "rmsnorm_bwd_out",
           "rmsnorm_fwd", "rmsnorm_fwd_out"]
