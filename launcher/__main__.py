"""`python -m shoal.launcher run ...` is the same as `shoal run ...`."""

import sys

from shoal.launcher.cli import main

if __name__ == "__main__":
    sys.exit(main())
