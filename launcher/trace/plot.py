"""`shoal trace plot`: the ranks' timelines (compute, communication, idle) as a picture.

matplotlib is an optional extra (`pip install shoal[models]` or matplotlib itself).
"""

from __future__ import annotations

from shoal.launcher.trace.files import TraceError, common_base, load
from shoal.launcher.trace.summary import _union, kind as event_kind


def plot(directory: str, output: str) -> str:
    """Draw every rank's aligned timeline to `output` (png, svg or pdf)."""
    try:
        import matplotlib  # noqa: PLC0415 - optional extra

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as exc:
        raise TraceError("shoal trace plot needs matplotlib: pip install matplotlib") from exc
    windows = load(directory)
    base = common_base([t for ranks in windows.values() for t in ranks.values()])
    lanes: dict[int, dict[str, list]] = {}
    t0 = None
    for _, ranks in sorted(windows.items()):
        for rank, t in ranks.items():
            shift = t.shift_us(base)
            lane = lanes.setdefault(rank, {"compute": [], "comm": [], "step": []})
            for e in t.events:
                k = event_kind(e)
                if k is None:
                    continue
                s, d = e["ts"] + shift, e["dur"]
                t0 = s if t0 is None else min(t0, s)
                lane[k].append((s, s + d))
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.7 * len(lanes)))
    colors = {"step": "#dddddd", "compute": "#4c72b0", "comm": "#dd8452"}
    for rank, lane in sorted(lanes.items()):
        for kind, height in (("step", 0.8), ("compute", 0.6), ("comm", 0.35)):
            bars = [((s - t0) / 1e3, (e - s) / 1e3) for s, e in _union(lane[kind])]
            if bars:
                ax.broken_barh(bars, (rank - height / 2, height), color=colors[kind],
                               label=kind if rank == min(lanes) else None)
    ax.set_yticks(sorted(lanes))
    ax.set_yticklabels([f"rank {r}" for r in sorted(lanes)])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first event (clocks aligned to rank 0)")
    ax.set_title("shoal trace: compute (blue), communication (orange), idle (grey step only)")
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return output
