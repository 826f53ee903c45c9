"""RMSNorm kernels for AWS Trainium (NKI), with NumPy launchers and references.

``rms_norm``, ``rms_norm_fwd``, ``rms_norm_bwd``, ``rms_norm_qk`` (the query and key norms
in one launch), ``rms_norm_quant`` (fp8 quantized output) and ``rms_norm_mx_quant`` (MXFP8
output, trn3; :mod:`nki_rmsnorm.mx`) take and return NumPy arrays and run the NKI kernels
(in the simulator unless the Neuron compiler is installed);
:mod:`nki_rmsnorm.reference` has the same functions in float64 NumPy, and
:mod:`nki_rmsnorm.torch` / :mod:`nki_rmsnorm.jax` the framework bindings (extras ``torch`` and
``jax``), :mod:`nki_rmsnorm.hf` the Hugging Face ``transformers`` patching (extra ``hf``).
"""

from importlib import metadata as _metadata

from nki_rmsnorm.mx import rms_norm_mx_quant
from nki_rmsnorm.ops import rms_norm, rms_norm_bwd, rms_norm_fwd, rms_norm_qk, rms_norm_quant

try:
    __version__: str = _metadata.version("nki-rmsnorm")
except _metadata.PackageNotFoundError:  # a source tree on sys.path, never installed
    __version__ = "0+unknown"

__all__ = [
    "__version__",
    "rms_norm",
    "rms_norm_bwd",
    "rms_norm_fwd",
    "rms_norm_mx_quant",
    "rms_norm_qk",
    "rms_norm_quant",
]
