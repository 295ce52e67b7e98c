"""bench/cost_model (the model behind bench/scale_model.py): its fitting and formulas, on numbers
worked out by hand (no measuring)."""

from __future__ import annotations

import math
import sys
import time

import numpy as np
import pytest

from bench import cost_model

MiB = 1024 * 1024
KiB = 1024


def test_fit_line_recovers_a_line_and_weighs_small_sizes_alike():
    xs = [64, 1024, 65536, 4 * MiB]
    a, b = 20e-6, 0.5e-9
    got = cost_model.fit_line(xs, [a + b * x for x in xs])
    assert got == pytest.approx((a, b), rel=1e-9)
    # 10% too slow at the largest size only: an unweighted fit would drag the intercept
    # far off (the large sample's residual dwarfs the small ones); relative errors keep it.
    ts = [a + b * x for x in xs]
    ts[-1] *= 1.1
    a_fit, b_fit = cost_model.fit_line(xs, ts)
    assert a_fit == pytest.approx(a, rel=0.1)
    assert b_fit == pytest.approx(b, rel=0.12)


def test_fit_line_refuses_what_it_cannot_fit():
    with pytest.raises(ValueError, match=r"fit_line needs two or more \(x, t\) pairs, got 1 and 1"):
        cost_model.fit_line([1], [1.0])
    with pytest.raises(ValueError, match="fit_line needs positive times"):
        cost_model.fit_line([1, 2], [1.0, 0.0])


def test_contention_is_processes_per_core_but_never_a_speedup():
    assert cost_model.contention(1, 2) == 1.0
    assert cost_model.contention(2, 2) == 1.0
    assert cost_model.contention(4, 2) == 2.0
    assert cost_model.contention(3, 2) == 1.5


def test_ddp_buckets_follow_the_first_bucket_rule():
    assert cost_model.bucket_sizes(22032) == [22032]
    sizes = cost_model.bucket_sizes(400_000_000)
    assert sizes[0] == MiB and set(sizes[1:-1]) == {25 * MiB}
    assert sum(sizes) == 400_000_000 and 0 < sizes[-1] <= 25 * MiB
    assert len(sizes) == 1 + math.ceil((400_000_000 - MiB) / (25 * MiB))


def test_bandwidth_bound():
    assert cost_model.bandwidth_bound(1e9, 4, 1e9) == pytest.approx(1.5)
    assert cost_model.bandwidth_bound(1e9, 1, 1e9) == 0.0


def _model(**memory):
    unix = cost_model.Link(a_block=10e-6, a_spin=2e-6, o=1e-6, beta=0.5e-9)
    veth = cost_model.Link(a_block=20e-6, a_spin=5e-6, o=2e-6, beta=1e-9)
    mem = dict(c_cache=0.1e-9, c_mem=0.2e-9, g_cache=0.1e-9, g_mem=0.3e-9, llc_bytes=32 * MiB)
    mem.update(memory)
    return cost_model.Model({"unix": unix, "tcp_lo": veth, "veth": veth}, cost_model.Memory(**mem))


