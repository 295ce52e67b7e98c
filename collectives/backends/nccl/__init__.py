"""The nccl backend: NCCL communicators through CuPy, bootstrapped through a store."""
