"""Suite-wide settings: a fixed auth token for spawned ranks and no stray BLAS threads."""

import os

# Every process the suite starts inherits these, so ranks agree on the secret and numpy's BLAS
# does not oversubscribe the two cores CI has.
os.environ.setdefault("SHOAL_AUTH_TOKEN", "shoal-test-suite-token")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