def test_ring_and_direct_exchange_by_hand():
    model = _model()
    veth = model.links["veth"]
    here = cost_model.Machine(cores=2, one_machine=True)
    # 4 ranks on 2 cores: k = 2, no polling; 8 MiB: a ring of 2 MiB segments, cache rates
    # (working set 2 x 4 x 8 MiB = 64 MiB > 32 MiB: memory rates, g = 0.3 ns/B).
    # Sharing cores, each step also moves a send buffer's worth (512 KiB) once more: the fill.
    S, seg = 8 * MiB, 2 * MiB
    step = 20e-6 + 2e-6 + seg * 1e-9
    fill = 512 * KiB * 1e-9
    want = 2 * 3 * (2 * step + fill) + 2 * 3 * seg * 0.3e-9
    assert model.ring(S, 4, [veth], 2.0, False, 0.3e-9) == pytest.approx(want)
    # A segment smaller than the buffer fills with itself; with a core per rank, no fill.
    small_step = 2 * (20e-6 + 2e-6 + 64 * KiB * 1e-9) + 64 * KiB * 1e-9
    small = 2 * 3 * small_step + 2 * 3 * 64 * KiB * 0.3e-9
    assert model.ring(256 * KiB, 4, [veth], 2.0, False, 0.3e-9) == pytest.approx(small)
    assert model.ring(S, 4, [veth], 1.0, False, 0.3e-9) == pytest.approx(
        2 * 3 * step + 3 * seg * 0.3e-9)
    # 4 KiB: direct exchange, 3 messages each waited for in turn.
    want = 2 * 3 * (20e-6 + 2e-6 + 4096 * (1e-9 + 0.1e-9))
    assert model.ring(4096, 4, [veth], 2.0, False, 0.1e-9) == pytest.approx(want)
    # A flat ring across 2 hosts x 2 ranks: two hops over veth, two over unix; with 4 ranks
    # on 2 cores a step takes k times the mean hop's work (more than the slowest hop alone).
    veth_work = 20e-6 + 2e-6 + seg * 1e-9
    unix_work = 10e-6 + 1e-6 + seg * 0.5e-9
    step = 2 * (veth_work + unix_work) / 2 + 512 * KiB * (1e-9 + 0.5e-9) / 2
    want = 2 * 3 * step + 2 * 3 * seg * 0.3e-9
    assert model.flat(S, 2, 2, veth, model.links["unix"], here) == pytest.approx(want)
    # The same on a cluster (a core per rank): the slowest hop.
    cluster = cost_model.Machine(cores=None, one_machine=False)
    veth_work = 5e-6 + 2e-6 + seg * 1e-9  # polling latency
    want = 2 * 3 * veth_work + 3 * seg * 0.3e-9  # 2 x 2 x 8 MiB = 32 MiB a host: memory
    assert model.flat(S, 2, 2, veth, model.links["unix"], cluster) == pytest.approx(want)


def test_a_direct_exchange_waits_one_latency_or_the_shared_cores_work():
    """Its messages leave at once. With a core per rank: one latency (the slowest link's), then
    every message's CPU (send, receive, wake-up: c; polling receivers: o), shoal's work and
    bytes. With more ranks than cores the cores never idle waiting: k times that work, unless
    the latency is longer."""
    import dataclasses

    base = _model()
    unix = dataclasses.replace(base.links["unix"], c_msg=18e-6, sw=3e-6)
    veth = dataclasses.replace(base.links["veth"], c_msg=30e-6, sw=3e-6)
    model = cost_model.Model({"unix": unix, "tcp_lo": veth, "veth": veth}, base.memory)
    g, n = 0.1e-9, 4096
    per_veth = 30e-6 + 3e-6 + n * (1e-9 + g)
    per_unix = 18e-6 + 3e-6 + n * (0.5e-9 + g)
    # 2 hosts x 2 ranks on 2 cores (k = 2), sleeping: the cores do every rank's two veth
    # messages and one unix message, twice their work (longer than veth's 20 us latency + it).
    got = model.direct(n, [(veth, 2), (unix, 1)], 2.0, False, g)
    assert got == pytest.approx(2 * (2 * per_veth + per_unix))
    # A core per rank: the latency, then the work.
    got = model.direct(n, [(veth, 2), (unix, 1)], 1.0, False, g)
    assert got == pytest.approx(20e-6 + 2 * per_veth + per_unix)
    # Little work against a long latency: still the latency and the work, even on shared cores.
    slow = dataclasses.replace(veth, a_block=500e-6)
    assert model.direct(n, [(slow, 1)], 2.0, False, g) == pytest.approx(500e-6 + per_veth)
    # Polling receivers: the polling latency and the streaming cost o per message.
    got = model.direct(n, [(veth, 2), (unix, 1)], 1.0, True, g)
    assert got == pytest.approx(5e-6 + 2 * (2e-6 + 3e-6 + n * (1e-9 + g))
                                + (1e-6 + 3e-6 + n * (0.5e-9 + g)))
    # The flat all_reduce of 4 KiB at 2x2 is that exchange (k = 4 ranks / 2 cores).
    here = cost_model.Machine(cores=2, one_machine=True)
    g_cache = 0.1e-9
    assert model.flat(n, 2, 2, veth, unix, here) == pytest.approx(
        2 * (2 * (30e-6 + 3e-6 + n * (1e-9 + g_cache))
             + (18e-6 + 3e-6 + n * (0.5e-9 + g_cache))))


