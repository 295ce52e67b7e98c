"""`python -m launcher run ...` is the same as `shoal run ...`."""

import sys

from launcher.cli import main

if __name__ == "__main__":
    sys.exit(main())
