"""A worker for torchrun's command lines, run the same way under `shoal run` and `torchrun`.

It prints `ENV {json}` with the variables a launcher gives it and how it was started; with
--meet it meets its peers through the agent's store (shoal's only: torchrun's store speaks
another protocol); with --wait-signal it waits for a forwarded signal and reports it; with
--raise it raises inside shoal.elastic.errors.record, which writes TORCHELASTIC_ERROR_FILE.
"""

import argparse
import json
import os
import signal
import sys
import time

KEYS = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
        "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "OMP_NUM_THREADS", "MASTER_ADDR",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_ERROR_FILE"]
WAITED = ("SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--meet", action="store_true")
    parser.add_argument("--wait-signal", metavar="READY_DIR")
    parser.add_argument("--raise", dest="raise_", action="store_true")
    parser.add_argument("--chatter", action="store_true", help="one line on each stream")
    args, rest = parser.parse_known_args()  # the documented lines pass (--arg1 ...) through
    rank = int(os.environ["RANK"])
    env = {k: os.environ.get(k) for k in KEYS}
    env.update(argv0=sys.argv[0], rest=rest, name=__name__)
    if args.meet:
        from shoal.collectives.store.tcp import TCPStore

        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=30)
        store.add("sum", rank)
        world = int(os.environ["WORLD_SIZE"])
        if store.add("arrived", 1) == world:
            store.set("all_arrived", "1")
        store.wait(["all_arrived"], 30)
        env["sum"] = int(store.add("sum", 0))
    print("ENV " + json.dumps(env), flush=True)
    if args.chatter:
        print(f"out of local rank {os.environ['LOCAL_RANK']}", flush=True)
        print(f"err of local rank {os.environ['LOCAL_RANK']}", file=sys.stderr, flush=True)
    if args.raise_:
        from shoal.elastic.errors import record

        @record
        def train():
            raise ValueError(f"rank {rank} found a bad batch")

        train()
    if args.wait_signal:
        def on_signal(signum, frame):
            print(f"rank {rank} got {signal.Signals(signum).name}", flush=True)
            sys.exit(0)

        for name in WAITED:
            signal.signal(getattr(signal, name), on_signal)
        open(os.path.join(args.wait_signal, f"ready-{rank}"), "w").close()
        time.sleep(60)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