def test_a_shared_memory_barrier_overlaps_its_peers_latencies():
    """A barrier is an empty direct exchange: its L-1 messages leave at once, so it costs one
    latency (or the fitted one-peer step) and one message's work per further peer, times k."""
    model = _model()
    # No fitted step: one unix latency (no polling at k = 2) plus L-1 messages' work.
    assert model._barrier(4, 2.0, False) == pytest.approx(2 * (10e-6 + 3 * 1e-6))
    assert model._barrier(2, 2.0, False) == pytest.approx(2 * (10e-6 + 1e-6))
    # A fitted step (its 2-rank all_reduce, one peer) holds the latency and the first message.
    fitted = cost_model.Model(model.links, model.memory, cost_model.ShmCost(step=50e-6))
    assert fitted._barrier(2, 2.0, False) == pytest.approx(2 * 50e-6)
    assert fitted._barrier(4, 2.0, False) == pytest.approx(2 * (50e-6 + 2 * 1e-6))
    # One host of 4 ranks at 256 KiB: one chunk, so two barriers and the copies and adds
    # (working set 2 x 4 x 256 KiB in cache: c = g = 0.1 ns/B, eta 1).
    S = 256 * 1024
    here = cost_model.Machine(cores=2, one_machine=True)
    want = 2 * fitted._barrier(4, 2.0, False) + 2 * ((2 * S - S / 4) * 0.1e-9
                                                     + 3 * (S / 4) * 0.1e-9)
    assert fitted.one_host(S, 4, here) == pytest.approx(want)


def test_hierarchical_by_hand_and_its_edge_cases():
    model = _model()
    veth, unix = model.links["veth"], model.links["unix"]
    cluster = cost_model.Machine(cores=None, one_machine=False)  # k = 1, polling
    H, L, S = 4, 2, 8 * MiB
    seg = S / L
    # Working set on a host 2 x 2 x 8 MiB = 32 MiB, over half the cache: memory rates
    # (c = 0.2, g = 0.3 ns/B).
    barrier = 1 * (2e-6 + 1e-6)
    t1 = 2 * barrier + (S - seg) * 0.2e-9 + seg * 0.3e-9
    ring_seg = seg / H
    t2 = 2 * 3 * (5e-6 + 2e-6 + ring_seg * 1e-9) + 3 * ring_seg * 0.3e-9
    t3 = 4 * barrier + S * 0.2e-9  # relay chunks of seg / 4 = 1 MiB: 4 steps
    assert model.hierarchical(S, H, L, veth, unix, cluster) == pytest.approx(t1 + t2 + t3)
    # One host: the same-host path; one rank per host: the ring across hosts.
    assert model.hierarchical(S, 1, 4, veth, unix, cluster) == model.one_host(S, 4, cluster)
    assert model.hierarchical(S, 4, 1, veth, unix, cluster) == pytest.approx(
        model.ring(S, 4, [veth], 1.0, True, 0.1e-9))
    # Small messages: the flat direct exchange (8 ranks: not above DIRECT_MAX_RANKS).
    assert model.hierarchical(4096, H, L, veth, unix, cluster) == model.flat(
        4096, H, L, veth, unix, cluster)


def test_pipelined_hierarchical_overlaps_the_host_phases_with_the_rings():
    """On hosts with a core per rank the group pipelines 8 MiB pieces: the longer of the host
    phases and the rings decides, plus one piece of each; on 2 cores shared by 4 ranks it does
    not pipeline, and only the H x k leaders count as busy in the ring phase."""
    model = _model()
    veth, unix = model.links["veth"], model.links["unix"]
    cluster = cost_model.Machine(cores=None, one_machine=False)

    class Unpipelined(cost_model.Machine):
        def pipelined(self, local):
            return False

    H, L, S = 4, 2, 64 * MiB
    serial = model.hierarchical(S, H, L, veth, unix, Unpipelined(cores=None, one_machine=False))
    g = model.memory.rates(2 * L * S)[1]
    t2 = model.ring(S / L, H, [veth], 1.0, True, g, share=L)
    t13 = serial - t2
    got = model.hierarchical(S, H, L, veth, unix, cluster)
    assert got == pytest.approx(max(t13, t2) + serial / 8)
    assert got < serial
    assert cluster.pipelined(L) and cluster.leaders(H, L) == L
    here = cost_model.Machine(cores=2, one_machine=True)
    assert not here.pipelined(2) and here.leaders(2, 2) == 1
    assert here.k_busy(2, 1) == 1.0 and here.k(2, 2) == 2.0


