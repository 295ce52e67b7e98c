"""`bench/allreduce.py --hosts HxL`: collectives across hosts made as network namespaces.

H hosts (Linux network namespaces joined by veth pairs to one bridge, tests/support/netns.py;
needs root and iproute2) with L ranks each. The sides run the same cases in the same run,
alternating blocks of iterations (A B C A B C) while the others wait:

- shoal: the default, two-level algorithms (shared memory within a host, L concurrent rings
  between hosts);
- shoal_flat: SHOAL_HIERARCHICAL=0, one flat ring over sockets (Unix sockets within a host,
  TCP between hosts): what shoal did before the two-level algorithms;
- shoal_flat_tcp: the same flat ring with every link on TCP (SHOAL_LOCAL_TRANSPORT=tcp, loopback
  within a host): the flat TCP ring a gloo-like backend runs;
- gloo: torch.distributed's gloo over the same namespaces (when torch is installed);
- wire (all_reduce, two or more hosts): no collective at all, only the bytes that each host
  must send and receive in any all_reduce built from per-host partial sums (2(H-1)/H x S each
  way, which is S at H = 2), streamed over plain TCP sockets tuned as shoal's links between
  hosts, L streams per host. It is a floor for the two-level algorithms on these links.

Where the time goes: every side reports its ranks' CPU time per op (user and system, every
thread), summed over the ranks: on this 2-core machine a side needing X core-ms takes at least
X/2 ms. Beside it, how often those threads slept in the kernel per op (voluntary context
switches): each sleep costs a wake-up's CPU later, and ranks sharing cores sleep more. The
shoal side also times the phases of its two-level all_reduce on every rank
(shared-memory reduce-scatter, the rings between hosts, shared-memory all-gather).

The order of the sides rotates from block to block, so no side always runs first after the
machine idled. Each row gives the median, the 10th-90th percentile spread of each side, and the
ratios two ways: of the medians, and the median of per-block ratios (blocks that ran back to
back, so a slow minute of the machine hits both sides alike). The shoal side must report that
it took the two-level path where the layout has one (several hosts with several ranks each);
the run stops otherwise.

Each rank is a process on its host, driven over its stdin/stdout (the parent sits outside the
namespaces and has no route into them). Times are the slowest rank's per iteration, medians
over iterations; busbw as nccl-tests defines it. The veth links are software: their
"bandwidth" is this machine's copy speed, shared with the ranks' own work on 2 cores, so the
figures compare algorithms, not networks (bench/scale_model.py extrapolates to real links).
`--link-gbit R` shapes each host's link to R Gbit/s each way (tbf on both ends of its veth): a
network slower than the CPUs, where the bytes each host must move, not the cores, set the pace.
"""

from __future__ import annotations

import json
import os
import resource
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

from allreduce_cases import bus_factor, fmt_size, gloo_runner, iterations, shoal_runner

from shoal.collectives import settings as collective_settings

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = "@@bench "  # stdout lines of the protocol; anything else is the rank's own output
WAIT_S = 600.0
BASE_PORT = 29400


def parse_hosts(spec: str) -> tuple[int, int]:
    """'2x2' -> (2 hosts, 2 ranks per host)."""
    try:
        h, _, per = spec.lower().partition("x")
        hosts, per_host = int(h), int(per)
    except ValueError:
        raise SystemExit(f"--hosts takes HOSTSxRANKS, e.g. 2x2, got {spec!r}") from None
    if hosts < 1 or per_host < 1:
        raise SystemExit(f"--hosts needs at least one host and one rank per host, got {spec!r}")
    return hosts, per_host


# ----------------------------------------------------------------------------- one rank

def _say(**message) -> None:
    sys.stdout.write(PROTOCOL + json.dumps(message) + "\n")
    sys.stdout.flush()


