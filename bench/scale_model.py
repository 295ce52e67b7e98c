"""A cost model for all_reduce at thousands of ranks, fitted to measurements on this machine.

It measures each path's costs here, checks the model against bench/allreduce.py run in the
same invocation, and predicts the step overhead of examples/train_ddp.py (and of a model of
100M float32 parameters) on 8 x 8 up to 1000 x 8 hosts x ranks.

    python bench/scale_model.py            # full measurements and check, 3 rounds
    python bench/scale_model.py --quick    # fewer repetitions (about two minutes on 2 cores)
    python bench/scale_model.py --no-check # fits and predictions only
    python bench/scale_model.py --replay LOG...  # the check again from saved output
    chrt -f 10 python bench/scale_model.py --quick   # on a shared machine

Rounds: on a 2-core VM one calibration of a parameter moves by up to 4x between runs a minute
apart (shoal's step of shared memory 41-251 us, its work per message 0-52 us on 2026-11-28)
and one bench run of a configuration by up to 2x. So it calibrates and runs the check
--rounds times (default 3), takes every fitted parameter's median over the rounds as the model
(the predictions use that one model) and compares it with each configuration's median
measured time, printing the rounds' spread beside it; each round's line says how its own fit
alone fared. --replay recomputes the check from a saved run's JSON rows (`round_fit`,
`bench`), to try a change of the formulas on earlier measurements.

Measured (least squares on t = a + b x, each sample weighted by 1/t so that small and large
sizes count alike; every sample a median over repetitions):

  paths p: unix (Unix stream sockets: shoal's links between ranks of one host), tcp_lo (TCP on
           127.0.0.1), veth (TCP between two network namespaces joined by veth pairs and a
           bridge, tests/support/netns.py; needs root, tcp_lo's figures stand in without it).
           Sockets carry TCP_NODELAY and shoal's buffers: 256 KiB to send, 256 KiB to receive
           within a host, the kernel's autotuned receive buffer on veth (wire.tune_socket).
    a_p    one message's latency: the intercept of a ping-pong's one-way time over
           n = 64 B .. 64 KiB; twice, receivers sleeping in the kernel (a^block) and polling
           (a^spin). shoal polls small receives only when every rank has a core and the load
           leaves one spare (collectives.env.spin_seconds, the group's load check), as here.
    c_p    CPU per small message: the intercept of the sleeping ping-pong's process time per
           round trip (one send, one receive, one wake-up), on the driving end.
    o_p    per-message and
    beta_p per-byte CPU cost of one ring step: two processes each stream n-byte messages to
           the other while receiving the other's (what a rank of a ring does in one step):
           t_msg(n) = o_p + n beta_p over n = 16 KiB .. 4 MiB.
           Each end's CPU time (process_time) over its wall time is the link's `busy`
           fraction: ranks sharing cores slow a ring step by max(1, P busy / C), not P / C.
    veth   then its beta recalibrated from shoal's own ring: its all_reduce on 2 hosts x 1
           rank at 256 KiB .. 64 MiB (a configuration the check does not use),
           t - (S/2) g - 2 (a + sw + o) = S beta (o stays the stream's). The raw stream's
           Python sender thread measured up to 1.8x slower per byte than shoal's ring over
           the same veth. veth's `busy` then comes from the same rows: both ranks' CPU per op
           over 2 t (0.9-1.0 where the raw stream measured 0.73).
  memory, two processes at once (as in every run here):
    c, g   per byte of a copy into a memfd mapping and of a float32 numpy add into an
           accumulator; each inside the cache (arrays reused) and beyond it (a 64 MiB array
           walked through). An operation whose working set on one machine (2 x ranks x S)
           fits half the last-level cache uses the first (the other half is other work's and
           the bench's other sides'), else the second.
  shoal's own costs, from 2-rank shoal groups (configurations the check does not use):
    sw     its work per data message (headers, fingerprints, bookkeeping): its 4 KiB
           all_reduce on unix links less the raw exchange a^block + o + S (beta + g)
    b2, eta  its shared-memory all_reduce (shm.py) at 256 KiB, 4 MiB and 32 MiB fitted to
           t = m b2 + eta S (c + g): b2 per step (barrier and bookkeeping), eta how much
           slower than the microbenchmarks its copies and adds run
  C        cores. P busy processes on C cores slow every CPU-bound term by k = max(1, P/C).
           A ring step's latency is CPU-bound too: a message waits until its receiver gets
           a core (the direct exchange below waits one latency, not k).

Model, S bytes per rank, W = H x L ranks on H hosts of L ranks, SMALL = 64 KiB, a = a^block
or a^spin (above) plus sw for a message that carries data:

  direct exchange (S <= SMALL; every rank sends S to each peer, then reduces), peers over
  links p (L-1 over unix, W-L over the link between hosts):
      E = sum_peers (c_p + sw + S (beta_p + g))      (polling: o_p for c_p)
      D = max(max_p a_p + E, k E)
  with a_p here the bare a^block or a^spin (sw is in the sum). The messages leave at once, so
  their latencies overlap: with a core per rank the exchange waits one latency and does its
  messages' work; with more busy ranks than cores, the cores never idle waiting for a message
  in flight (another rank runs meanwhile), so it lasts as long as the cores take to do every
  rank's work, k E. (Until 2026-11-28 D was k sum_peers (a_p + sw + o_p + S (beta_p + g)),
  each latency in turn: it over-predicted the one-host 1x4 exchange by 19-79% in four runs;
  then max_p a_p + k E, which still over-predicted it by 27-46% in five runs that day, and the
  2x2 one by 25-33% in two: the ranks' CPU, 75 us per rank and op at 4x1, over 2 cores was
  the whole time, 0.15 of 0.16 ms. On those five runs' figures max(a + E, k E) took the check
  from 26 of 28 pooled to 28, and no run lost a case.) c is the sleeping ping-pong's CPU per
  round trip (a send, a receive, a wake-up; 19-28 us on the second VM of 2026-11-28), though
  a rank of a 4-rank exchange on 2 cores slept only 0.5-0.75 times per op (bench/allreduce.py
  --hosts prints sleeps): shoal's own per-call work, which the 2-rank calibration of sw does
  not isolate, fills the rest. A barrier (below) and recursive doubling's exchanges keep the
  older per-message charge: neither runs in the check here (the barrier uses the fitted
  shared-memory step, recursive doubling starts above 8 ranks).
  ring (S > SMALL): 2(W-1) steps of S/W bytes and W-1 reductions of S/W bytes; hop h's work
  in a step is u_h = a_h + o_h + (S/W) beta_h, and a step lasts
      step = max(max(1, k busy) x mean_h u_h [+ fill, P > C], max_h u_h, (S/W) n_share w)
      R = 2(W-1) step + k (W-1) (S/W) g
  (with P > C the cores must do every rank's work, k x the mean hop's; with a core each, the
  slowest hop decides; w is a shared wire's cost per byte, 1/B on a cluster's link, none
  between the unshaped namespaces here and 8/R x (MTU + 14)/(MTU - 52) on links shaped to R
  bit/s (the shaper counts whole frames), crossed by n_share rings at once.)
  fill = min(S/W, 512 KiB) x mean_h beta_h, with P > C only: a rank whose neighbour is
  descheduled hands on what its send buffer holds (the kernel's, twice shoal's 256 KiB
  SO_SNDBUF; between hosts the receiver's autotuned buffer may take more, so the figure is a
  choice from the code, not a derivation for every hop) and sleeps; the rest of its segment
  waits until the receiver runs, so a step moves min(S/W, buffer) once more, as a pipe's
  fill. Without it 4 MiB rings on shared cores (4x1, the 2x2 flat ring; 1 MiB steps) were
  under-predicted by 25-35% in most runs while 64 MiB fitted; with it, on 2026-11-28's four
  saved runs (--replay), 24 of 28 pooled became 26 and each run gained or held (21, 19, 18,
  25 -> 21, 20, 21, 26).
  flat ring: every rank in one ring over sockets: H hops between hosts (veth, or the
      cluster link) and H(L-1) within hosts (unix).
  shared memory on one host (S > SMALL; below, D over unix); a step's barrier with L-1
  peers b = k (b2 + (L-2) o_unix): the barrier is an empty direct exchange whose L-1
  messages leave at once, so their latencies overlap and each peer beyond the first adds only
  its message's work (b2, fitted with one peer, holds the latency; charging (L-1) b2
  over-predicted every 1x4 row of 256 KiB-4 MiB by 50-200% on 2026-11-27, and the overlapped
  barrier improved the check in each of that day's five runs, by 2-3 cases); c, g multiplied
  by eta; m = ceil(S / 4 MiB) (at L = 2 chunks of S/4 within 256 KiB .. 4 MiB):
      L = 2:   m b + k S (c + g)
      L >= 3:  (m + 1) b + k ((2S - S/L) c + (L-1)(S/L) g)
  hierarchical (H > 1, L > 1, S > SMALL; smaller: the flat direct exchange):
      (1) shared-memory reduce-scatter, rank i reduces segment i (S/L) from the L-1 peers:
              T1 = m b + k ((S - S/L) c + (L-1)(S/L) g)
      (2) k rings across hosts at once (k leaders per host: the host's cores per rank,
          1..L), ring i over the H ranks of local index i, each on S/k bytes, sharing the
          host's link (n_share = k), with only the H k leaders busy:  T2 = R(S/k, H, link)
      (3) shared-memory all-gather of the L segments (relay steps of S/(4L), 256 KiB..4 MiB):
              T3 = m' b + k S c
      L = 1 is the ring across hosts, H = 1 the one-host case.
      Where the group pipelines (two cores per rank; 8 MiB pieces, more than one):
          max(T1 + T3, T2) + (T1 + T2 + T3) / pieces, else T1 + T2 + T3.
  small messages above DIRECT_MAX_RANKS = 8 ranks: recursive doubling, log2(p) exchanges (+2
  folding beyond the power of two p); ranks go host by host, so the first log2(L) exchanges
  stay on the host (unix) and the rest cross the link. (A two-level tree, direct within the
  host, the leaders' tree and a fan-out, modelled slower at every scale below: 2(L-1)
  messages on the host against log2(L) exchanges.)
  bandwidth-optimal bound: 2 (W-1)/W x S / B.

The check runs bench/allreduce.py: its --hosts rows (hierarchical as shoal_ms, flat ring as
shoal_flat_ms) for 2x2, 4x1 and 1x4 over the software links, and 2x2 at 4 and 64 MiB over
links shaped to 5 Gbit/s each way (--link-gbit: the wire term, which decides the cluster
predictions below and which the unshaped links never reach); without the --hosts mode, its
--worlds rows (shoal_ms: one host's shared memory and unix links; shoal_tcp_ms: the ring on
loopback TCP). Every rank of every namespace runs on this machine's C cores, so there
k = max(1, W/C). Other work's runnable tasks (B, sampled from /proc while each part runs) are
printed beside the figures: with B above 1 or 2 on this 2-core machine every figure moves, and
the model, which counts only our ranks, does not follow. (B counts every thread of ours as
ours: until 2026-11-28 a process's state was read from its main thread only, so ranks working
in other threads, and the sampler's own thread, were counted as other work, B 4-7 where it was
0.2-1.6.)

The predictions assume a cluster with a core per rank (k = 1), a link of 25 Gbit/s with 10 us
latency (a = 10 us, w = 8 / 25e9 s per byte; o, beta and sw as measured here: a host's TCP
stack costs CPU like this machine's), and within a host shared memory and unix sockets at the
rates measured here. A DDP step's overhead is the all_reduce of each gradient bucket in turn
(shoal's DDP: a first bucket of 1 MiB, then 25 MiB), none of it hidden behind backward: an
upper bound.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import ipaddress  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import mmap  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional, Sequence  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KiB = 1024
MiB = 1024 * KiB
# Mirrors of collectives.constants (read, not imported, so the model states what it assumes).
SMALL_MAX_BYTES = 64 * KiB  # direct exchange up to here
DIRECT_MAX_RANKS = 8  # collectives.constants: above this many ranks small all_reduces run as a tree
SHM_CHUNK_BYTES = 4 * MiB  # SHM_SLOT_BYTES
PIPELINE_PIECE_BYTES = 8 * MiB  # collectives.constants: the two-level pipeline's pieces
SHM_W2_MIN_CHUNK_BYTES = 256 * KiB
SHM_CALIBRATION_SIZES = (256 * KiB, 4 * MiB, 32 * MiB)
SOCKET_BUFFER_BYTES = 256 * KiB
RING_FILL_BYTES = 2 * SOCKET_BUFFER_BYTES  # a send buffer as the kernel sizes it (twice SO_SNDBUF)
SHAPED_LINK_GBIT = 5.0  # the check's shaped links: far below what the CPUs copy over veth here
FIRST_BUCKET_BYTES = 1 * MiB  # shoal's DDP, as torch's
BUCKET_BYTES = 25 * MiB
PEER_TIMEOUT_S = 60.0
CALIBRATION_BYTES = 4 * KiB  # shoal's own per-message work is measured at this size

PINGPONG_SIZES = (64, 1 * KiB, 4 * KiB, 16 * KiB, 64 * KiB)
STREAM_SIZES = (16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
MEMORY_SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
MEMORY_WALK_BYTES = 64 * MiB  # far beyond any last-level cache here

_COMMAND = struct.Struct("!BQQ")  # mode, message bytes, message count
_PINGPONG, _PINGPONG_SPIN, _EXCHANGE, _QUIT = 0, 1, 2, 3


# ----------------------------------------------------------------------------- fitting

def fit_line(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of t = a + b x by least squares on relative errors (weights 1/t).

    Plain least squares would let the largest sizes decide alone; weighting by 1/t fits the
    small sizes (where the intercept shows) as closely as the large ones.
    """
    if len(xs) != len(ts) or len(xs) < 2:
        raise ValueError(f"fit_line needs two or more (x, t) pairs, got {len(xs)} and {len(ts)}")
    x = np.asarray(xs, dtype=float)
    t = np.asarray(ts, dtype=float)
    if np.any(t <= 0):
        raise ValueError("fit_line needs positive times")
    w = 1.0 / t
    design = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(design, t * w, rcond=None)
    return float(a), float(b)