def test_small_messages_above_eight_ranks_run_as_trees():
    model = _model()
    veth, unix = model.links["veth"], model.links["unix"]
    cluster = cost_model.Machine(cores=None, one_machine=False)
    g = model.memory.rates(2 * 8 * 4096)[1]
    one = veth.latency(True) + veth.o + 4096 * (veth.beta + g)
    # 16 one-rank hosts: 4 exchanges; 12: 3 plus a fold in and out.
    assert model.flat(4096, 16, 1, veth, unix, cluster) == pytest.approx(4 * one)
    assert model.recursive_doubling(4096, 16, veth, 1.0, True, g) == pytest.approx(4 * one)
    assert model.recursive_doubling(4096, 12, veth, 1.0, True, g) == pytest.approx(5 * one)
    # 4 hosts x 4 ranks: 4 exchanges, the first 2 within a host (unix), the last 2 across.
    g16 = model.memory.rates(2 * 4 * 4096)[1]
    within = unix.latency(True) + unix.o + 4096 * (unix.beta + g16)
    across = veth.latency(True) + veth.o + 4096 * (veth.beta + g16)
    assert model.hierarchical(4096, 4, 4, veth, unix, cluster) == pytest.approx(
        2 * within + 2 * across)


def test_a_shared_wire_limits_the_concurrent_rings():
    """L rings crossing one link of bandwidth B move S/H bytes per step over it together."""
    model = _model()
    wire = cost_model.Link(a_block=0.0, a_spin=0.0, o=0.0, beta=0.0, wire=1 / 1e9)
    S, H, L = 64 * MiB, 8, 8
    t2 = model.ring(S / L, H, [wire], 1.0, True, 0.0, share=L)
    assert t2 == pytest.approx(2 * (H - 1) * (S / H) / 1e9)
    # That is the bandwidth-optimal bound over H hosts.
    assert t2 == pytest.approx(cost_model.bandwidth_bound(S, H, 1e9))


def test_at_scale_the_hierarchy_beats_the_flat_ring_and_stays_above_the_bound():
    model = _model()
    link = cost_model.Link(10e-6, 10e-6, 2e-6, 0.2e-9, wire=8 / 25e9)
    cluster = cost_model.Machine(cores=None, one_machine=False)
    for hosts in (8, 64, 1000):
        S = 100 * MiB
        flat = model.flat(S, hosts, 8, link, model.links["unix"], cluster)
        hier = model.hierarchical(S, hosts, 8, link, model.links["unix"], cluster)
        bound = cost_model.bandwidth_bound(S, hosts * 8, 25e9 / 8)
        assert bound < hier < flat, (hosts, bound, hier, flat)


def test_memory_rates_switch_at_half_the_last_level_cache():
    mem = _model().memory
    assert mem.rates(16 * MiB) == (0.1e-9, 0.1e-9)
    assert mem.rates(16 * MiB + 1) == (0.2e-9, 0.3e-9)


def test_the_check_reads_both_kinds_of_bench_rows():
    model = _model()
    hosts_row = {"op": "all_reduce", "hosts": 2, "per_host": 2, "world": 4, "bytes": 4 * MiB,
                 "shoal_ms": 10.0, "shoal_flat_ms": 20.0}
    labels = [label for label, _, measured in cost_model.predictions_for(hosts_row, model, 2)]
    assert labels == ["2x2 hierarchical", "2x2 flat ring"]
    worlds_row = {"op": "all_reduce", "world": 2, "bytes": 4096, "shoal_ms": 0.05,
                  "shoal_tcp_ms": 0.08}
    got = cost_model.predictions_for(worlds_row, model, 2)
    assert [label for label, _, _ in got] == ["1x2 shm/unix", "1x2 ring tcp_lo"]
    assert [m for _, _, m in got] == pytest.approx([0.05e-3, 0.08e-3])
    assert all(np.isfinite(p) and p > 0 for _, p, _ in got)


