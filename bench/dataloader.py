"""DataLoader throughput and hand-over bandwidth, shoal next to torch's DataLoader.

Two figures, each measured for shoal and (with --compare, when torch is installed) torch in
the same run, alternating the two in rounds (A B A B) so machine noise hits both alike:

  decode    samples/s of a CPU-bound pipeline at 0, 1 and 2 workers: each record is a
            zlib-compressed 3x64x64 uint8 image that __getitem__ decompresses and normalises
            into float32 (mean/std per channel); batches of 64 are collated by each loader's
            default_collate. Target: shoal >= torch at every worker count.
  handover  GB/s (1e9 bytes) of 4 MiB batches crossing from workers to the main process:
            the dataset returns a ready 4 MiB float32 array (batch_size=None), so the figure is
            the worker -> main path alone. Target: >= 2 GB/s.

One thread per process for both (OMP_NUM_THREADS=1, torch.set_num_threads(1)); medians over
--repeats rounds, with the spread (min..max).

    python bench/dataloader.py --compare
    python bench/dataloader.py --compare --repeats 7 --records 2048
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402

import numpy as np  # noqa: E402

from shoal.core import data  # noqa: E402

SHAPE = (3, 64, 64)
MEAN = np.array([0.485, 0.456, 0.406], np.float32).reshape(3, 1, 1)
STD = np.array([0.229, 0.224, 0.225], np.float32).reshape(3, 1, 1)
HANDOVER_BYTES = 4 << 20


def make_records(count: int, seed: int = 0) -> list[bytes]:
    """Compressible synthetic images (smooth gradients plus noise), zlib level 6."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 200, SHAPE[2], dtype=np.float32)
    out = []
    for _ in range(count):
        img = ramp[None, None, :] + rng.integers(0, 40, SHAPE).astype(np.float32)
        out.append(zlib.compress(img.astype(np.uint8).tobytes(), 6))
    return out


class DecodeDataset:
    """Decompress and normalise one record per __getitem__ (plain class: both loaders take it)."""

    def __init__(self, records: list[bytes]) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int):
        raw = np.frombuffer(zlib.decompress(self.records[i]), np.uint8).reshape(SHAPE)
        x = (raw.astype(np.float32) * (1 / 255.0) - MEAN) / STD
        return x, i % 10


class BigBatch:
    """A ready 4 MiB float32 batch per index (the worker -> main path alone)."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.batch = None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        if self.batch is None:  # made once per worker
            self.batch = np.full(HANDOVER_BYTES // 4, 1.0, np.float32)
        return self.batch


def _shoal_loader(dataset, workers: int, batch_size):
    return data.DataLoader(dataset, batch_size=batch_size, num_workers=workers)


def _torch_loader(dataset, workers: int, batch_size):
    import torch

    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers)


def _time_epoch(loader) -> tuple[float, int, int]:
    """Seconds for one epoch (worker start included, as a user's epoch pays it), samples, bytes."""
    start = time.perf_counter()
    samples = nbytes = 0
    for batch in loader:
        first = batch[0] if isinstance(batch, (list, tuple)) else batch
        arr = first.data if hasattr(first, "data") and not hasattr(first, "numpy") else first
        samples += arr.shape[0] if arr.ndim == 4 else 1
        nbytes += arr.nbytes
    return time.perf_counter() - start, samples, nbytes


def _time_handover(loader, warmup: int) -> float:
    """GB/s after `warmup` batches (workers started and slots mapped)."""
    it = iter(loader)
    for _ in range(warmup):
        next(it)
    start = time.perf_counter()
    nbytes = 0
    for batch in it:
        nbytes += batch.nbytes if hasattr(batch, "nbytes") else batch.data.nbytes
    return nbytes / (time.perf_counter() - start) / 1e9


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", action="store_true", help="run torch's DataLoader too")
    parser.add_argument("--repeats", type=int, default=5, help="rounds (median reported)")
    parser.add_argument("--records", type=int, default=4096, help="records per decode epoch")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--handover-batches", type=int, default=150)
    parser.add_argument("--workers", default="0,1,2", help="worker counts for the decode figure")
    args = parser.parse_args(argv)
    peers = ["shoal"]
    if args.compare:
        try:
            import torch

            torch.set_num_threads(1)
            peers.append("torch")
        except ImportError:
            print("torch is not installed: shoal alone")
    make = {"shoal": _shoal_loader, "torch": _torch_loader}
    rows = []

    dataset = DecodeDataset(make_records(args.records))
    print(f"decode: {args.records} records of {SHAPE} uint8 (zlib), batch {args.batch_size}, "
          f"{args.repeats} rounds")
    print(f"{'workers':>7} {'shoal samples/s':>16} {'torch samples/s':>16} {'ratio':>6}")
    for workers in [int(w) for w in args.workers.split(",")]:
        rates = {p: [] for p in peers}
        for _ in range(args.repeats):
            for peer in peers:
                seconds, samples, _ = _time_epoch(make[peer](dataset, workers, args.batch_size))
                rates[peer].append(samples / seconds)
        row = {"figure": "decode_samples_per_s", "workers": workers,
               **{p: _summary(v) for p, v in rates.items()}}
        if "torch" in rates:
            row["ratio"] = row["shoal"]["median"] / row["torch"]["median"]
        rows.append(row)
        torch_text = f"{row['torch']['median']:16.0f}" if "torch" in row else f"{'-':>16}"
        ratio = f"{row['ratio']:6.2f}" if "ratio" in row else f"{'-':>6}"
        print(f"{workers:>7} {row['shoal']['median']:16.0f} {torch_text} {ratio}")

    print(f"handover: {HANDOVER_BYTES >> 20} MiB batches, {args.handover_batches} per round")
    print(f"{'workers':>7} {'shoal GB/s':>11} {'torch GB/s':>11} {'ratio':>6}")
    for workers in (1, 2):
        rates = {p: [] for p in peers}
        for _ in range(args.repeats):
            for peer in peers:
                loader = make[peer](BigBatch(args.handover_batches), workers, None)
                rates[peer].append(_time_handover(loader, warmup=2 * workers))
        row = {"figure": "handover_GB_per_s", "workers": workers, "batch_bytes": HANDOVER_BYTES,
               **{p: _summary(v) for p, v in rates.items()}}
        if "torch" in rates:
            row["ratio"] = row["shoal"]["median"] / row["torch"]["median"]
        rows.append(row)
        torch_text = f"{row['torch']['median']:11.2f}" if "torch" in row else f"{'-':>11}"
        ratio = f"{row['ratio']:6.2f}" if "ratio" in row else f"{'-':>6}"
        print(f"{workers:>7} {row['shoal']['median']:11.2f} {torch_text} {ratio}")

    for row in rows:
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
