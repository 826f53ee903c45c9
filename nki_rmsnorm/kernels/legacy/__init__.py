"""The RMSNorm kernels in the legacy dialect (``neuronxcc.nki``, Neuron SDK 2.21 – 2.29). They
import NKI from :mod:`nki_rmsnorm.nki` and plan with :mod:`nki_rmsnorm.plan`;
:mod:`nki_rmsnorm.kernels` resolves the entry points."""
