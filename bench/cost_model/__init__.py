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
    b2, eta  its shared-memory all_reduce (collectives/backends/tcp/shm.py) at 256 KiB, 4 MiB
           and 32 MiB fitted to t = m b2 + eta S (c + g): b2 per step (barrier and
           bookkeeping), eta how much slower than the microbenchmarks its copies and adds run
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

# The names the unit tests and the command use; each module holds one part of the above:
# params (the fitted parameters), formulas (the model), peer and measure (measuring), fit,
# check, replay, predict, cli.
from .check import compare, predictions_for, shaped_wire, within
from .constants import (
    MEMORY_SIZES,
    PINGPONG_SIZES,
    SHM_CALIBRATION_SIZES,
    STREAM_SIZES,
)
from .fit import fit_json, fit_line, fit_model, median_model
from .formulas import Model, bandwidth_bound, bucket_sizes
from .load import LoadSampler, runnable_threads
from .params import Link, Machine, Memory, ShmCost, contention
from .replay import replay

__all__ = [
    "MEMORY_SIZES", "PINGPONG_SIZES", "SHM_CALIBRATION_SIZES", "STREAM_SIZES",
    "Link", "LoadSampler", "Machine", "Memory", "Model", "ShmCost",
    "bandwidth_bound", "bucket_sizes", "compare", "contention", "fit_json", "fit_line",
    "fit_model", "median_model", "predictions_for", "replay", "runnable_threads",
    "shaped_wire", "within",
]
