"""The collectives shoal composes for torch's names, next to torch's gloo in the same run.

all_to_all_single, reduce_scatter_tensor, all_gather_into_tensor (4 MiB of float32 per rank),
all_reduce_coalesced (16 tensors of 64 KiB), batch_isend_irecv (a 1 MiB ring exchange),
gather_object and scatter_object_list (a small dict per rank). Each spawned rank joins a gloo
group and a shoal group; blocks of iterations alternate between the two sides (A B A B) so
drift on a busy machine hits both. Every iteration starts after its side's barrier and counts
as the slowest rank's time; the table gives medians and torch's median / shoal's.

    python bench/torch_names.py             # W=2
    python bench/torch_names.py --world 3 --rounds 6
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
import secrets  # noqa: E402

from shoal.core import settings as core_settings  # noqa: E402  (after the thread limits)

if not core_settings.AUTH_TOKEN.is_set():
    os.environ[core_settings.AUTH_TOKEN.name] = secrets.token_hex(16)  # the ranks inherit it

import argparse  # noqa: E402
import multiprocessing  # noqa: E402
import queue  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

MiB = 1024 * 1024
CASES = ("all_to_all_single", "reduce_scatter_tensor", "all_gather_into_tensor",
         "all_reduce_coalesced", "batch_isend_irecv", "gather_object", "scatter_object_list")
CTX = multiprocessing.get_context("spawn")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _calls(mod, torch, rank: int, world: int, tensor):
    """case -> a function running it once on side `mod` (torch.distributed or collectives)."""
    n = (MiB // world) * world  # float32 elements per rank: about 4 MiB, in equal blocks
    big, out = tensor(np.ones(n, np.float32)), tensor(np.empty(n, np.float32))
    gathered = tensor(np.empty(n * world, np.float32))
    scattered = tensor(np.empty(n // world, np.float32))
    parts = [tensor(np.ones(16 * 1024, np.float32)) for _ in range(16)]
    ring_out, ring_in = tensor(np.ones(MiB // 4, np.float32)), tensor(np.empty(MiB // 4, np.float32))
    obj = {"rank": rank, "loss": 0.25, "step": 17, "names": ["a", "b"]}
    right, left = (rank + 1) % world, (rank - 1) % world

    def p2p():
        for work in mod.batch_isend_irecv([mod.P2POp(mod.isend, ring_out, right),
                                           mod.P2POp(mod.irecv, ring_in, left)]):
            work.wait()

    def gather_obj():
        mod.gather_object(obj, [None] * world if rank == 0 else None, dst=0)

    def scatter_obj():
        mod.scatter_object_list([None], [obj] * world if rank == 0 else None, src=0)

    return {
        "all_to_all_single": lambda: mod.all_to_all_single(out, big),
        "reduce_scatter_tensor": lambda: mod.reduce_scatter_tensor(scattered, big),
        "all_gather_into_tensor": lambda: mod.all_gather_into_tensor(gathered, big),
        "all_reduce_coalesced": lambda: mod.all_reduce_coalesced(parts),
        "batch_isend_irecv": p2p,
        "gather_object": gather_obj,
        "scatter_object_list": scatter_obj,
    }


def _rank(rank: int, world: int, torch_port: int, store_port: int, rounds: int, per_block: int,
          results) -> None:
    import torch
    import torch.distributed as td

    import shoal.collectives as sd

    torch.set_num_threads(1)
    td.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank,
                          world_size=world)
    sd.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{store_port}", rank=rank,
                          world_size=world, timeout=120)
    sides = {"torch": (td, _calls(td, torch, rank, world, torch.from_numpy)),
             "shoal": (sd, _calls(sd, torch, rank, world, lambda a: a))}
    times: dict = {}
    for case in CASES:
        for name in ("torch", "shoal"):  # warm-up
            sides[name][1][case]()
        for _ in range(rounds):
            for name in ("torch", "shoal"):
                mod, calls = sides[name]
                for _ in range(per_block):
                    mod.barrier()
                    start = time.perf_counter()
                    calls[case]()
                    times.setdefault((case, name), []).append(time.perf_counter() - start)
    sd.destroy_process_group()
    td.destroy_process_group()
    results.put((rank, times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4, help="A B blocks per case")
    parser.add_argument("--per-block", type=int, default=10, help="iterations per block")
    args = parser.parse_args()
    results = CTX.Queue()
    ports = (_free_port(), _free_port())
    procs = [CTX.Process(target=_rank, args=(r, args.world, *ports, args.rounds, args.per_block,
                                             results)) for r in range(args.world)]
    for p in procs:
        p.start()
    per_rank: dict = {}
    deadline = time.monotonic() + 900
    while len(per_rank) < len(procs):
        try:
            rank, times = results.get(timeout=5)
            per_rank[rank] = times
        except queue.Empty:  # check that no rank died, and the deadline
            dead = [p.name for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                raise SystemExit(f"ranks {dead or 'all'} failed or did not finish in time")
    for p in procs:
        p.join(60)
    print(f"W={args.world}, {args.rounds} x {args.per_block} iterations per side and case; "
          "slowest rank per iteration; medians in ms")
    print(f"{'case':<24}{'torch gloo':>12}{'shoal':>10}{'torch/shoal':>13}")
    for case in CASES:
        med = {}
        for name in ("torch", "shoal"):
            slowest = np.max([per_rank[r][(case, name)] for r in range(args.world)], axis=0)
            med[name] = statistics.median(slowest) * 1e3
        print(f"{case:<24}{med['torch']:>12.3f}{med['shoal']:>10.3f}{med['torch'] / med['shoal']:>12.2f}x")


if __name__ == "__main__":
    main()