def contention(procs: int, cores: int) -> float:
    """How much P busy processes on C cores slow a CPU-bound phase: max(1, P/C)."""
    return max(1.0, procs / cores)


@dataclasses.dataclass(frozen=True)
class Link:
    """One path's costs in seconds: latency sleeping and polling, per message, per byte of
    CPU work, and per byte of a wire shared by all rings that cross it (0: no wire limit)."""

    a_block: float
    a_spin: float
    o: float
    beta: float
    wire: float = 0.0
    sw: float = 0.0  # shoal's own work per message (headers, checks, bookkeeping)
    # The fraction of a core one end of a streaming exchange keeps busy: ranks sharing cores
    # slow each other by P x busy / C, not P / C (measured with process_time).
    busy: float = 1.0
    # CPU one end spends per small message it sends and receives when it sleeps between them
    # (a send, a receive and a wake-up: the ping-pong's process time per round trip); None in
    # fits saved before it was measured.
    c_msg: Optional[float] = None

    def latency(self, spin: bool, data: bool = True) -> float:
        """A message's cost before its bytes: its latency, and shoal's work on a data message
        (a barrier's headers measured as cheap as the raw exchange)."""
        # Polling gives up and sleeps after a while (SPIN_S): never slower than sleeping.
        wait = min(self.a_spin, self.a_block) if spin else self.a_block
        return wait + (self.sw if data else 0.0)


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-byte costs of a copy (c) and of a float32 add (g), inside the cache and beyond."""

    c_cache: float
    c_mem: float
    g_cache: float
    g_mem: float
    llc_bytes: int

    def rates(self, working_set: float) -> tuple[float, float]:
        """(c, g) for an operation touching `working_set` bytes on one host: cache rates while
        it fits in half the last-level cache (the other half is other work's and the peer
        side's of the bench, which alternates with ours), memory rates beyond."""
        if working_set <= self.llc_bytes / 2:
            return self.c_cache, self.g_cache
        return self.c_mem, self.g_mem


@dataclasses.dataclass(frozen=True)
class ShmCost:
    """shoal's shared-memory path as fitted from its 2-rank all_reduce: a step's barrier and
    bookkeeping per peer (None: a raw unix exchange of headers), and how much slower than the
    copy and add microbenchmarks its per-byte work runs."""

    step: Optional[float] = None
    eta: float = 1.0


@dataclasses.dataclass(frozen=True)
class Machine:
    """Where the ranks run: `cores` per host (None: a core per rank) and whether every rank
    of every host shares this one machine's cores (the namespaces here)."""

    cores: Optional[int]
    one_machine: bool

    def k(self, hosts: int, local: int) -> float:
        if self.cores is None:
            return 1.0
        procs = hosts * local if self.one_machine else local
        return contention(procs, self.cores)

    def k_busy(self, procs_here: int, procs_per_host: int) -> float:
        """Contention when only some ranks work (the leaders of a cross-host phase):
        `procs_here` of them on this machine's cores, `procs_per_host` per cluster host."""
        if self.cores is None:
            return 1.0
        procs = procs_here if self.one_machine else procs_per_host
        return contention(procs, self.cores)

    def leaders(self, hosts: int, local: int) -> int:
        """Leaders per host, as the tcp group picks them: the host's cores per local rank,
        between 1 and the ranks per host (a core per rank: every rank leads)."""
        if self.cores is None:
            return local
        per_host = self.cores  # the namespaces here share this machine's cores
        return max(1, min(local, per_host // max(1, local)))

    def pipelined(self, local: int) -> bool:
        """Whether the group pipelines its two-level all_reduce: two cores per local rank."""
        return self.cores is None or self.cores >= 2 * local

    def spin(self, world: int) -> bool:
        # collectives.env.spin_seconds: poll only when every rank of the group has a core
        # (and the tcp group's load check: while the load, its own ranks' included, stays
        # under 1.5 C, which our ranks alone keep here).
        if self.cores is None:
            return True
        return world <= self.cores


class LoadSampler:
    """The average number of runnable tasks that are not this process or its descendants,
    sampled ten times a second while in use (`with LoadSampler() as s: ...; s.background`).

    The machine is shared: other work's runnable tasks take cores from ours just as our own
    ranks do. The model counts only our ranks, so B is printed beside the figures to say how
    far a run can be trusted, not used."""

    INTERVAL_S = 0.1

    def __init__(self):
        self._samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5.0)

    @property
    def background(self) -> float:
        # Not clipped sample by sample: the count of runnable tasks and our tasks' states are
        # read a moment apart, so a sample errs either way; the mean does not drift up.
        return max(0.0, statistics.fmean(self._samples)) if self._samples else 0.0

    def _run(self) -> None:
        while not self._stop.wait(self.INTERVAL_S):
            try:
                self._samples.append(self.sample())
            except OSError:
                pass

    @staticmethod
    def sample() -> int:
        """Runnable tasks now (/proc/loadavg) less ours: the threads in state R of this process
        (the sampler's own thread among them) and of its descendants."""
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
        children: dict[int, list[int]] = {}
        for entry in os.scandir("/proc"):
            fields = _stat_fields(f"/proc/{entry.name}/stat") if entry.name.isdigit() else None
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
        ours, todo = 0, [os.getpid()]
        while todo:
            pid = todo.pop()
            ours += _runnable_threads(pid)
            todo.extend(children.get(pid, ()))
        return running - ours


def _stat_fields(path: str) -> Optional[list[str]]:
    """The fields of a /proc stat file after the command name (state first, then the parent),
    or None once the process or thread is gone."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _runnable_threads(pid: int) -> int:
    """Threads of `pid` in state R (a process's own state is only its main thread's)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0
    states = (_stat_fields(f"/proc/{pid}/task/{tid}/stat") for tid in tasks)
    return sum(1 for fields in states if fields is not None and fields[0] == "R")


@dataclasses.dataclass(frozen=True)
class Model:
    """The formulas of the module docstring over fitted parameters."""

    links: dict  # name -> Link: unix, tcp_lo, veth (and "cluster" for predictions)
    memory: Memory
    shm: ShmCost = ShmCost()

    def _shm_rates(self, working_set: float) -> tuple[float, float]:
        c, g = self.memory.rates(working_set)
        return c * self.shm.eta, g * self.shm.eta

    @staticmethod
    def _weighted(links) -> list[tuple[Link, float]]:
        """[(link, how many)] from links given alone (one each) or as (link, count) pairs."""
        return [item if isinstance(item, tuple) else (item, 1.0) for item in links]

    def direct(self, nbytes, peers, k, spin, g) -> float:
        """Direct exchange: a message to and from each peer; `peers` are (link, how many peers
        over it). Every message leaves at once, so the exchange waits one latency (the slowest
        link's) and does every message's work: its CPU (a send, a receive, a wake-up from
        sleep, or the streaming cost `o` when receivers poll), shoal's own work and the bytes;
        or, with more ranks than cores (k > 1), as long as the cores take to do every rank's
        work, k times that, when longer: a core never idles waiting while another rank can
        run. (Fits without `c_msg`: each message's latency in turn, as before.)"""
        links = self._weighted(peers)
        if any(h.c_msg is None for h, _ in links):
            return k * sum(n * (h.latency(spin) + h.o + nbytes * (h.beta + g)) for h, n in links)
        wait = max(h.latency(spin, data=False) for h, _ in links)
        work = sum(n * ((h.o if spin else h.c_msg) + h.sw + nbytes * (h.beta + g))
                   for h, n in links)
        return max(wait + work, k * work)

    def ring(self, nbytes, world, hops, k, spin, g, share: int = 1, peers=None) -> float:
        """A ring (the direct exchange with `peers` for small messages) over `hops`, (link,
        how many hops of the ring use it); `share` rings cross each wire at once.

        A step lasts as long as its slowest hop, or, when P > C, as long as the cores take to
        do every rank's share of the step's work (k times the mean hop's work)."""
        if world <= 1 or nbytes <= 0:
            return 0.0
        hops = self._weighted(hops)
        if nbytes <= SMALL_MAX_BYTES:
            total = sum(n for _, n in hops)
            return self.direct(nbytes, peers or [(h, (world - 1) * n / total) for h, n in hops],
                               k, spin, g)
        seg = nbytes / world
        work = [(h.latency(spin) + h.o + seg * h.beta, n) for h, n in hops]
        total = sum(n for _, n in work)
        mean = sum(w * n for w, n in work) / total
        busy = sum(h.busy * n for h, n in hops) / total
        wire = max(seg * share * h.wire for h, _ in hops)
        cores = max(1.0, k * busy) * mean
        if k > 1:
            # Ranks sharing cores: a rank's neighbour is often descheduled, so it can hand on
            # only what its send buffer holds before it sleeps, and the rest of its segment
            # waits for the scheduler to run the receiver: the step pays for moving
            # min(S/W, send buffer) once more, the pipe's fill (module docstring).
            cores += min(seg, RING_FILL_BYTES) * sum(h.beta * n for h, n in hops) / total
        step = max(cores, max(w for w, _ in work), wire)
        return 2 * (world - 1) * step + k * (world - 1) * seg * g

    def recursive_doubling(self, nbytes, world, link: Link, k, spin, g,
                           local: int = 1, intra: Optional[Link] = None) -> float:
        """shoal's small all_reduce above DIRECT_MAX_RANKS ranks: log2(p) exchanges of S with
        one peer (p the largest power of two <= W), plus a fold in and out beyond p. Ranks go
        host by host, so the exchanges with a partner closer than `local` ranks stay on the
        host (over `intra`) and the others cross `link`."""
        p = 1 << (int(world).bit_length() - 1)

        def one(h: Link) -> float:
            return max(k * (h.latency(spin) + h.o + nbytes * (h.beta + g)), nbytes * h.wire)

        total, mask = 0.0, 1
        while mask < p:
            total += one(intra if intra is not None and mask < local else link)
            mask <<= 1
        if world != p:
            total += 2 * one(link)
        return total

    def _barrier(self, local, k, spin) -> float:
        """A shared-memory step's barrier among `local` ranks: an empty direct exchange, its
        messages' latencies overlapped (module docstring)."""
        unix = self.links["unix"]
        if self.shm.step is not None:
            return k * (self.shm.step + (local - 2) * unix.o)
        return k * (unix.latency(spin, data=False) + (local - 1) * unix.o)

    def one_host(self, nbytes, local, machine: Machine, hosts_here: int = 1) -> float:
        """shoal's same-host all_reduce of `local` ranks: direct over unix for small messages,
        else shared memory (shm.py)."""
        if local <= 1:
            return 0.0
        k, spin = machine.k(hosts_here, local), machine.spin(local * hosts_here)
        if nbytes <= SMALL_MAX_BYTES:
            g = self.memory.rates(2 * local * nbytes)[1]
            return self.direct(nbytes, [(self.links["unix"], local - 1)], k, spin, g)
        c, g = self._shm_rates(2 * local * nbytes)
        b = self._barrier(local, k, spin)
        if local == 2:
            chunk = min(SHM_CHUNK_BYTES, max(SHM_W2_MIN_CHUNK_BYTES, nbytes // 4))
            return math.ceil(nbytes / chunk) * b + k * nbytes * (c + g)
        m = math.ceil(nbytes / SHM_CHUNK_BYTES)
        return (m + 1) * b + k * ((2 * nbytes - nbytes / local) * c
                                  + (local - 1) * nbytes / local * g)

    def hierarchical(self, nbytes, hosts, local, link: Link, intra: Link,
                     machine: Machine) -> float:
        """T1 + T2 + T3 of the module docstring, with the group's leaders per host (k) and,
        where it pipelines, the phases overlapped; small messages: the flat direct exchange,
        or above DIRECT_MAX_RANKS ranks the two-level tree."""
        if hosts <= 1:
            return self.one_host(nbytes, local, machine)
        if local <= 1:
            return self.flat(nbytes, hosts, local, link, intra, machine)
        if nbytes <= SMALL_MAX_BYTES:
            return self.flat(nbytes, hosts, local, link, intra, machine)
        k, spin = machine.k(hosts, local), machine.spin(hosts * local)
        leaders = machine.leaders(hosts, local)
        working_set = 2 * local * nbytes * (hosts if machine.one_machine else 1)
        c, g = self._shm_rates(working_set)
        b = self._barrier(local, k, spin)
        seg = nbytes / leaders
        # (1) every rank publishes the other owners' segments; an owner reduces its segment
        # from the L-1 peers' regions (its work is the longest).
        t1 = (math.ceil(nbytes / SHM_CHUNK_BYTES) * b
              + k * ((nbytes - seg) * c + (local - 1) * seg * g))
        # (2) k rings at once, each over the H leaders of one local index; only the leaders
        # work, so the contention counts them alone.
        k2 = machine.k_busy(hosts * leaders, leaders)
        t2 = self.ring(seg, hosts, [link], k2, spin, self.memory.rates(working_set)[1],
                       share=leaders)
        # (3) every rank copies the owners' segments out of their regions.
        relay = min(SHM_CHUNK_BYTES, max(SHM_W2_MIN_CHUNK_BYTES, seg // 4))
        t3 = math.ceil(seg / relay) * b + k * nbytes * c
        pieces = math.ceil(nbytes / PIPELINE_PIECE_BYTES)
        if machine.pipelined(local) and pieces > 1:
            # The courier carries piece j while the host works on j+1 and j-1: the longer of
            # the two streams decides, plus one piece of each to fill and drain the pipe.
            return max(t1 + t3, t2) + (t1 + t2 + t3) / pieces
        return t1 + t2 + t3

    def flat(self, nbytes, hosts, local, link: Link, intra: Link, machine: Machine) -> float:
        """Every rank in one ring over sockets (direct exchange for small messages): hops
        between hosts over `link`, within one over `intra`; one host runs its own path."""
        if hosts <= 1:
            return self.one_host(nbytes, local, machine)
        k, spin = machine.k(hosts, local), machine.spin(hosts * local)
        _, g = self.memory.rates(2 * local * nbytes * (hosts if machine.one_machine else 1))
        # Ranks in host order: H hops of the ring cross hosts, H (L-1) stay within one; each
        # rank has L-1 peers on its host and W-L elsewhere for the direct exchange.
        world = hosts * local
        if nbytes <= SMALL_MAX_BYTES and world > DIRECT_MAX_RANKS:
            return self.recursive_doubling(nbytes, world, link, k, spin, g, local, intra)
        hops = [(link, hosts)] + ([(intra, hosts * (local - 1))] if local > 1 else [])
        peers = [(link, world - local)] + ([(intra, local - 1)] if local > 1 else [])
        return self.ring(nbytes, world, hops, k, spin, g, peers=peers)


def bucket_sizes(nbytes: int) -> list[int]:
    """shoal DDP's gradient buckets for `nbytes` of gradients: 1 MiB first, then 25 MiB."""
    out, left, cap = [], nbytes, FIRST_BUCKET_BYTES
    while left > 0:
        out.append(min(left, cap))
        left -= out[-1]
        cap = BUCKET_BYTES
    return out


def bandwidth_bound(nbytes: float, world: int, bandwidth: float) -> float:
    """The bandwidth-optimal all_reduce time 2 (W-1)/W x S / B (seconds; B in bytes/s)."""
    return 2 * (world - 1) / world * nbytes / bandwidth if world > 1 else 0.0


# ----------------------------------------------------------------------------- peer processes

def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        got += n


def _recv_polling(sock: socket.socket, view: memoryview) -> None:
    """As `_recv_exact`, polling a non-blocking socket (shoal's spinning receive)."""
    got = 0
    sock.setblocking(False)
    try:
        while got < len(view):
            try:
                n = sock.recv_into(view[got:])
            except BlockingIOError:
                continue
            if n == 0:
                raise ConnectionError("the peer closed the connection")
            got += n
    finally:
        sock.settimeout(PEER_TIMEOUT_S)


def _send_stream(sock: socket.socket, payload: memoryview, count: int) -> None:
    for _ in range(count):
        sock.sendall(payload)


def _exchange(sock: socket.socket, out: memoryview, into: memoryview, count: int) -> None:
    """Send `count` messages while receiving as many (a sender thread; the socket buffers
    could not hold a whole message otherwise)."""
    sender = threading.Thread(target=_send_stream, args=(sock, out, count))
    sender.start()
    for _ in range(count):
        _recv_exact(sock, into)
    sender.join()


def _serve(sock: socket.socket) -> None:
    """The passive end: echo ping-pongs, mirror exchanges, until told to quit."""
    head = bytearray(_COMMAND.size)
    buf = bytearray(4 * MiB)
    out = bytearray(4 * MiB)
    while True:
        _recv_exact(sock, memoryview(head))
        mode, n, count = _COMMAND.unpack(head)
        view = memoryview(buf)[:n]
        if mode == _QUIT:
            return
        if mode in (_PINGPONG, _PINGPONG_SPIN):
            receive = _recv_polling if mode == _PINGPONG_SPIN else _recv_exact
            for _ in range(count):
                receive(sock, view)
                sock.sendall(view)
        else:
            _exchange(sock, memoryview(out)[:n], view, count)
            sock.sendall(b"k")


def _drive(sock: socket.socket, reps: int) -> dict:
    """The active end: ping-pongs (sleeping, polling) and exchanges at every size."""
    buf = bytearray(4 * MiB)
    out = bytearray(4 * MiB)
    result = {"pingpong": {}, "pingpong_spin": {}, "pingpong_cpu": {}, "stream": {},
              "stream_cpu": {}}
    for mode, key, receive in ((_PINGPONG, "pingpong", _recv_exact),
                               (_PINGPONG_SPIN, "pingpong_spin", _recv_polling)):
        for n in PINGPONG_SIZES:
            count = 200 if n <= 4 * KiB else 60
            view = memoryview(buf)[:n]
            times, cpu = [], []
            for _ in range(reps):
                sock.sendall(_COMMAND.pack(mode, n, count))
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(count):
                    sock.sendall(view)
                    receive(sock, view)
                times.append((time.perf_counter() - t0) / count / 2)  # one way
                cpu.append((time.process_time() - c0) / count)
            result[key][n] = statistics.median(times)
            if mode == _PINGPONG:
                # This end's CPU per round trip: a send, a receive and a wake-up from sleep.
                result["pingpong_cpu"][n] = statistics.median(cpu)
    for n in STREAM_SIZES:
        count = max(4, (16 * MiB) // n)
        times, cpu = [], []
        for _ in range(reps):
            sock.sendall(_COMMAND.pack(_EXCHANGE, n, count))
            t0, c0 = time.perf_counter(), time.process_time()
            _exchange(sock, memoryview(out)[:n], memoryview(buf)[:n], count)
            _recv_exact(sock, memoryview(bytearray(1)))
            times.append((time.perf_counter() - t0) / count)
            cpu.append((time.process_time() - c0) / count)
        result["stream"][n] = statistics.median(times)
        # CPU time of this end (both its threads): how busy a rank of a ring step keeps its
        # core, which decides how ranks that share cores slow each other.
        result["stream_cpu"][n] = statistics.median(cpu)
    sock.sendall(_COMMAND.pack(_QUIT, 0, 0))
    return result


def _tune(sock: socket.socket) -> None:
    """shoal's link settings (collectives/backends/tcp/wire.py `tune_socket`): a fixed send
    buffer; a fixed receive buffer within a host (Unix sockets, loopback), the kernel's
    autotuned one on a link to another host (here: another network namespace)."""
    sock.settimeout(PEER_TIMEOUT_S)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
    inet = sock.family in (socket.AF_INET, socket.AF_INET6)
    if not inet or ipaddress.ip_address(sock.getpeername()[0]).is_loopback:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
    if inet:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _memory_pair(reps: int) -> dict:
    """Copy and add rates with two processes at once (this one and a fork), each copying into
    its own memfd mapping and adding float32 arrays: in cache (arrays reused) and beyond it
    (a MEMORY_WALK_BYTES array walked through n bytes at a time)."""
    walk = MEMORY_WALK_BYTES
    a, b = socket.socketpair()
    child = os.fork()
    sock = b if child == 0 else a
    sock.settimeout(PEER_TIMEOUT_S)
    fd = os.memfd_create("shoal-scale-model", os.MFD_CLOEXEC)
    os.ftruncate(fd, walk)
    region = np.frombuffer(mmap.mmap(fd, walk, flags=mmap.MAP_SHARED), dtype=np.uint8)
    src = np.ones(walk, dtype=np.uint8)
    acc = np.ones(walk // 4, dtype=np.float32)
    other = np.ones(walk // 4, dtype=np.float32)
    region[:] = 1  # fault every page in before timing
    one = bytearray(1)
    result = {}
    for kind in ("copy", "add"):
        for where in ("cache", "mem"):
            for n in MEMORY_SIZES:
                count = max(8, (64 * MiB) // n)
                offsets = [0] * count if where == "cache" else [
                    (i * n) % walk for i in range(count)]
                times = []
                for _ in range(reps):
                    sock.sendall(b"s")  # start together
                    sock.recv_into(one)
                    t0 = time.perf_counter()
                    if kind == "copy":
                        for off in offsets:
                            np.copyto(region[off:off + n], src[off:off + n])
                    else:
                        for off in offsets:
                            lo, hi = off // 4, (off + n) // 4
                            np.add(acc[lo:hi], other[lo:hi], out=acc[lo:hi])
                    times.append((time.perf_counter() - t0) / count)
                result[f"{kind}_{where}_{n}"] = statistics.median(times)
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    return result


def _shoal_calls(rank: int, port: int, reps: int, transport: str) -> dict:
    """Median seconds of shoal's own calls in a 2-rank tcp group, receivers sleeping
    (SHOAL_SPIN_US=0), each call right after the last: on unix links a barrier (an exchange of
    headers) and a 4 KiB all_reduce (headers and data); on shared memory all_reduces of
    SHM_CALIBRATION_SIZES."""
    import shoal.collectives as dist

    group = dist.init_process_group("tcp", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=2, timeout=PEER_TIMEOUT_S)
    if transport == "unix":
        data = np.zeros(CALIBRATION_BYTES // 4, np.float32)
        calls = [("barrier", group.barrier, 100), ("all_reduce", lambda: group.all_reduce(data),
                                                   100)]
    else:
        calls = []
        for n in SHM_CALIBRATION_SIZES:
            arr = np.zeros(n // 4, np.float32)
            calls.append((f"shm_{n}", (lambda a: lambda: group.all_reduce(a))(arr),
                          max(2, (8 * MiB) // n)))
    result = {}
    for key, call, per_rep in calls:
        for _ in range(3):
            call()
        times = []
        for _ in range(reps * per_rep):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        result[key] = statistics.median(times)
    group.barrier()
    dist.destroy_process_group()
    return result


def _peer_main(argv: list[str]) -> int:
    """Hidden entry point for the processes of a measurement (`--peer ROLE ...`)."""
    role = argv[0]
    if role == "serve":  # serve FAMILY ADDRESS: print where it listens, serve one client
        family, address = argv[1], argv[2]
        if family == "unix":
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind("\0" + address)
        else:
            listener = socket.create_server((address, 0))
        listener.settimeout(PEER_TIMEOUT_S)
        listener.listen(1)
        print(address if family == "unix" else listener.getsockname()[1], flush=True)
        conn, _ = listener.accept()
        _tune(conn)
        _serve(conn)
        return 0
    if role == "drive":  # drive FAMILY ADDRESS PORT REPS: print the timings as JSON
        family, address, port, reps = argv[1], argv[2], argv[3], int(argv[4])
        if family == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(PEER_TIMEOUT_S)
            sock.connect("\0" + address)
        else:
            sock = socket.create_connection((address, int(port)), timeout=PEER_TIMEOUT_S)
        _tune(sock)
        print(json.dumps(_drive(sock, reps)), flush=True)
        return 0
    if role == "shoal-calls":  # shoal-calls RANK PORT REPS TRANSPORT: rank 0 prints JSON
        rank, port, reps = int(argv[1]), int(argv[2]), int(argv[3])
        print(json.dumps(_shoal_calls(rank, port, reps, argv[4])), flush=True)
        return 0
    if role == "memory":  # memory REPS
        print(json.dumps(_memory_pair(int(argv[1]))), flush=True)
        return 0
    raise SystemExit(f"unknown peer role {role!r}")


# ----------------------------------------------------------------------------- measuring

def _peer_argv() -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--peer"]


def _last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def _run_pair(serve_prefix: list, drive_prefix: list, family: str, address: str,
              reps: int) -> dict:
    """Start a serving peer, then a driving one; return the driver's timings."""
    name = address if family != "unix" else f"shoal-scale-{uuid.uuid4().hex[:8]}"
    server = subprocess.Popen(serve_prefix + _peer_argv() + ["serve", family, name],
                              stdout=subprocess.PIPE, text=True)
    try:
        where = server.stdout.readline().strip()  # bounded: the peer's accept times out
        if not where:
            raise RuntimeError(f"the {family} peer did not start")
        port = where if family != "unix" else "0"
        done = subprocess.run(drive_prefix + _peer_argv() + ["drive", family, name, port,
                                                             str(reps)],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"the {family} measurement failed: {done.stderr[-2000:]}")
        server.wait(30)
        return {kind: {int(n): t for n, t in by_size.items()}
                for kind, by_size in _last_json(done.stdout).items()}
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)


def _run_shoal_calls(reps: int, transport: str) -> dict:
    """Both ranks of `_shoal_calls`, as subprocesses; rank 0's timings."""
    with socket.socket() as probe:  # a free port for rank 0's store
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, SHOAL_LOCAL_TRANSPORT=transport, SHOAL_SPIN_US="0",
               PYTHONPATH=str(ROOT))
    env.setdefault("SHOAL_AUTH_TOKEN", uuid.uuid4().hex)
    procs = [subprocess.Popen(_peer_argv() + ["shoal-calls", str(r), str(port), str(reps),
                                              transport],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    if any(p.returncode for p in procs):
        raise RuntimeError("the shoal calls measurement failed: "
                           + " | ".join(err[-1500:] for _, err in outs))
    return _last_json(outs[0][0])


def fit_link(timings: dict) -> Link:
    """Latencies from the ping-pongs' intercepts, (o, beta) from the exchange stream."""
    a_block = fit_line(list(timings["pingpong"]), list(timings["pingpong"].values()))[0]
    a_spin = fit_line(list(timings["pingpong_spin"]), list(timings["pingpong_spin"].values()))[0]
    o, beta = fit_line(list(timings["stream"]), list(timings["stream"].values()))
    c_msg = None
    if timings.get("pingpong_cpu"):
        c_msg = max(0.0, fit_line(list(timings["pingpong_cpu"]),
                                  list(timings["pingpong_cpu"].values()))[0])
    busy = 1.0
    cpu = timings.get("stream_cpu")
    if cpu:
        big = [n for n in cpu if n >= 256 * KiB]
        if big:
            busy = statistics.median(cpu[n] / timings["stream"][n] for n in big)
    return Link(max(a_block, 0.0), max(a_spin, 0.0), max(o, 0.0), beta,
                busy=min(1.0, max(0.25, busy)), c_msg=c_msg)


def fit_memory(raw: dict, llc_bytes: int) -> Memory:
    slopes = {}
    for kind in ("copy", "add"):
        for where in ("cache", "mem"):
            ts = [raw[f"{kind}_{where}_{n}"] for n in MEMORY_SIZES]
            slopes[kind, where] = fit_line(MEMORY_SIZES, ts)[1]
    return Memory(slopes["copy", "cache"], slopes["copy", "mem"], slopes["add", "cache"],
                  slopes["add", "mem"], llc_bytes)


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size (32 MiB when sysfs does not say)."""
    best = 0
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    for index in base.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": KiB, "M": MiB}.get(text[-1:], 1)
        best = max(best, int(text.rstrip("KM")) * scale)
    return best or 32 * MiB


def _veth_hosts():
    """Two network-namespace hosts, or (None, why not)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    try:
        from tests.support.netns import Hosts, netns_unavailable_reason
    except ImportError as exc:
        return None, f"tests.support.netns is not importable ({exc})"
    reason = netns_unavailable_reason()
    if reason:
        return None, reason
    return Hosts(2), None


def measure(reps: int) -> dict:
    """Every calibration measurement, raw (JSON-able: `fit_model` turns it into the model, now
    or when a saved run is replayed), with other work's load during each."""
    raw, loads = {"llc_bytes": last_level_cache_bytes()}, {}
    for name, family, address in (("unix", "unix", ""), ("tcp_lo", "tcp", "127.0.0.1")):
        with LoadSampler() as load:
            raw[name] = _run_pair([], [], family, address, reps)
        loads[name] = load.background
    made, reason = _veth_hosts()
    if made is None:
        print(f"veth: not measured ({reason}); tcp_lo's figures stand in for it")
    else:
        with made as hosts, LoadSampler() as load:
            raw["veth"] = _run_pair(hosts[0].command([]), hosts[1].command([]), "tcp",
                                    hosts[0].address, reps)
        loads["veth"] = load.background
    with LoadSampler() as load:
        done = subprocess.run(_peer_argv() + ["memory", str(reps)], capture_output=True,
                              text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"the memory measurement failed: {done.stderr[-2000:]}")
    raw["memory"] = _last_json(done.stdout)
    loads["memory"] = load.background
    with LoadSampler() as load:
        raw["shoal_calls"] = _run_shoal_calls(reps, "unix")
        raw["shoal_shm"] = _run_shoal_calls(reps, "shm")
    loads["shoal"] = load.background
    if made is not None and has_hosts_mode():
        with LoadSampler() as load:
            raw["veth_ring"] = _veth_ring_rows(reps)
        loads["veth_ring"] = load.background
    raw["background"] = loads
    return raw


def _int_keys(value):
    """`value` with every all-digit dict key turned back into an int (JSON made them str)."""
    if isinstance(value, dict):
        return {(int(k) if isinstance(k, str) and k.isdigit() else k): _int_keys(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_int_keys(v) for v in value]
    return value


def fit_model(raw: dict) -> Model:
    """The model from `measure`'s raw figures (fresh, or read back from a saved run)."""
    raw = _int_keys(raw)
    links = {name: fit_link(raw[name]) for name in ("unix", "tcp_lo")}
    links["veth"] = fit_link(raw["veth"]) if "veth" in raw else links["tcp_lo"]
    memory = fit_memory(raw["memory"], raw["llc_bytes"])
    # shoal's own work per data message: its 2-rank 4 KiB all_reduce (one message each way)
    # beyond what the raw unix exchange of that message and its reduction cost.
    unix = links["unix"]
    raw_exchange = (unix.a_block + unix.o
                    + CALIBRATION_BYTES * (unix.beta + memory.rates(4 * CALIBRATION_BYTES)[1]))
    sw = max(0.0, raw["shoal_calls"]["all_reduce"] - raw_exchange)
    links = {name: dataclasses.replace(link, sw=sw) for name, link in links.items()}
    if raw.get("veth_ring"):
        links["veth"] = fit_veth_ring(links["veth"], memory, raw["veth_ring"])
    shm = fit_shm({int(key[4:]): t for key, t in raw["shoal_shm"].items()}, memory)
    return Model(links, memory, shm)


def _veth_ring_rows(reps: int) -> list[dict]:
    """bench/allreduce.py's rows of shoal's all_reduce on 2 hosts x 1 rank, 256 KiB and up."""
    argv = ["--hosts", "2x1", "--json", "--no-compare", "--ops", "all_reduce",
            "--min-bytes", str(256 * KiB)] + (["--quick"] if reps < 9 else [])
    return [{key: row[key] for key in ("bytes", "shoal_ms", "shoal_cpu_ms") if key in row}
            for row in _allreduce_rows(argv, timeout=600)]


def fit_veth_ring(veth: Link, memory: "Memory", rows: list[dict]) -> Link:
    """veth's per-byte cost as shoal's own ring sees it: its all_reduce on 2 hosts x 1 rank (a
    configuration the check does not use) at 256 KiB, 4 MiB and 64 MiB.

    A raw two-process stream (`_drive`) moves bytes through Python's sender thread and the
    GIL; shoal's ring keeps its copies in C and overlaps them differently, and measured up to
    1.8x faster per byte here. With W = 2 a ring is two steps of S/2 and one reduction of
    S/2: t(S) - (S/2) g - 2 (a + sw + o) = S beta, beta fitted through the origin (relative
    errors, as `fit_line`). The per-message cost o stays the raw stream's, fitted over
    16 KiB-4 MiB: the ring's own intercept, three sizes from 256 KiB to 64 MiB, moved between
    0 and 92 us from round to round (2026-11-28) and with it every 256 KiB prediction."""
    fixed = 2 * (veth.a_block + veth.sw + veth.o)
    sizes, ts, busy = [], [], []
    for row in rows:
        if not row.get("shoal_ms"):
            continue
        n = row["bytes"]
        sizes.append(n)
        ts.append(row["shoal_ms"] / 1e3)
        if row.get("shoal_cpu_ms"):  # both ranks' CPU per op
            busy.append(row["shoal_cpu_ms"] / (2 * row["shoal_ms"]))
    if not sizes:
        return veth
    x = np.asarray(sizes, dtype=float)
    t = np.asarray(ts, dtype=float)
    y = t - fixed - (x / 2) * np.array([memory.rates(4 * n)[1] for n in sizes])
    w2 = 1.0 / t ** 2
    beta = float(np.sum(w2 * x * y) / np.sum(w2 * x * x))
    fitted = dataclasses.replace(veth, beta=max(beta, 0.0))
    # The per-byte cost being the ring's, so is its busy fraction: the ring kept each rank's
    # core 0.9-1.0 busy on 2026-11-28 where the raw stream kept 0.73.
    if busy:
        fitted = dataclasses.replace(fitted, busy=min(1.0, max(0.25, statistics.median(busy))))
    return fitted


def fit_shm(times: dict, memory: "Memory") -> "ShmCost":
    """shoal's shared-memory all_reduce of 2 ranks, t(S) = m(S) b2 + eta S (c + g) (the
    microbenchmark's c and g for S's working set; m(S) steps of S/4 within 256 KiB .. 4 MiB):
    the cost b2 of one step's barrier and bookkeeping, and eta, how much slower than the
    microbenchmark its copies and adds run."""
    steps, work, ts = [], [], []
    for n, t in sorted(times.items()):
        chunk = min(SHM_CHUNK_BYTES, max(SHM_W2_MIN_CHUNK_BYTES, n // 4))
        c, g = memory.rates(2 * 2 * n)
        steps.append(math.ceil(n / chunk))
        work.append(n * (c + g))
        ts.append(t)
    w = 1.0 / np.asarray(ts)
    design = np.stack([steps, work], axis=1) * w[:, None]
    (b2, eta), *_ = np.linalg.lstsq(design, np.asarray(ts) * w, rcond=None)
    return ShmCost(max(float(b2), 0.0), max(float(eta), 0.0))


def _gbps(per_byte: float) -> str:
    return f"{1 / per_byte / 1e9:.2f}" if per_byte > 0 else "inf"


def print_fits(model: Model, cores: int, loads: dict) -> None:
    print(f"fitted on this machine ({cores} cores; least squares, weights 1/t, medians)"
          + ("; other work's runnable tasks meanwhile (B): "
             + ", ".join(f"{name} {b:.1f}" for name, b in loads.items()) if loads else ""))
    print(f"  {'path':<8} {'a_block us':>10} {'a_spin us':>10} {'c us':>6} {'o us':>7} "
          f"{'beta ns/B':>10} {'GB/s':>6} {'busy':>5}")
    for name, p in model.links.items():
        c = f"{p.c_msg * 1e6:.1f}" if p.c_msg is not None else "-"
        print(f"  {name:<8} {p.a_block * 1e6:>10.1f} {p.a_spin * 1e6:>10.1f} {c:>6} "
              f"{p.o * 1e6:>7.1f} {p.beta * 1e9:>10.3f} {_gbps(p.beta):>6} {p.busy:>5.2f}")
    print(f"  sw, shoal's own work per data message (its 2-rank 4 KiB all_reduce less the raw "
          f"unix exchange): {model.links['unix'].sw * 1e6:.1f} us")
    if model.shm.step is not None:
        print(f"  shoal's shared memory, fitted to its 2-rank all_reduce of "
              f"{', '.join(_fmt_size(n) for n in SHM_CALIBRATION_SIZES)}: "
              f"{model.shm.step * 1e6:.1f} us a step, its copies and adds "
              f"{model.shm.eta:.2f} x the microbenchmarks' cost")
    m = model.memory
    print(f"  memory   copy {m.c_cache * 1e9:.3f} ns/B ({_gbps(m.c_cache)} GB/s) in cache, "
          f"{m.c_mem * 1e9:.3f} ({_gbps(m.c_mem)} GB/s) beyond; float32 add "
          f"{m.g_cache * 1e9:.3f} ({_gbps(m.g_cache)} GB/s) / {m.g_mem * 1e9:.3f} "
          f"({_gbps(m.g_mem)} GB/s); last-level cache {m.llc_bytes // MiB} MiB")
    print(json.dumps(fit_json(model, cores, loads, "fit")))


def fit_json(model: Model, cores: int, loads: dict, kind: str, **extra) -> dict:
    return {"bench": "scale_model", "row": kind, **extra, "cores": cores, "background": loads,
            "memory": dataclasses.asdict(model.memory),
            "links": {n: dataclasses.asdict(p) for n, p in model.links.items()},
            "shm": dataclasses.asdict(model.shm)}




# ----------------------------------------------------------------------------- the check

def has_hosts_mode() -> bool:
    """True once bench/allreduce.py takes --hosts (the multi-host mode)."""
    return "--hosts" in (ROOT / "bench" / "allreduce.py").read_text()


def _allreduce_rows(args: Sequence[str], timeout: float) -> list[dict]:
    """bench/allreduce.py's JSON rows for all_reduce."""
    argv = [sys.executable, str(ROOT / "bench" / "allreduce.py"), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[1:])} failed ({done.returncode}): "
                           f"{(done.stderr or done.stdout)[-2000:]}")
    rows = []
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            if row.get("op") == "all_reduce" and "bytes" in row:
                rows.append(row)
    return rows


def predictions_for(row: dict, model: Model, cores: int) -> list[tuple[str, float, float]]:
    """(label, predicted s, measured s) for each shoal column of one bench/allreduce.py row."""
    nbytes = row["bytes"]
    here = Machine(cores, one_machine=True)
    out = []
    if "hosts" in row:  # --hosts HxL: every rank of every namespace on this machine's cores
        hosts, local = row["hosts"], row["per_host"]
        veth, unix = model.links["veth"], model.links["unix"]
        tag = f"{hosts}x{local}"
        if row.get("link_gbit"):  # --link-gbit: the same links, shaped to a rate
            veth = dataclasses.replace(veth, wire=shaped_wire(row["link_gbit"],
                                                              row.get("mtu") or 1500))
            tag += f" at {row['link_gbit']:g} Gbit/s"
        if row.get("shoal_ms"):
            out.append((f"{tag} hierarchical",
                        model.hierarchical(nbytes, hosts, local, veth, unix, here),
                        row["shoal_ms"] / 1e3))
        if row.get("shoal_flat_ms"):
            out.append((f"{tag} flat ring", model.flat(nbytes, hosts, local, veth, unix, here),
                        row["shoal_flat_ms"] / 1e3))
        return out
    world = row["world"]
    if row.get("shoal_ms"):
        out.append((f"1x{world} shm/unix", model.one_host(nbytes, world, here),
                    row["shoal_ms"] / 1e3))
    if row.get("shoal_tcp_ms"):
        _, g = model.memory.rates(2 * world * nbytes)
        out.append((f"1x{world} ring tcp_lo",
                    model.ring(nbytes, world, [model.links["tcp_lo"]], here.k(1, world),
                               here.spin(world), g), row["shoal_tcp_ms"] / 1e3))
    return out


def shaped_wire(gbit: float, mtu: int = 1500) -> float:
    """Seconds per payload byte on a link shaped to `gbit` Gbit/s: the shaper counts whole
    Ethernet frames, MTU + 14 bytes of header, each carrying MTU - 52 bytes of TCP payload
    (IPv4 20 and TCP 32 with timestamps)."""
    return 8 / (gbit * 1e9) * (mtu + 14) / (mtu - 52)


def _bench_argvs(quick: bool) -> list[list[str]]:
    """bench/allreduce.py's invocations the check compares against: the three layouts over
    the software links, and 2x2 over links shaped to SHAPED_LINK_GBIT (the wire term of the
    model, which the unshaped links never exercise; only its large sizes, where the rate
    shows)."""
    common = ["--no-compare", "--ops", "all_reduce", "--no-loopback"] + (["--quick"] if quick else [])
    if has_hosts_mode():
        # --link-gbit came with this check: a bench with --hosts takes it.
        shaped = ["--link-gbit", f"{SHAPED_LINK_GBIT:g}", "--min-bytes", str(4 * MiB)]
        return ([["--hosts", shape, "--json", *common] for shape in ("2x2", "4x1", "1x4")]
                + [["--hosts", "2x2", "--json", *shaped, *common]])
    print("\nbench/allreduce.py has no --hosts mode yet: checking against its --worlds rows "
          "(one host; shoal_tcp_ms is the ring on loopback TCP)")
    return [["--worlds", "2,4", "--tcp-too", *common]]


def run_bench(quick: bool) -> list[dict]:
    """One run of every check invocation: bench/allreduce.py's all_reduce rows, each with
    `background` (other work's runnable tasks while it ran)."""
    rows = []
    for argv in _bench_argvs(quick):
        try:
            with LoadSampler() as load:
                got = _allreduce_rows(argv, timeout=600)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"  bench/allreduce.py {' '.join(argv)}: {exc}")
            continue
        rows.extend(dict(row, background=round(load.background, 2)) for row in got)
    return rows


def compare(model: Model, cores: int, runs: list[list[dict]]) -> list[dict]:
    """(config, bytes, predicted, measured) for every shoal column of the bench rows, the
    measured time the median over `runs` (lists of rows, one per round)."""
    measured: dict[tuple[str, int], list[float]] = {}
    predicted: dict[tuple[str, int], float] = {}
    for rows in runs:
        for row in rows:
            for label, guess, got in predictions_for(row, model, cores):
                key = (label, row["bytes"])
                predicted[key] = guess
                measured.setdefault(key, []).append(got)
    out = []
    for (label, nbytes), guess in predicted.items():
        got = statistics.median(measured[label, nbytes])
        out.append({"bench": "scale_model", "row": "check", "config": label, "bytes": nbytes,
                    "predicted_ms": round(guess * 1e3, 4), "measured_ms": round(got * 1e3, 4),
                    "measured_runs_ms": [round(t * 1e3, 4) for t in measured[label, nbytes]],
                    "error_pct": round(100 * (guess - got) / got, 1)})
    return out


def within(results: list[dict]) -> int:
    return sum(abs(r["error_pct"]) <= 25 for r in results)


def print_check(results: list[dict], rounds: int) -> None:
    print()
    print(f"{'configuration':<30}{'size':>8} {'predicted ms':>13} {'measured ms':>12} "
          f"{'runs min..max':>18} {'error':>8}")
    for r in results:
        runs = r["measured_runs_ms"]
        flag = "" if abs(r["error_pct"]) <= 25 else "  > 25%"
        print(f"{r['config']:<30}{_fmt_size(r['bytes']):>8} {r['predicted_ms']:>13.3f} "
              f"{r['measured_ms']:>12.3f} {f'{min(runs):.3f}..{max(runs):.3f}':>18} "
              f"{r['error_pct']:>+7.1f}%{flag}")
    if results:
        errs = [abs(r["error_pct"]) for r in results]
        print(f"within 25%: {within(results)} of {len(results)}; median |error| "
              f"{statistics.median(errs):.1f}% (the fit and the measured times medians of "
              f"{rounds} round{'s' if rounds != 1 else ''})")


def median_model(models: Sequence[Model]) -> Model:
    """Every fitted parameter's median over the rounds' models (one noisy calibration, such
    as a 52 us `sw` in one round of 2026-11-28's, then moves no prediction)."""

    def median_of(items):
        fields = {}
        for field in dataclasses.fields(items[0]):
            values = [v for v in (getattr(item, field.name) for item in items) if v is not None]
            if not values:  # no round measured it (c_msg before 2026-11-28)
                fields[field.name] = None
            elif isinstance(values[0], float):
                fields[field.name] = statistics.median(values)
            else:
                fields[field.name] = statistics.median_low(values)
        return type(items[0])(**fields)

    first = models[0]
    return Model({name: median_of([m.links[name] for m in models]) for name in first.links},
                 median_of([m.memory for m in models]), median_of([m.shm for m in models]))


def replay(paths: Sequence[str]) -> tuple[Model, list[list[dict]], int]:
    """The median model, the bench rows of each round and the cores they ran on, from saved
    output of this bench (its `round_fit` rows, which carry the raw figures, and its `bench`
    rows): to check the formulas and the fits as they are now against earlier runs."""
    models, runs, cores = [], {}, set()
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            if row.get("bench") != "scale_model":
                continue
            key = (path, row.get("round"))
            if row.get("row") == "round_fit":
                if "raw" not in row:
                    raise SystemExit(f"{path}: a round_fit row without its raw figures "
                                     f"(written before --replay could refit); cannot replay")
                models.append(fit_model(row["raw"]))
                cores.add(row["cores"])
            elif row.get("row") == "bench":
                runs.setdefault(key, []).append(row["data"])
    if not models:
        raise SystemExit(f"no round_fit rows in {', '.join(paths)}")
    if len(cores) != 1:
        raise SystemExit(f"the runs replayed ran on different core counts {sorted(cores)}: "
                         f"replay one machine's runs at a time")
    # Predictions for the check depend on the cores the runs had, not on this machine's.
    return median_model(models), list(runs.values()), cores.pop()


# ----------------------------------------------------------------------------- predictions

LINK_BANDWIDTH = 25e9 / 8  # bytes/s
LINK_LATENCY = 10e-6
SCALES = ((8, 8), (64, 8), (125, 8), (1000, 8))


def ddp_gradient_bytes() -> int:
    """The gradient bytes of examples/train_ddp.py's model, from its parameter shapes."""
    from shoal.examples import train_ddp

    return int(sum(p.data.nbytes for p in train_ddp.MLP().parameters()))


def cluster_link(model: Model) -> Link:
    """25 Gbit/s and 10 us; per-message and per-byte CPU costs of TCP as measured on veth."""
    veth = model.links["veth"]
    return Link(LINK_LATENCY, LINK_LATENCY, veth.o, veth.beta, wire=1 / LINK_BANDWIDTH,
                sw=veth.sw, c_msg=veth.c_msg)


def predict(model: Model) -> list[dict]:
    # Within a host the flat ring's links are Unix sockets (shoal's same-host links).
    link, intra = cluster_link(model), model.links["unix"]
    cluster = Machine(None, one_machine=False)
    models = []
    try:
        models.append(("train_ddp MLP", ddp_gradient_bytes()))
    except Exception as exc:  # noqa: BLE001  (the example is being changed by others)
        print(f"examples/train_ddp.py's model could not be built ({exc}); its rows are left out")
    models.append(("100M params fp32", 100_000_000 * 4))
    rows = []
    print()
    print(f"predicted DDP step overhead: all_reduce of every gradient bucket, none hidden; "
          f"link {LINK_BANDWIDTH * 8 / 1e9:g} Gbit/s, {LINK_LATENCY * 1e6:g} us; a core per rank")
    print(f"{'model':<18}{'grad':>10} {'H x L':>7} {'W':>5} {'flat ring ms':>13} "
          f"{'hierarchical ms':>16} {'bound ms':>9} {'flat/bound':>11} {'hier/bound':>11}")
    for name, nbytes in models:
        buckets = bucket_sizes(nbytes)
        for hosts, local in SCALES:
            world = hosts * local
            flat = sum(model.flat(b, hosts, local, link, intra, cluster) for b in buckets)
            hier = sum(model.hierarchical(b, hosts, local, link, intra, cluster) for b in buckets)
            bound = bandwidth_bound(nbytes, world, LINK_BANDWIDTH)
            rows.append({"bench": "scale_model", "row": "predict", "model": name,
                         "grad_bytes": nbytes, "buckets": len(buckets), "hosts": hosts,
                         "per_host": local, "world": world, "flat_ms": round(flat * 1e3, 4),
                         "hierarchical_ms": round(hier * 1e3, 4),
                         "bound_ms": round(bound * 1e3, 4)})
            print(f"{name:<18}{_fmt_size(nbytes):>10} {f'{hosts}x{local}':>7} {world:>5} "
                  f"{flat * 1e3:>13.3f} {hier * 1e3:>16.3f} {bound * 1e3:>9.3f} "
                  f"{flat / bound:>10.1f}x {hier / bound:>10.1f}x")
    print("(buckets up to 64 KiB: above 8 ranks both columns are recursive doubling, its first "
          "log2(L) exchanges within a host; larger buckets: rings, and two-level pipelined with "
          "a leader per rank on hosts with a core per rank)")
    return rows


def _fmt_size(n: float) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:.0f} {unit}" if n % scale == 0 else f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--peer"]:
        return _peer_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--no-check", action="store_true",
                        help="skip running bench/allreduce.py to check the model")
    parser.add_argument("--rounds", type=int, default=3,
                        help="calibrate and check this many times; the model is every "
                             "parameter's median over the rounds, the measured times the "
                             "median over the rounds' runs (default 3)")
    parser.add_argument("--replay", nargs="+", metavar="LOG",
                        help="no measuring: the check again from saved output of this bench "
                             "(its JSON rows), with the formulas as they are now")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be 1 or more")
    cores = os.cpu_count() or 1
    if args.replay:
        model, runs, cores = replay(args.replay)
        print_fits(model, cores, {})
        if runs:
            print_check(compare(model, cores, runs), len(runs))
        else:
            print("\n(no bench rows in the logs: they were --no-check runs; fits and "
                  "predictions only)")
        for row in predict(model):
            print(json.dumps(row))
        return 0
    t0 = time.monotonic()
    models, runs, loads = [], [], {}
    for i in range(args.rounds):
        raw = measure(5 if args.quick else 9)
        model = fit_model(raw)
        models.append(model)
        for name, b in raw["background"].items():
            loads.setdefault(name, []).append(b)
        print(json.dumps(fit_json(model, cores, raw["background"], "round_fit", round=i,
                                  raw=raw)))
        summary = (f"round {i + 1}/{args.rounds}: a_block unix {model.links['unix'].a_block * 1e6:.1f} "
                   f"us, veth {model.links['veth'].a_block * 1e6:.1f} us; veth beta "
                   f"{model.links['veth'].beta * 1e9:.3f} ns/B; sw {model.links['unix'].sw * 1e6:.1f} "
                   f"us; shm step {model.shm.step * 1e6:.1f} us")
        if not args.no_check:
            rows = run_bench(args.quick)
            runs.append(rows)
            for row in rows:
                print(json.dumps({"bench": "scale_model", "row": "bench", "round": i,
                                  "data": row}))
            busy = statistics.fmean(r["background"] for r in rows) if rows else 0.0
            summary += (f"; with this round's fit alone {within(compare(model, cores, [rows]))} "
                        f"of the check's cases within 25% (other work's runnable tasks "
                        f"during the check: {busy:.1f})")
        print(summary, flush=True)
    model = median_model(models)
    print()
    print_fits(model, cores, {name: statistics.median(b) for name, b in loads.items()})
    if runs:
        results = compare(model, cores, runs)
        print_check(results, args.rounds)
        for row in results:
            print(json.dumps(row))
    for row in predict(model):
        print(json.dumps(row))
    print(f"\n(took {time.monotonic() - t0:.0f} s on {cores} cores shared with other work: "
          f"figures move between runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
