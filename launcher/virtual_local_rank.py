"""`--virtual-local-rank`, as torchrun: each worker sees only its own GPU, as device 0.

`python .../virtual_local_rank.py PROGRAM ARGS...` picks this worker's device (entry
LOCAL_RANK of CUDA_VISIBLE_DEVICES, or device LOCAL_RANK when that is unset), sets
CUDA_VISIBLE_DEVICES to it and LOCAL_RANK to 0, and execs PROGRAM in this same process, so the
agent's pid, signals and death signal still reach the worker. The launcher runs it by path,
not with -m, so that the shoal package is not imported twice per worker.
"""

import os
import sys
from typing import Mapping, Optional


def visible_devices(environ: Mapping[str, str]) -> Optional[list[str]]:
    """The devices CUDA_VISIBLE_DEVICES lists in `environ`, in its order (None when it is unset:
    every device is visible)."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    return [d.strip() for d in visible.split(",") if d.strip()]


def main() -> None:
    """Map LOCAL_RANK onto one visible device, then exec sys.argv[1:]."""
    if len(sys.argv) < 2:
        sys.stderr.write("usage: virtual_local_rank.py PROGRAM [ARGS...]\n")
        raise SystemExit(2)
    local = int(os.environ["LOCAL_RANK"])
    listed = visible_devices(os.environ)
    if listed is None:
        device = str(local)
    elif local >= len(listed):  # shoal run checks this first; a changed environment only
        sys.stderr.write(f"--virtual-local-rank: local rank {local} has no device in "
                         f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r}\n")
        raise SystemExit(2)
    else:
        device = listed[local]
    os.environ["CUDA_VISIBLE_DEVICES"] = device
    os.environ["LOCAL_RANK"] = "0"
    os.execvp(sys.argv[1], sys.argv[1:])


if __name__ == "__main__":
    main()
