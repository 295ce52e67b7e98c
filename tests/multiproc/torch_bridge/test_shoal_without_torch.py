"""shoal runs without torch: forming a group and all_reducing through the array intake (which
knows torch tensors) never imports torch."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
import numpy as np
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.store.hash import HashStore
pg = ProcessGroupTCP(HashStore(), 0, 1, timeout=10, name="no-torch")
a = np.ones(4, np.float32)
pg.all_reduce(a)
try:
    pg.all_reduce([1, 2])
except TypeError:
    pass
pg.shutdown()
print(sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "shoal.torch"))))
"""


def test_collectives_never_import_torch():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
