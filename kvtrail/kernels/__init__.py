"""kvtrail.kernels: see docs/architecture.md."""