def test_a_shaped_links_rows_are_checked_with_its_rate_as_the_wire():
    """--link-gbit rows: the veth link with w = 8/R per frame byte, 1514 frame bytes per 1448
    of payload at MTU 1500; at 64 MiB and 5 Gbit/s the wire decides the flat ring's steps."""
    assert cost_model.shaped_wire(5.0) == pytest.approx(8 / 5e9 * 1514 / 1448)
    assert cost_model.shaped_wire(10.0, mtu=9000) == pytest.approx(8 / 10e9 * 9014 / 8948)
    model = _model()
    S = 64 * MiB
    row = {"op": "all_reduce", "hosts": 2, "per_host": 2, "world": 4, "bytes": S,
           "shoal_ms": 130.0, "shoal_flat_ms": 170.0, "link_gbit": 5.0}
    got = dict((label, guess) for label, guess, _ in cost_model.predictions_for(row, model, 2))
    assert list(got) == ["2x2 at 5 Gbit/s hierarchical", "2x2 at 5 Gbit/s flat ring"]
    # Flat ring over [0,1 | 2,3]: 6 steps of S/4, each crossing a shaped link; reductions on
    # 2 cores shared by 4 ranks (k = 2) at the memory rate (the working set is beyond the cache).
    w = cost_model.shaped_wire(5.0)
    # (The cores' work, fill included, is shorter than the wire's: the wire decides alone.)
    cores = 2 * (S / 4) * (1e-9 + 0.5e-9) / 2 + 512 * KiB * (1e-9 + 0.5e-9) / 2
    assert cores < (S / 4) * w
    assert got["2x2 at 5 Gbit/s flat ring"] == pytest.approx(
        6 * (S / 4) * w + 2 * 3 * (S / 4) * 0.3e-9)
    unshaped = dict((label, guess) for label, guess, _ in
                    cost_model.predictions_for(dict(row, link_gbit=None), model, 2))
    assert unshaped["2x2 flat ring"] < got["2x2 at 5 Gbit/s flat ring"]  # beta 1 ns/B < w


def test_the_rounds_model_takes_every_parameters_median():
    """One round's outlier (a 52 us sw, a 211 us shared-memory step) moves no prediction."""
    import dataclasses

    base = _model()
    rounds = []
    for sw, step, beta, llc in ((2e-6, 50e-6, 0.4e-9, 32 * MiB), (52e-6, 211e-6, 0.8e-9, 32 * MiB),
                                (9e-6, 70e-6, 0.3e-9, 32 * MiB)):
        links = {name: dataclasses.replace(link, sw=sw, beta=beta)
                 for name, link in base.links.items()}
        rounds.append(cost_model.Model(links, dataclasses.replace(base.memory, llc_bytes=llc),
                               cost_model.ShmCost(step, 1.0)))
    got = cost_model.median_model(rounds)
    assert got.links["veth"].sw == pytest.approx(9e-6)
    assert got.links["veth"].beta == pytest.approx(0.4e-9)
    assert got.links["veth"].a_block == base.links["veth"].a_block
    assert got.shm == cost_model.ShmCost(70e-6, 1.0)
    assert got.memory.llc_bytes == 32 * MiB and isinstance(got.memory.llc_bytes, int)
    # A shared-memory fit that is absent stays absent.
    assert cost_model.median_model([base, base]).shm.step is None
    # Rounds from before a parameter was measured (c_msg: None) do not decide it, whatever
    # their order.
    with_c = [dataclasses.replace(base.links["unix"], c_msg=c) for c in (None, 10e-6, 30e-6)]
    for order in (with_c, with_c[::-1]):
        models = [cost_model.Model({"unix": link, "tcp_lo": link, "veth": link}, base.memory)
                  for link in order]
        assert cost_model.median_model(models).links["unix"].c_msg == pytest.approx(20e-6)
    assert cost_model.median_model([base]).links["unix"].c_msg is None


def _hosts_row(ms: float, flat_ms: float) -> dict:
    return {"op": "all_reduce", "hosts": 2, "per_host": 2, "world": 4, "bytes": 4 * MiB,
            "shoal_ms": ms, "shoal_flat_ms": flat_ms, "background": 0.1}


def test_the_check_compares_with_the_median_of_the_rounds_runs():
    model = _model()
    runs = [[_hosts_row(10.0, 20.0)], [_hosts_row(30.0, 26.0)], [_hosts_row(12.0, 22.0)]]
    got = {r["config"]: r for r in cost_model.compare(model, 2, runs)}
    hier, flat = got["2x2 hierarchical"], got["2x2 flat ring"]
    assert hier["measured_ms"] == 12.0 and hier["measured_runs_ms"] == [10.0, 30.0, 12.0]
    assert flat["measured_ms"] == 22.0
    want = model.hierarchical(4 * MiB, 2, 2, model.links["veth"], model.links["unix"],
                              cost_model.Machine(2, one_machine=True)) * 1e3
    assert hier["predicted_ms"] == pytest.approx(want, rel=1e-4)
    assert hier["error_pct"] == pytest.approx(100 * (want - 12.0) / 12.0, abs=0.05)
    # 25% either way counts as within, a hair beyond does not
    assert cost_model.within([{"error_pct": e} for e in (24.9, -25.0, 25.0, 25.1, -30.0)]) == 3


