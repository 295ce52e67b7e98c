"""RPC latency and throughput: shoal's gRPC agent next to torch.distributed.rpc, same run.

Rows (two workers on one machine, loopback; worker 0 calls, worker 1 serves):
- sync_64B:        rpc_sync of a 64-byte payload to an identity function (median and p99)
- async_64B_x64:   rpc_async throughput with 64 calls in flight (calls per second)
- echo_16MiB:      rpc_sync echo of a 16 MiB float32 array (ms; GB/s = 2 x bytes / time)
- remote_to_here:  remote() of a 64-byte value plus to_here() (median)
- sync_64B_behind_16MiB: a 64-byte rpc_sync issued while another thread's 16 MiB echo is in
                   flight (head-of-line blocking; median and p99)

The peer is TensorPipe forced onto TCP (`_transports=["uv"], _channels=["basic"]`, PEERS.md)
with one thread per process. Sessions alternate shoal, torch, shoal, torch; each figure is the
median over sessions, and the spread (min..max over sessions) is printed beside it. Targets:
sync latency <= 0.65x TensorPipe's, async throughput >= 3x, 16 MiB echo >= 1.2x, and the small
call behind a bulk transfer under 2 ms.

    python bench/rpc.py               # shoal only
    python bench/rpc.py --compare     # with torch.distributed.rpc beside it
    python bench/rpc.py --quick       # fewer iterations and sessions
    python bench/rpc.py --fresh --sessions 8   # new processes per session (A/B of two trees)
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ.setdefault("TP_SOCKET_IFNAME", "lo")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
import secrets  # noqa: E402

import shoal  # noqa: E402
from shoal.collectives import settings as collective_settings  # noqa: E402
from shoal.core import settings as core_settings  # noqa: E402  (after the thread limits)

if not core_settings.AUTH_TOKEN.is_set():
    os.environ[core_settings.AUTH_TOKEN.name] = secrets.token_hex(16)  # the workers inherit it

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

CTX = multiprocessing.get_context("spawn")
MiB = 1024 * 1024
SMALL = b"x" * 64
BULK_BYTES = 16 * MiB


# ----------------------------------------------------------------------------- called remotely

def identity(x):
    return x


def make_value(n: int) -> bytes:
    return b"v" * n


# ----------------------------------------------------------------------------- one side

class _Side:
    """The same measurements over either implementation's API."""

    def __init__(self, impl: str):
        self.impl = impl
        if impl == "torch":
            import torch
            import torch.distributed.rpc as trpc

            torch.set_num_threads(1)
            self.rpc = trpc
            self.bulk = torch.zeros(BULK_BYTES // 4, dtype=torch.float32)
        else:
            from shoal import rpc_agent

            self.rpc = rpc_agent
            self.bulk = np.zeros(BULK_BYTES // 4, dtype=np.float32)

    def sync_latency(self, n: int) -> list[float]:
        rpc_sync = self.rpc.rpc_sync
        out = []
        for _ in range(n):
            t = time.perf_counter()
            rpc_sync("w1", identity, (SMALL,))
            out.append(time.perf_counter() - t)
        return out

    def async_throughput(self, n: int, inflight: int = 64) -> float:
        rpc_async = self.rpc.rpc_async
        queue = collections.deque()
        start = time.perf_counter()
        for _ in range(n):
            queue.append(rpc_async("w1", identity, (SMALL,)))
            if len(queue) >= inflight:
                queue.popleft().wait()
        while queue:
            queue.popleft().wait()
        return n / (time.perf_counter() - start)

    def echo(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            result = self.rpc.rpc_sync("w1", identity, (self.bulk,))
            out.append(time.perf_counter() - t)
            assert result.shape == self.bulk.shape
        return out

    def remote_to_here(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t = time.perf_counter()
            rref = self.rpc.remote("w1", make_value, (64,))
            rref.to_here()
            out.append(time.perf_counter() - t)
            del rref
        return out

    def behind_bulk(self, n: int) -> list[float]:
        """Small calls, each issued once a 16 MiB echo on another thread is under way."""
        out = []
        for _ in range(n):
            started = threading.Event()

            def bulk():
                started.set()
                self.rpc.rpc_sync("w1", identity, (self.bulk,))

            thread = threading.Thread(target=bulk)
            thread.start()
            started.wait()
            time.sleep(0.001)  # let the bulk call get onto the wire first
            t = time.perf_counter()
            self.rpc.rpc_sync("w1", identity, (SMALL,))
            out.append(time.perf_counter() - t)
            thread.join()
        return out


def _raw_echo_server(port_queue) -> None:
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    port_queue.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(np.empty(BULK_BYTES, np.uint8))
    try:
        while True:
            got = 0
            while got < BULK_BYTES:
                k = conn.recv_into(view[got:], BULK_BYTES - got, socket.MSG_WAITALL)
                if k == 0:
                    return
                got += k
            conn.sendall(view)
    except OSError:
        return


def raw_socket_echo(n: int) -> list[float]:
    """The loopback floor: the same 16 MiB echo over one plain TCP socket, no RPC at all."""
    import socket

    ports = CTX.Queue()
    server = CTX.Process(target=_raw_echo_server, args=(ports,), daemon=True)
    server.start()
    sock = socket.create_connection(("127.0.0.1", ports.get(timeout=60)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out_buf = np.zeros(BULK_BYTES, np.uint8)
    in_view = memoryview(np.empty(BULK_BYTES, np.uint8))
    times = []
    for _ in range(n):
        t = time.perf_counter()
        sock.sendall(out_buf)
        got = 0
        while got < BULK_BYTES:
            got += sock.recv_into(in_view[got:], BULK_BYTES - got, socket.MSG_WAITALL)
        times.append(time.perf_counter() - t)
    sock.close()
    server.join(10)
    return times


def _worker(impl: str, rank: int, env: dict, commands, results) -> None:
    os.environ.update(env)
    try:
        if impl == "torch":
            import torch.distributed.rpc as trpc

            opts = trpc.TensorPipeRpcBackendOptions(
                init_method="env://", _transports=["uv"], _channels=["basic"],
                num_worker_threads=16, rpc_timeout=120,
            )
            trpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
        else:
            from shoal import rpc_agent

            opts = rpc_agent.RpcBackendOptions(init_method="env://", rpc_timeout=120)
            rpc_agent.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
        side = _Side(impl)
        if rank == 0:
            while True:
                cmd = commands.get()
                if cmd is None:
                    break
                name, n = cmd
                results.put((name, getattr(side, name)(n)))
        if impl == "torch":
            side.rpc.shutdown()
        else:
            side.rpc.shutdown(timeout=3600)  # worker 1 waits there for the whole run
        results.put(("done", rank))
    except BaseException as exc:  # noqa: BLE001  (reported by the parent)
        import traceback

        results.put(("error", f"{impl} rank {rank}: {exc}\n{traceback.format_exc()}"))


class _Pair:
    """Two worker processes of one implementation, driven by commands."""

    def __init__(self, impl: str):
        self.impl = impl
        if impl == "torch":
            import torch.distributed as dist

            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            env = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
        else:
            from shoal.collectives.store.tcp import TCPStore

            self._store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            env = {collective_settings.USE_AGENT_STORE.name: "1"}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self._store.port), WORLD_SIZE="2")
        self.commands = CTX.Queue()
        self.results = CTX.Queue()
        self.procs = [
            CTX.Process(target=_worker, args=(impl, r, dict(env, RANK=str(r)), self.commands,
                                              self.results), daemon=True)
            for r in range(2)
        ]
        for p in self.procs:
            p.start()

    def run(self, name: str, n: int, timeout: float = 300.0):
        self.commands.put((name, n))
        tag, value = self.results.get(timeout=timeout)
        if tag == "error":
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        self.commands.put(None)
        for p in self.procs:
            p.join(60)
            if p.is_alive():
                p.kill()


# ----------------------------------------------------------------------------- report

def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# The targets: (row, what is compared, bound).
_TARGETS = {
    "sync_64B median": ("ratio", "<=", 0.65),
    "async_64B_x64": ("ratio", ">=", 3.0),
    "echo_16MiB": ("ratio", ">=", 1.2),
    "sync_64B_behind_16MiB median": ("value", "<", 2.0),
}


def _target_verdict(label: str, value: float, ratio) -> str:
    rule = _TARGETS.get(label)
    if rule is None:
        return ""
    what, op, bound = rule
    x = ratio if what == "ratio" else value
    if x is None:
        return ""
    ok = {"<=": x <= bound, ">=": x >= bound, "<": x < bound}[op]
    unit = "x" if what == "ratio" else " ms"
    return f"target {op} {bound:g}{unit}: {'met' if ok else 'missed'}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", action="store_true",
                        help="run torch.distributed.rpc (TensorPipe over TCP) beside shoal")
    parser.add_argument("--quick", action="store_true", help="fewer iterations and sessions")
    parser.add_argument("--sessions", type=int, default=None)
    parser.add_argument("--fresh", action="store_true",
                        help="new worker processes for every session: on a small shared machine "
                             "a pair's placement on the cores sets its latency for as long as it "
                             "lives, so one pair per run reads that placement, not the code")
    parser.add_argument("--rows", default="sync_latency,async_throughput,echo,remote_to_here,"
                        "behind_bulk", help="comma-separated subset of the measurements")
    args = parser.parse_args(argv)
    impls = ["shoal"]
    if args.compare:
        try:
            import torch.distributed.rpc  # noqa: F401

            impls.append("torch")
        except ImportError:
            print("torch is not installed: running shoal alone", file=sys.stderr)
    sessions = args.sessions or (2 if args.quick else 4)
    scale = 0.25 if args.quick else 1.0
    plan = [
        ("sync_latency", int(2000 * scale)),
        ("async_throughput", int(10000 * scale)),
        ("echo", max(5, int(20 * scale))),
        ("remote_to_here", int(1000 * scale)),
        ("behind_bulk", max(10, int(40 * scale))),
    ]
    wanted = set(args.rows.split(","))
    unknown = wanted - {name for name, _ in plan}
    if unknown:
        parser.error(f"unknown --rows {', '.join(sorted(unknown))}; the measurements are "
                     f"{', '.join(name for name, _ in plan)}")
    plan = [(name, n) for name, n in plan if name in wanted]

    def open_pairs() -> dict:
        made = {impl: _Pair(impl) for impl in impls}
        for impl in impls:  # warm-up: connections, caches, first-touch of the bulk arrays
            for name, n in plan:
                made[impl].run(name, max(3, n // 20))
        return made

    pairs = {} if args.fresh else open_pairs()
    raw: dict = {impl: collections.defaultdict(list) for impl in impls}
    loopback: list[float] = []
    try:
        for _ in range(sessions):
            if args.fresh:
                for pair in pairs.values():
                    pair.close()
                pairs = open_pairs()
            for name, n in plan:
                for impl in impls:  # A B A B within each row
                    raw[impl][name].append(pairs[impl].run(name, n))
                if name == "echo":
                    loopback.append(2 * BULK_BYTES / _pct(raw_socket_echo(n), 0.5) / 1e9)
    finally:
        for pair in pairs.values():
            pair.close()

    rows = []

    def latency_rows(key: str, metric: str, label: str):
        for stat, q in (("median", 0.5), ("p99", 0.99)):
            per = {impl: [_pct(s, q) * 1e3 for s in raw[impl][key]] for impl in impls}
            rows.append((f"{label} {stat}", "ms", per, "lower"))

    if "sync_latency" in wanted:
        latency_rows("sync_latency", "ms", "sync_64B")
    if "async_throughput" in wanted:
        rows.append(("async_64B_x64", "calls/s",
                     {impl: list(raw[impl]["async_throughput"]) for impl in impls}, "higher"))
    if "echo" in wanted:
        rows.append(("echo_16MiB", "GB/s",
                     {impl: [2 * BULK_BYTES / _pct(s, 0.5) / 1e9 for s in raw[impl]["echo"]]
                      for impl in impls}, "higher"))
    if "remote_to_here" in wanted:
        latency_rows("remote_to_here", "ms", "remote_to_here")
    if "behind_bulk" in wanted:
        latency_rows("behind_bulk", "ms", "sync_64B_behind_16MiB")

    header = (f"{'row':34} {'unit':8} {'shoal':>12} {'torch':>12} {'shoal/torch':>12}  "
              "spread (shoal; torch)")
    # The tree measured (an A/B run of two trees sets PYTHONPATH for each).
    print(f"shoal imported from {os.path.dirname(os.path.abspath(shoal.__file__))}")
    print(header)
    print("-" * len(header))
    lines = []
    for label, unit, per, better in rows:
        med = {impl: statistics.median(v) for impl, v in per.items()}
        ratio = med["shoal"] / med["torch"] if "torch" in med and med["torch"] else None
        spread = "; ".join(f"{min(v):.3g}..{max(v):.3g}" for v in per.values())
        target = _target_verdict(label, med["shoal"], ratio)
        print(f"{label:34} {unit:8} {med['shoal']:12.4g} "
              f"{med.get('torch', float('nan')):12.4g} "
              f"{(f'{ratio:.2f}x' if ratio else '-'):>12}  {spread}"
              + (f"  [{target}]" if target else ""))
        lines.append({
            "bench": "rpc", "row": label, "unit": unit, "better": better,
            "shoal": med["shoal"], "torch": med.get("torch"), "ratio": ratio,
            "target": target, "sessions": sessions, "shoal_sessions": per["shoal"],
            "torch_sessions": per.get("torch"),
        })
    if loopback:
        floor = statistics.median(loopback)
        print(f"{'(loopback floor: raw socket echo)':34} {'GB/s':8} {floor:12.4g}"
              f"{'':26}  {min(loopback):.3g}..{max(loopback):.3g}")
        lines.append({"bench": "rpc", "row": "raw_socket_echo_16MiB", "unit": "GB/s",
                      "better": "higher", "value": statistics.median(loopback),
                      "sessions": loopback})
    for line in lines:
        print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
