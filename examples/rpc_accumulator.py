"""RPC demo: rank 0 owns an accumulator, rank 1 updates it through an RRef.

    shoal run --nproc-per-node 2 examples/rpc_accumulator.py
"""
import os

import numpy as np

import shoal.rpc_agent as rpc


class Accumulator:
    def __init__(self, n):
        self.total = np.zeros(n)

    def add(self, x):
        self.total += x
        return self.total.copy()


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
    if rank == 1:
        acc = rpc.remote("worker0", Accumulator, args=(4,))
        futs = [acc.rpc_async().add(np.full(4, i, dtype=np.float64)) for i in range(1, 5)]
        rpc.wait_all(futs)
        print("remote total:", acc.rpc_sync().add(np.zeros(4)), "owner:", acc.owner_name())
        print("sum via rpc_sync:", rpc.rpc_sync("worker0", np.add, args=(np.ones(2), 2.0)))
    rpc.shutdown()


if __name__ == "__main__":
    main()