def test_a_saved_run_replays_to_the_same_check(tmp_path):
    """--replay refits every round from the raw figures its JSON row carries, takes their
    median, reads the rounds' bench rows back and uses the cores the runs had."""
    import json

    raws = [_raw_figures() for _ in range(3)]
    for raw, scale in zip(raws, (1.0, 1.4, 1.2)):  # the rounds' memory copies differ
        raw["memory"] = {k: t * scale if k.startswith("copy_mem") else t
                         for k, t in raw["memory"].items()}
    runs = [[_hosts_row(10.0, 20.0)], [_hosts_row(30.0, 26.0)], [_hosts_row(12.0, 22.0)]]
    lines = ["fitted on this machine (human-readable lines are skipped)"]
    for i, (raw, rows) in enumerate(zip(raws, runs)):
        fitted = cost_model.fit_model(raw)
        lines.append(json.dumps(cost_model.fit_json(fitted, 2, {"unix": 0.1}, "round_fit",
                                                    round=i, raw=raw)))
        lines += [json.dumps({"bench": "scale_model", "row": "bench", "round": i, "data": r})
                  for r in rows]
    log = tmp_path / "run.log"
    log.write_text("\n".join(lines) + "\n")
    model, replayed, cores = cost_model.replay([str(log)])
    assert model == cost_model.median_model([cost_model.fit_model(raw) for raw in raws])
    assert model.memory.c_mem == pytest.approx(0.12e-9 * 1.2, rel=1e-6)  # the middle round's
    assert replayed == runs and cores == 2
    # A row saved without its raw figures cannot be refitted: a clear refusal.
    old = tmp_path / "old.log"
    old.write_text(json.dumps(cost_model.fit_json(model, 2, {}, "round_fit", round=0)) + "\n")
    with pytest.raises(SystemExit, match="without its raw figures"):
        cost_model.replay([str(old)])


