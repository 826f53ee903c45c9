"""RMSNorm kernels for AWS Trainium (NKI), with NumPy launchers and references."""
