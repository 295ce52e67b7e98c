"""Predictions for a cluster: a DDP step's all_reduce overhead at 8 x 8 up to 1000 x 8 hosts x
ranks, flat ring and hierarchical, beside the bandwidth-optimal bound."""

from __future__ import annotations

from .formulas import Model, bandwidth_bound, bucket_sizes
from .params import Link, Machine
from .units import fmt_size


LINK_BANDWIDTH = 25e9 / 8  # bytes/s
LINK_LATENCY = 10e-6
SCALES = ((8, 8), (64, 8), (125, 8), (1000, 8))


def ddp_gradient_bytes() -> int:
    """The gradient bytes of examples/train_ddp.py's model, from its parameter shapes."""
    # Late: only the predictions need the example (and through it the whole of shoal).
    from shoal.examples import train_ddp

    return int(sum(p.array.nbytes for p in train_ddp.MLP().parameters()))


def cluster_link(model: Model) -> Link:
    """25 Gbit/s and 10 us; per-message and per-byte CPU costs of TCP as measured on veth."""
    veth = model.links["veth"]
    return Link(LINK_LATENCY, LINK_LATENCY, veth.o, veth.beta, wire=1 / LINK_BANDWIDTH,
                sw=veth.sw, c_msg=veth.c_msg)


def predict(model: Model) -> list[dict]:
    """Print and return the predicted step overheads (one JSON-able row per model and scale)."""
    # Within a host the flat ring's links are Unix sockets (shoal's same-host links).
    link, intra = cluster_link(model), model.links["unix"]
    cluster = Machine(None, one_machine=False)
    models = []
    try:
        models.append(("train_ddp MLP", ddp_gradient_bytes()))
    except Exception as exc:  # noqa: BLE001  (any failure of the example costs only its rows)
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
            print(f"{name:<18}{fmt_size(nbytes):>10} {f'{hosts}x{local}':>7} {world:>5} "
                  f"{flat * 1e3:>13.3f} {hier * 1e3:>16.3f} {bound * 1e3:>9.3f} "
                  f"{flat / bound:>10.1f}x {hier / bound:>10.1f}x")
    print("(buckets up to 64 KiB: above 8 ranks both columns are recursive doubling, its first "
          "log2(L) exchanges within a host; larger buckets: rings, and two-level pipelined with "
          "a leader per rank on hosts with a core per rank)")
    return rows