def test_our_own_threads_are_not_other_works_load():
    """A process's state in /proc is its main thread's: a rank whose work runs in another
    thread while its main thread waits is still runnable, and ours, not other work's."""
    import subprocess

    code = ("import threading, time\n"
            "def spin():\n"
            "    t = time.monotonic()\n"
            "    while time.monotonic() - t < 20: pass\n"
            "threading.Thread(target=spin, daemon=True).start()\n"
            "print('spinning', flush=True)\n"
            "time.sleep(20)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "spinning"
        # Right after the print the two threads may still pass the GIL back and forth: look
        # until the main thread sleeps (bounded), then count.
        deadline, seen = time.monotonic() + 10, None
        while time.monotonic() < deadline:
            with open(f"/proc/{child.pid}/stat") as f:
                main_state = f.read().rsplit(")", 1)[1].split()[0]
            seen = (main_state, cost_model.runnable_threads(child.pid))
            if seen == ("S", 1):
                break
            time.sleep(0.05)
        assert seen == ("S", 1), seen  # the main thread sleeps; the spinning thread runs
        assert cost_model.runnable_threads(2 ** 22 + 7) == 0  # gone (or never was): nothing runs
    finally:
        child.kill()
        child.wait(10)


def _raw_figures() -> dict:
    """`measure`'s raw figures, made from known parameters (what `fit_model` must recover)."""
    KiB = 1024

    def path(a, a_spin, o, beta):
        return {"pingpong": {n: a + n * 0.1e-9 for n in cost_model.PINGPONG_SIZES},
                "pingpong_spin": {n: a_spin + n * 0.1e-9 for n in cost_model.PINGPONG_SIZES},
                "stream": {n: o + n * beta for n in cost_model.STREAM_SIZES},
                "stream_cpu": {n: 0.75 * (o + n * beta) for n in cost_model.STREAM_SIZES},
                "pingpong_cpu": {n: 3 * o + n * 0.2e-9 for n in cost_model.PINGPONG_SIZES}}

    memory = {}
    for kind, cache, mem in (("copy", 0.03e-9, 0.12e-9), ("add", 0.04e-9, 0.11e-9)):
        for n in cost_model.MEMORY_SIZES:
            memory[f"{kind}_cache_{n}"] = 1e-7 + n * cache
            memory[f"{kind}_mem_{n}"] = 1e-7 + n * mem
    unix_exchange = 30e-6 + 6e-6 + 4 * KiB * (0.2e-9 + 0.04e-9)
    return {
        "llc_bytes": 32 * MiB, "unix": path(30e-6, 5e-6, 6e-6, 0.2e-9),
        "tcp_lo": path(35e-6, 7e-6, 7e-6, 0.7e-9), "veth": path(40e-6, 10e-6, 8e-6, 0.4e-9),
        "memory": memory, "shoal_calls": {"barrier": 40e-6, "all_reduce": unix_exchange + 9e-6},
        # shared memory: m steps of 60 us (256 KiB: 1, 4 MiB: 4 chunks of 1 MiB, 32 MiB: 8 of
        # 4 MiB) and the copy and add at the microbenchmark's rates (cache up to 4 MiB: 4 S
        # fits half the last-level cache), eta = 1
        "shoal_shm": {f"shm_{n}": 60e-6 * m + n * (0.07e-9 if n <= 4 * MiB else 0.23e-9)
                      for n, m in zip(cost_model.SHM_CALIBRATION_SIZES, (1, 4, 8))},
        # shoal's 2x1 ring: t - (S/2) g = 2 (a + sw + o) + S beta' with the stream's o = 8 us
        # and beta' = 0.35 ns/B
        "veth_ring": [{"bytes": n, "shoal_ms": 1e3 * (2 * (40e-6 + 9e-6 + 8e-6) + n * 0.35e-9
                                                      + (n / 2) * (0.04e-9 if 4 * n <= 16 * MiB
                                                                   else 0.11e-9)),
                       "shoal_cpu_ms": 0.0} for n in (256 * KiB, 4 * MiB, 64 * MiB)]
        + [{"bytes": 16 * MiB}],  # a row whose shoal side failed: left out of the fit
        "background": {"unix": 0.1},
    }


def test_the_model_is_fitted_from_raw_figures_and_refitted_from_saved_ones(tmp_path):
    """`fit_model` recovers the parameters the figures were made from, and gives the same model
    from the figures read back from a saved run's JSON (whose keys came back as strings)."""
    import json

    raw = _raw_figures()
    model = cost_model.fit_model(raw)
    unix, veth = model.links["unix"], model.links["veth"]
    assert unix.a_block == pytest.approx(30e-6) and unix.a_spin == pytest.approx(5e-6)
    assert unix.o == pytest.approx(6e-6) and unix.beta == pytest.approx(0.2e-9)
    assert unix.busy == pytest.approx(0.75)
    assert unix.sw == pytest.approx(9e-6) and veth.sw == pytest.approx(9e-6)
    # veth's per-byte cost from shoal's ring, its per-message cost the stream's; its busy
    # from the ring's CPU, absent here (0), so the raw stream's stands
    assert veth.beta == pytest.approx(0.35e-9) and veth.o == pytest.approx(8e-6)
    assert veth.busy == pytest.approx(0.75)
    # CPU per small message: the ping-pong's process time per round trip at zero bytes
    assert unix.c_msg == pytest.approx(18e-6) and veth.c_msg == pytest.approx(24e-6)
    # With the ring's CPU recorded (both ranks 95% busy), veth's busy fraction is the ring's.
    with_cpu = dict(raw, veth_ring=[dict(r, shoal_cpu_ms=2 * 0.95 * r["shoal_ms"])
                                    for r in raw["veth_ring"] if "shoal_ms" in r])
    assert cost_model.fit_model(with_cpu).links["veth"].busy == pytest.approx(0.95)
    assert model.memory.c_mem == pytest.approx(0.12e-9) and model.memory.g_cache == pytest.approx(0.04e-9)
    assert model.shm.step == pytest.approx(60e-6, rel=1e-3)
    assert model.shm.eta == pytest.approx(1.0, rel=1e-3)
    assert cost_model.fit_model(json.loads(json.dumps(raw))) == model

    line = json.dumps(cost_model.fit_json(model, 2, raw["background"], "round_fit", round=0,
                                          raw=raw))
    log = tmp_path / "run.log"
    log.write_text(line + "\n")
    replayed, runs, cores = cost_model.replay([str(log)])
    assert replayed == model and runs == [] and cores == 2
