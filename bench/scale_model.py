"""A cost model for all_reduce at thousands of ranks, fitted to measurements on this machine.

    python bench/scale_model.py            # full measurements and check, 3 rounds
    python bench/scale_model.py --quick    # fewer repetitions (about two minutes on 2 cores)
    python bench/scale_model.py --no-check # fits and predictions only
    python bench/scale_model.py --replay LOG...  # the check again from saved output
    chrt -f 10 python bench/scale_model.py --quick   # on a shared machine

The model, what it measures and how it is checked are described in bench/cost_model/
(its package docstring, which `--help` prints); this file is the command, and the measuring
peer processes it starts run through it too (`--peer ROLE ...`).
"""

from __future__ import annotations

import os
import sys

# One BLAS thread per process, set before numpy loads: the model counts each rank and peer
# as one busy process on this machine's cores.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

from cost_model.cli import main  # noqa: E402  (after the thread limits above)

if __name__ == "__main__":
    sys.exit(main())
