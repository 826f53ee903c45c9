"""NKI kernels (NKI only: they import NKI through :mod:`nki_rmsnorm.nki`).

``rmsnorm_fwd`` and ``rmsnorm_bwd`` are ``nki.jit`` kernels in the return convention; the
NumPy launchers in :mod:`nki_rmsnorm.ops` validate, reshape and call them.
"""

from nki_rmsnorm.kernels.rmsnorm_bwd import rmsnorm_bwd
from nki_rmsnorm.kernels.rmsnorm_fwd import rmsnorm_fwd

__all__ = ["rmsnorm_fwd", "rmsnorm_bwd"]