def _wire_runner(c, pg, rank: int, world: int, per_host: int, n: int):
    """(run, barrier) for the wire floor: rank i of host h streams 2(H-1)/H x S/L bytes to
    rank i of the next host while it takes as many from the previous one, over plain TCP
    sockets tuned as shoal's links between hosts, with no reduction and no shared memory.
    Those are the bytes each host must send and receive in any all_reduce whose hosts each
    contribute one partial sum (S each way at H = 2), so no two-level scheme beats this time
    over these links on this machine."""
    import socket
    import threading

    import numpy as np

    from shoal.collectives.backends.tcp import wire
    from shoal.collectives.constants import SOCKET_BUFFER_BYTES

    n_hosts = world // per_host
    nbytes = max(1, (2 * (n_hosts - 1) * n * 4) // (n_hosts * per_host))
    host, index = divmod(rank, per_host)
    listener = socket.socket()
    wire.tune_socket(listener, same_host=False)
    listener.bind((os.environ["BENCH_HOST_ADDRESS"], 0))
    listener.listen(1)
    listener.settimeout(60)
    addresses = [None] * world
    c.all_gather_object(addresses, listener.getsockname())
    tx = socket.socket()
    wire.tune_socket(tx, same_host=False)
    tx.settimeout(60)
    tx.connect(tuple(addresses[((host + 1) % n_hosts) * per_host + index]))
    rx, _ = listener.accept()
    listener.close()
    for sock in (tx, rx):
        sock.settimeout(WAIT_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    src, dst = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    out = memoryview(dst)

    def receive():
        if not wire.recv_exact(rx, out):
            raise SystemExit(f"wire rank {rank}: the previous host closed its stream")

    def run():
        if nbytes <= SOCKET_BUFFER_BYTES:
            # The message fits the send buffer, so sending first cannot wait on the peer's
            # receive: no thread to start, which at small sizes cost more than the bytes.
            tx.sendall(memoryview(src))
            receive()
            return
        sender = threading.Thread(target=tx.sendall, args=(memoryview(src),))
        sender.start()
        receive()
        sender.join()

    run.close = lambda: (tx.close(), rx.close())  # the worker calls it when its case ends
    return run, pg.barrier


class _PhaseClock:
    """Wall time the shoal side's two-level all_reduce spends in each phase (bench-only:
    wraps the phase functions of collectives/backends/tcp/hierarchical.py)."""

    PHASES = (("reduce", "_reduce_piece"), ("cross", "_cross_piece"), ("share", "_share_piece"))

    def __init__(self):
        from shoal.collectives.backends.tcp import hierarchical

        self.spent = {name: 0.0 for name, _ in self.PHASES}
        for name, attr in self.PHASES:
            setattr(hierarchical, attr, self._timed(name, getattr(hierarchical, attr)))

    def _timed(self, name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - t0
        return timed

    def take(self) -> dict:
        taken, self.spent = self.spent, {name: 0.0 for name in self.spent}
        return taken


def worker(side: str, rank: int, world: int, master: str, port: int, per_host: int) -> None:
    """One rank: form the group, then run blocks of iterations as the parent asks."""
    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    import numpy as np  # noqa: F401  (loaded before timing)

    if side == "gloo":
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.TCPStore(master, port, world, rank == 0, timeout=__import__("datetime").timedelta(seconds=300))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        make = lambda op, n: gloo_runner(dist, torch, op, n, world)  # noqa: E731
    else:
        os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world))
        if side in ("shoal_flat", "shoal_flat_tcp", "wire"):
            os.environ[collective_settings.HIERARCHICAL.name] = "0"
        if side == "shoal_flat_tcp":
            os.environ[collective_settings.LOCAL_TRANSPORT.name] = "tcp"
        import shoal.collectives as c

        pg = c.init_process_group("tcp", init_method="env://", timeout=300)
        make = lambda op, n: shoal_runner(pg, op, n, world)  # noqa: E731
        if side == "wire":
            make = lambda op, n: _wire_runner(c, pg, rank, world, per_host, n)  # noqa: E731
        if rank == 0:
            print(f"{side}: hierarchical={pg.hierarchical} hosts {pg.topology.describe()}",
                  file=sys.stderr, flush=True)
    clock = _PhaseClock() if side == "shoal" and pg.hierarchical else None
    _say(ready=True, hierarchical=bool(side != "gloo" and pg.hierarchical))
    runners = {}
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        key = (command["op"], command["bytes"])
        if key not in runners:
            # Cases run one after another: the last case's runner (the wire side's sockets,
            # every side's arrays) is done with.
            for run, _ in runners.values():
                getattr(run, "close", lambda: None)()
            runners.clear()
            runners[key] = make(key[0], key[1] // 4)
            for _ in range(3):
                runners[key][0]()
        run, barrier = runners[key]
        barrier()
        run()  # untimed: the other sides' blocks evicted our arrays from the caches
        ts, cpu, sleeps = [], 0.0, 0
        if clock is not None:
            clock.take()
        for _ in range(command["count"]):
            barrier()
            t0, c0, s0 = time.perf_counter(), time.process_time(), _voluntary_switches()
            run()
            ts.append(time.perf_counter() - t0)
            cpu += time.process_time() - c0
            sleeps += _voluntary_switches() - s0
        # CPU: this process's, every thread's, user and system, per op (the barriers' excluded);
        # sleeps: how often its threads waited in the kernel (each a wake-up's CPU later)
        _say(times=ts, cpu=cpu / len(ts), sleeps=sleeps / len(ts),
             phases={k: v / len(ts) for k, v in clock.take().items()} if clock else None)
    if side == "gloo":
        dist.destroy_process_group()
    else:
        c.destroy_process_group()


def _voluntary_switches() -> int:
    """Times this process's threads (all of them: RUSAGE_SELF) gave up the CPU to wait."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw


# ----------------------------------------------------------------------------- the parent

class _Rank:
    def __init__(self, proc: subprocess.Popen, side: str, rank: int):
        self.proc, self.side, self.rank = proc, side, rank
        self._buf = b""

    def send(self, **command) -> None:
        self.proc.stdin.write((json.dumps(command) + "\n").encode())
        self.proc.stdin.flush()

    def receive(self, deadline: float) -> dict:
        """The next protocol message; the rank's other output is passed through to stderr."""
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(PROTOCOL):
                    return json.loads(text[len(PROTOCOL):])
                print(f"[{self.side} rank {self.rank}] {text}", file=sys.stderr)
            left = deadline - time.monotonic()
            if left <= 0:
                raise SystemExit(f"{self.side} rank {self.rank} did not answer within {WAIT_S:g}s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    code = self.proc.wait(10)
                    raise SystemExit(f"{self.side} rank {self.rank} exited with {code}")
                self._buf += chunk


def _no_samples() -> dict:
    """One side's samples of one case, as `session` returns them (see there)."""
    return {"blocks": [], "cpu": [], "sleeps": [], "phases": []}


def sides_for(case: tuple, sides: list) -> list:
    """The wire floor stands beside all_reduce only (its bytes are all_reduce's)."""
    return [side for side in sides if side != "wire" or case[0] == "all_reduce"]


def session(hosts, per_host: int, sides: list, cases: list, args) -> dict:
    """Start every side's ranks on the hosts; per case, alternate blocks between the sides.
    Returns case -> side -> a dict: `blocks`, the slowest rank's time of each iteration, block
    by block; `cpu`, every rank's CPU seconds per op summed, per block; `sleeps`, their
    voluntary context switches per op summed, per block; `phases`, the shoal
    side's two-level phases per op, one dict per rank and block."""
    world = len(hosts) * per_host
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    ranks = {}
    try:
        for i, side in enumerate(sides):
            ranks[side] = []
            for r in range(world):
                host = hosts[r // per_host]
                argv = [sys.executable, str(Path(__file__).resolve()), "--worker", side, str(r),
                        str(world), hosts[0].address, str(BASE_PORT + i), str(per_host)]
                proc = host.popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  env=dict(env, BENCH_HOST_ADDRESS=host.address))
                ranks[side].append(_Rank(proc, side, r))
        deadline = time.monotonic() + WAIT_S
        two_level = len(hosts) > 1 and per_host > 1
        for side in sides:
            for rk in ranks[side]:
                ready = rk.receive(deadline)
                if side == "shoal" and ready.get("hierarchical") != two_level:
                    raise SystemExit(f"shoal rank {rk.rank} reports hierarchical="
                                     f"{ready.get('hierarchical')} on {len(hosts)}x{per_host}; "
                                     f"expected {two_level}: the comparison would be void")
        blocks = args.blocks or (2 if args.quick else 4)
        results = {}
        for case in cases:
            per_block = max(1, iterations(case[1], args.quick) // blocks)
            here = sides_for(case, sides)
            results[case] = {side: _no_samples() for side in here}
            for block in range(blocks):
                for side in here[block % len(here):] + here[:block % len(here)]:
                    for rk in ranks[side]:
                        rk.send(op=case[0], bytes=case[1], count=per_block)
                    deadline = time.monotonic() + WAIT_S
                    answers = [rk.receive(deadline) for rk in ranks[side]]
                    by_rank = [a["times"] for a in answers]
                    slowest = [max(ts[i] for ts in by_rank) for i in range(per_block)]
                    got = results[case][side]
                    got["blocks"].append(slowest)
                    got["cpu"].append(sum(a["cpu"] for a in answers))
                    got["sleeps"].append(sum(a["sleeps"] for a in answers))
                    if answers[0].get("phases"):
                        got["phases"].extend(a["phases"] for a in answers)
        for side in sides:
            for rk in ranks[side]:
                rk.send(quit=True)
        for side in sides:
            for rk in ranks[side]:
                rk.proc.wait(60)
        return results
    finally:
        for side in ranks:
            for rk in ranks[side]:
                if rk.proc.poll() is None:
                    rk.proc.kill()


def _percentiles(ts: list) -> tuple[float, float]:
    """The 10th and 90th percentiles of `ts`."""
    if len(ts) < 2:
        return ts[0], ts[0]
    cuts = statistics.quantiles(ts, n=10, method="inclusive")
    return cuts[0], cuts[-1]


def _phase_summary(phases: list, per_host: int) -> dict:
    """Median over blocks of each phase, for leaders (local index 0) and the other ranks."""
    out = {}
    for who, picks in (("leader", lambda i: i % per_host == 0),
                       ("other", lambda i: i % per_host != 0)):
        chosen = [p for i, p in enumerate(phases) if picks(i)]
        if chosen:
            out[who] = {k: round(statistics.median(p[k] for p in chosen) * 1e3, 3)
                        for k in chosen[0]}
    return out


def main(args, cases: list) -> int:
    """Run the --hosts mode of bench/allreduce.py (its parsed `args` and `cases`)."""
    sys.path.insert(0, str(ROOT))
    from tests.support.netns import Hosts, netns_unavailable_reason

    reason = netns_unavailable_reason()
    if reason:
        print(f"bench/allreduce.py --hosts: {reason}", file=sys.stderr)
        return 2
    n_hosts, per_host = parse_hosts(args.hosts)
    world = n_hosts * per_host
    sides = (["shoal", "shoal_flat", "shoal_flat_tcp"] + (["gloo"] if args.compare else [])
             + (["wire"] if n_hosts > 1 else []))
    rounds = args.rounds or (1 if args.quick else 2)
    samples: dict = {}
    with Hosts(n_hosts, mtu=args.mtu, link_gbit=args.link_gbit) as hosts:
        for _ in range(rounds):
            for case, by_side in session(hosts.hosts, per_host, sides, cases, args).items():
                for side, got in by_side.items():
                    mine = samples.setdefault(case, {}).setdefault(side, _no_samples())
                    for key in mine:
                        mine[key].extend(got[key])
    cores = os.cpu_count() or 1
    rows = []
    for op, nbytes in cases:
        row = {"bench": "allreduce", "op": op, "hosts": n_hosts, "per_host": per_host,
               "world": world, "bytes": nbytes, "backend": "tcp", "cores": cores,
               "link_gbit": args.link_gbit, "mtu": args.mtu}
        here = sides_for((op, nbytes), sides)
        got = samples[(op, nbytes)]
        for side in here:
            ts = [t for block in got[side]["blocks"] for t in block]
            med = statistics.median(ts)
            p10, p90 = _percentiles(ts)
            row[f"{side}_ms"] = round(med * 1e3, 4)
            row[f"{side}_p10_p90_ms"] = [round(p10 * 1e3, 3), round(p90 * 1e3, 3)]
            row[f"{side}_busbw_gbps"] = round(nbytes / med * bus_factor(op, world) / 1e9, 3)
            row[f"{side}_cpu_ms"] = round(statistics.median(got[side]["cpu"]) * 1e3, 3)
            row[f"{side}_sleeps"] = round(statistics.median(got[side]["sleeps"]), 1)
        for other in here[1:]:
            key = f"shoal_vs_{other.replace('shoal_', '')}"
            row[key] = round(row[f"{other}_ms"] / row["shoal_ms"], 2)
            paired = [statistics.median(theirs) / statistics.median(ours)
                      for ours, theirs in zip(got["shoal"]["blocks"], got[other]["blocks"])]
            row[key + "_paired"] = round(statistics.median(paired), 2)
        if got["shoal"]["phases"]:
            row["shoal_phases_ms"] = _phase_summary(got["shoal"]["phases"], per_host)
        rows.append(row)
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    ratio_name = lambda other: "shoal/" + other.replace("shoal_", "")  # noqa: E731
    header = f"{'op':<11}{'hosts':>6} {'size':>7}" + "".join(
        f" | {side + ' ms':>14} {'busbw':>6}" for side in sides) + "".join(
        f" | {ratio_name(other):>11}" for other in sides[1:])
    link = (f"veth shaped to {args.link_gbit:g} Gbit/s each way" if args.link_gbit
            else "veth")
    print(f"\n{n_hosts} hosts x {per_host} ranks (network namespaces over {link}); median time "
          "per op (slowest rank), busbw in GB/s; ratios = their time / shoal's")
    if "wire" in sides:
        print("wire: only the bytes each host must send and receive in any all_reduce of "
              "per-host sums (2(H-1)/H x S each way), raw TCP, nothing else: a floor")
    print(header)
    print("-" * len(header))
    for row in rows:
        line = f"{row['op']:<11}{f'{n_hosts}x{per_host}':>6} {fmt_size(row['bytes']):>7}"
        line += "".join(f" | {row[side + '_ms']:>14.3f} {row[side + '_busbw_gbps']:>6.2f}"
                        if side + "_ms" in row else f" | {'-':>14} {'-':>6}" for side in sides)
        for other in sides[1:]:
            key = "shoal_vs_" + other.replace("shoal_", "")
            line += f" | {row[key]:>10.2f}x" if key in row else f" | {'-':>11}"
        print(line)
    print("spread (10th-90th percentile, ms) and paired ratios (median of per-block ratios):")
    for row in rows:
        here = sides_for((row["op"], row["bytes"]), sides)
        spread = ", ".join(f"{side} {row[side + '_p10_p90_ms'][0]:.3f}-"
                           f"{row[side + '_p10_p90_ms'][1]:.3f}" for side in here)
        paired = ", ".join(f"{ratio_name(o)} "
                           f"{row['shoal_vs_' + o.replace('shoal_', '') + '_paired']:.2f}x"
                           for o in here[1:])
        print(f"  {row['op']} {fmt_size(row['bytes'])}: {spread}; {paired}")
    print(f"where the time goes: CPU per op, all ranks' processes together (core-ms; this "
          f"machine has {cores} cores, so a side that needs X core-ms takes at least X/{cores} ms;"
          f" sleeps: the times per op that their threads waited in the kernel, all ranks "
          f"together, each a wake-up later)"
          + (", and the two-level phases of shoal's all_reduce per rank (wall ms: reduce = "
             "shared-memory reduce-scatter within the host, cross = the rings between hosts, "
             "share = shared-memory all-gather, which for the other ranks includes waiting for "
             "their leader's rings)" if any("shoal_phases_ms" in r for r in rows) else ""))
    for row in rows:
        here = sides_for((row["op"], row["bytes"]), sides)
        cpu = ", ".join(f"{side} {row[side + '_cpu_ms']:.1f} ({row[side + '_sleeps']:.1f} "
                        f"sleeps)" for side in here)
        phases = "".join(
            f"; {who} " + " ".join(f"{k} {v:.1f}" for k, v in p.items())
            for who, p in row.get("shoal_phases_ms", {}).items())
        print(f"  {row['op']} {fmt_size(row['bytes'])}: {cpu}{phases}")
    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--worker":
        side, rank, world, master, port, per_host = sys.argv[2:8]
        worker(side, int(rank), int(world), master, int(port), int(per_host))
    else:
        raise SystemExit("run it as `python bench/allreduce.py --hosts 2x2`")
