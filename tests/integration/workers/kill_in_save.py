"""examples/train_ddp.py, except that on the first attempt rank 0 SIGKILLs itself inside the
checkpoint save of step --kill-at-save: after the temporary file is written and fsynced, before
the rename that would publish it. The restarted job must load the checkpoint before it."""

import os
import re
import signal
import sys

from shoal.examples import train_ddp


def main() -> int:
    i = sys.argv.index("--kill-at-save")
    kill_at = int(sys.argv[i + 1])
    argv = sys.argv[1:i] + sys.argv[i + 2:]
    if os.environ.get("RANK") == "0" and os.environ.get("SHOAL_RESTART_COUNT") == "0":
        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            match = re.search(r"ckpt-(\d+)\.", os.path.basename(str(dst)))
            if match and int(match.group(1)) == kill_at:
                print(f"killing rank 0 inside the save of step {kill_at}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return real_replace(src, dst, *args, **kwargs)

        os.replace = replace
    return train_ddp.main(argv)


if __name__ == "__main__":
    sys.exit(main())
