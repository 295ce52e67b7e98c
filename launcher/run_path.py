"""`--run-path`: run a script with runpy.run_path, as torchrun's run_script_path does.

`python -m shoal.launcher.run_path /abs/script.py ARGS...` sets sys.argv to the script and its
arguments and runs it as `__main__` in this interpreter.
"""

import runpy
import sys


def main() -> None:
    """Run sys.argv[1] with the remaining arguments."""
    if len(sys.argv) < 2:
        sys.stderr.write("usage: python -m shoal.launcher.run_path SCRIPT [ARGS...]\n")
        raise SystemExit(2)
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
