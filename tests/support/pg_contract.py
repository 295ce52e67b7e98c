"""The contract every `collectives.ProcessGroup` backend passes: a mixin of checks over one hook.

A backend's test class subclasses `ProcessGroupContract` and provides (see `ContractHost`):

- `make_group(job, store, rank, size, *, name, global_ranks, timeout)`: one rank's group, built
  in that rank's thread; `global_ranks[rank]` is its world rank and `job` what `start_job` made;
- optionally `prepare(monkeypatch)` (environment read when groups form), `start_job(world)` and
  `end_job(job)` (state the ranks of one job share, such as a stand-in NCCL world), and
  `device_array(x)`/`from_device(arr)` where it takes device arrays (inputs then rotate through
  numpy, core.Tensor and device arrays);
- its differences from the common case: `any_source_recv`, `tags_reorder`, `more_dtypes`
  (reducible beyond the common families), `refused_dtypes` (reductions it refuses) and
  `mismatch_xfails` (mismatch cases it gets wrong, with the exact symptom: strict xfails).

Ranks are threads of the test process (`tests.support.thread_world`), each check forms fresh
groups (milliseconds), and every result is compared with numpy's answer computed here.
Semantics are torch.distributed's (gloo) where it defines them; where shoal differs it says so
beside the reference, and tests/contracts checks the reference itself against torch gloo:

- ReduceOp.AVG is the sum divided by the world size, for floating dtypes only (as ncclAvg; gloo
  in torch 2.13 agrees on floats).
- bool reduces as logic: SUM and MAX are "or", PRODUCT and MIN are "and" (as gloo and NCCL).
- reduce: only `dst` receives the result; every other rank keeps its input (NCCL's rule; gloo
  leaves partial results in the other ranks' tensors).
- gather/scatter: the list is given on `dst`/`src` only, None or empty elsewhere (as torch).
- all_to_all: `output_list[i]` receives rank i's `input_list[me]`; per-pair sizes may differ.
- send/recv match by peer and, where `tags_reorder`, by tag (NCCL matches by peer only).
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import Any, Protocol

import ml_dtypes
import numpy as np
import pytest

from shoal.collectives import distributed as dist
from shoal.collectives.api import ProcessGroup
from shoal.collectives.store.api import Store
from shoal.collectives.types import (
    CollectiveError,
    CollectiveMismatch,
    CollectiveTimeout,
    GroupDestroyed,
    ReduceOp,
)
from shoal.core.errors import ShapeError
from shoal.core.tensor import Tensor
from tests.support.thread_world import ThreadWorld

GROUP_TIMEOUT_S = 10.0  # every group's default: a bug fails in seconds instead of hanging
SHORT_S = 0.5  # timeouts of calls that are meant to time out
MISMATCH_TIMEOUT_S = 0.5  # backends that see a mismatch only when the call times out
SLACK_S = 5.0  # how much later than its timeout an error may arrive
WORLDS = (1, 2, 3)
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "bool")
TOLERANCE = {"float16": 1e-3, "bfloat16": 1e-2, "float32": 1e-6, "float64": 1e-12,
             "complex64": 1e-6}
LARGE = 600_001  # float32 past every size threshold of the tcp backend (ring, threads, shm)


# ----------------------------------------------------------------------------- data, references

def np_dtype(name: str) -> np.dtype:
    """The numpy dtype of a family name ("bfloat16" comes from ml_dtypes)."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def is_floating(name: str) -> bool:
    """True for the dtypes ReduceOp.AVG accepts."""
    return np_dtype(name).kind in "fc" or name == "bfloat16"


def ops_for(name: str) -> list[ReduceOp]:
    """Every reduction `name` supports (AVG needs a floating dtype, MIN/MAX a real one)."""
    ops = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG]
    if not is_floating(name):
        ops.remove(ReduceOp.AVG)
    if np_dtype(name).kind == "c":
        ops = [ReduceOp.SUM, ReduceOp.AVG]
    return ops


def sample(rank: int, shape, dtype: str, salt: int = 0) -> np.ndarray:
    """Small integers (exact in every dtype, so sums, products and extremes are exact too)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    rng = np.random.default_rng([rank, salt, int(np.prod(shape, dtype=np.int64))])
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    values = rng.integers(-3, 4, shape)
    if np_dtype(dtype).kind == "u":
        values = np.abs(values)
    if np_dtype(dtype).kind == "c":
        return (values + 1j * rng.integers(-3, 4, shape)).astype(dtype)
    return values.astype(np_dtype(dtype))


_LOGIC = {ReduceOp.SUM: np.logical_or, ReduceOp.MAX: np.logical_or,
          ReduceOp.PRODUCT: np.logical_and, ReduceOp.MIN: np.logical_and}
_UFUNC = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PRODUCT: np.multiply,
          ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}


def reduce_ref(parts: list[np.ndarray], op: ReduceOp) -> np.ndarray:
    """Rank 0 op rank 1 op ..., in a wide type, then cast back to the parts' dtype."""
    dt = parts[0].dtype
    if dt == np.bool_:
        acc = parts[0].copy()
        for p in parts[1:]:
            acc = _LOGIC[op](acc, p)
        return acc
    wide = np.complex128 if dt.kind == "c" else (
        np.float64 if dt.kind == "f" or dt == np_dtype("bfloat16") else np.int64)
    acc = parts[0].astype(wide)
    for p in parts[1:]:
        acc = _UFUNC[op](acc, p.astype(wide))
    if op is ReduceOp.AVG:
        acc = acc / len(parts)
    return acc.astype(dt)


def assert_matches(got, want: np.ndarray, what: str) -> None:
    """`got` (numpy or core.Tensor) has `want`'s dtype and shape, and its values (floats within
    the dtype's tolerance, everything else exactly)."""
    got = got.array if isinstance(got, Tensor) else got
    assert isinstance(got, np.ndarray), f"{what}: got a {type(got).__name__}"
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{what}: got {got.dtype}{list(got.shape)}, want {want.dtype}{list(want.shape)}")
    tol = TOLERANCE.get(want.dtype.name)
    if tol is None:
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        wide = np.complex128 if want.dtype.kind == "c" else np.float64
        np.testing.assert_allclose(got.astype(wide), want.astype(wide), rtol=tol, atol=tol,
                                   err_msg=what)


# ----------------------------------------------------------------------------- the host

class ContractHost(Protocol):
    """What a class mixing in ProcessGroupContract provides."""

    any_source_recv: bool
    tags_reorder: bool
    more_dtypes: tuple
    refused_dtypes: tuple
    mismatch_xfails: dict

    def make_group(self, job: Any, store: Store, rank: int, size: int, *, name: str,
                   global_ranks: list[int], timeout: float) -> ProcessGroup:
        """One rank's group (called in that rank's thread, every member at once)."""


def wait_for(predicate, within: float = SLACK_S) -> bool:
    """True once `predicate()` holds, polling (callbacks may run in another thread)."""
    end = time.monotonic() + within
    while not predicate():
        if time.monotonic() >= end:
            return False
        time.sleep(0.005)
    return True


# Mismatches: rank 2 of 3 deviates from the others, and is the root the others name where there
# is one (a rank whose own part of a mismatched call completes, such as a broadcast receiver
# served by the root it named, may return; its group fails at its next call). name -> (call, this rank's description,
# the deviating rank's description); each backend must name both.
MISMATCHES = {
    "shape": (lambda pg, dev, t: pg.all_reduce(np.ones(12 if dev else 10, np.float32), timeout=t),
              "all_reduce(float32[10], op=SUM)", "all_reduce(float32[12], op=SUM)"),
    "large shape": (lambda pg, dev, t: pg.all_reduce(np.ones(300_001 if dev else 300_000, np.float32),
                                                     timeout=t),
                    "all_reduce(float32[300000], op=SUM)", "all_reduce(float32[300001], op=SUM)"),
    "dtype": (lambda pg, dev, t: pg.all_reduce(np.ones(10, np.float64 if dev else np.float32),
                                               timeout=t),
              "all_reduce(float32[10], op=SUM)", "all_reduce(float64[10], op=SUM)"),
    "dtype of one size": (lambda pg, dev, t: pg.all_reduce(np.ones(10, np.int32 if dev else np.float32),
                                                           timeout=t),
                          "all_reduce(float32[10], op=SUM)", "all_reduce(int32[10], op=SUM)"),
    "reduce op": (lambda pg, dev, t: pg.all_reduce(np.ones(10, np.float32),
                                                   op=ReduceOp.MAX if dev else ReduceOp.SUM, timeout=t),
                  "op=SUM", "op=MAX"),
    "collective": (lambda pg, dev, t: pg.broadcast(np.ones(10, np.float32), src=2, timeout=t) if dev
                   else pg.all_reduce(np.ones(10, np.float32), timeout=t),
                   "all_reduce(float32[10], op=SUM)", "broadcast(float32[10], src=2)"),
    "root": (lambda pg, dev, t: pg.broadcast(np.ones(10, np.float32), src=0 if dev else 2, timeout=t),
             "broadcast(float32[10], src=2)", "broadcast(float32[10], src=0)"),
}


class ProcessGroupContract:
    """Mixin: the checks every process-group backend passes (the host: `ContractHost`)."""

    any_source_recv = True
    tags_reorder = True
    more_dtypes: tuple = ()
    refused_dtypes: tuple = ()
    mismatch_xfails: dict = {}

    def prepare(self, monkeypatch) -> None:
        """Set what the backend reads from the environment when a group forms."""

    def start_job(self, world: int) -> Any:
        return None

    def device_array(self, x: np.ndarray) -> Any:
        """`x` copied to the backend's device (a cupy array), or None where it has none."""
        return None

    def from_device(self, arr: Any) -> np.ndarray:
        """A device array's values on the host (once the calls that wrote it completed)."""
        return arr

    def as_input(self, x: np.ndarray, i: int) -> Any:
        """Input `i` as numpy, a core.Tensor over the same buffer, or a device array, in turn."""
        kind = i % 3
        if kind == 2:
            d = self.device_array(x)
            return x if d is None else d
        return Tensor(x) if kind == 1 else x

    def to_numpy(self, x: Any) -> np.ndarray:
        """What a call left in an input made by `as_input`, as numpy."""
        arr = x.array if isinstance(x, Tensor) else x
        return arr if type(arr) is np.ndarray else self.from_device(arr)

    def end_job(self, job: Any) -> None:
        pass

    @pytest.fixture(autouse=True)
    def _contract_env(self, monkeypatch, tmp_path):
        monkeypatch.setenv("SHOAL_DUMP_DIR", str(tmp_path))  # watchdog dumps of timed-out calls
        monkeypatch.delenv("SHOAL_ASYNC_ERROR_HANDLING", raising=False)
        monkeypatch.delenv("LOCAL_RANK", raising=False)
        self.prepare(monkeypatch)

    @pytest.fixture
    def world(self):
        """world(W) -> a ThreadWorld of W ranks with the default group formed."""
        made: list = []

        def make(size: int) -> ThreadWorld:
            job = self.start_job(size)
            made.append((None, job))
            w = ThreadWorld(lambda *a, **k: self.make_group(job, *a, **k), size, GROUP_TIMEOUT_S)
            made[-1] = (w, job)
            return w

        yield make
        for w, job in made:
            try:
                if w is not None:
                    w.close()
            finally:
                self.end_job(job)

    # ------------------------------------------------------------------ reductions

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("size", WORLDS)
    def test_all_reduce_matches_numpy(self, world, size, dtype):
        w = world(size)
        shapes = [(0,), (1,), (7,), (3, 5), (20_003,)] + ([(LARGE,)] if dtype == "float32" else [])
        cases = [(shape, op) for shape in shapes for op in ops_for(dtype)]

        def body(r):
            out = []
            for i, (shape, op) in enumerate(cases):
                x = self.as_input(sample(r, shape, dtype, salt=i), i)
                work = w.pgs[r].all_reduce(x, op=op)
                assert work.is_completed() and work.is_success()  # returned done, as torch's
                out.append(self.to_numpy(x))
            return out

        results = w.run(body)
        for i, (shape, op) in enumerate(cases):
            want = reduce_ref([sample(q, shape, dtype, salt=i) for q in range(size)], op)
            for r in range(size):
                assert_matches(results[r][i], want, f"rank {r}: all_reduce {op.name} {dtype}{shape}")

    @pytest.mark.parametrize("size", (2, 3))
    def test_all_reduce_results_agree_bitwise_across_ranks(self, world, size):
        w = world(size)
        cases = [(n, dt, op) for n in (1000, 20_003, LARGE) for dt in ("float32", "float16")
                 for op in (ReduceOp.SUM, ReduceOp.AVG)]

        def body(r):
            out = []
            for i, (n, dt, op) in enumerate(cases):
                x = np.random.default_rng([r, i]).standard_normal(n).astype(dt)
                w.pgs[r].all_reduce(x, op=op)
                out.append(x)
            return out

        results = w.run(body)
        for i, (n, dt, op) in enumerate(cases):
            parts = [np.random.default_rng([q, i]).standard_normal(n).astype(dt) for q in range(size)]
            want = reduce_ref(parts, op)
            np.testing.assert_allclose(results[0][i].astype(np.float64), want.astype(np.float64),
                                       rtol=1e-2 if dt == "float16" else 1e-5, atol=1e-2)
            for r in range(1, size):
                assert results[r][i].tobytes() == results[0][i].tobytes(), (
                    f"ranks 0 and {r} disagree on all_reduce {op.name} {dt}[{n}]")

    @pytest.mark.parametrize("size", WORLDS)
    def test_more_dtypes_reduce(self, world, size):
        if not self.more_dtypes:
            pytest.skip("this backend reduces no dtypes beyond the common families")
        w = world(size)
        cases = [(dt, op) for dt in self.more_dtypes for op in ops_for(dt)]

        def body(r):
            out = []
            for i, (dt, op) in enumerate(cases):
                x = sample(r, 9, dt, salt=i)
                w.pgs[r].all_reduce(x, op=op)
                out.append(x)
            return out

        results = w.run(body)
        for i, (dt, op) in enumerate(cases):
            want = reduce_ref([sample(q, 9, dt, salt=i) for q in range(size)], op)
            for r in range(size):
                assert_matches(results[r][i], want, f"rank {r}: all_reduce {op.name} {dt}")

    @pytest.mark.parametrize("size", WORLDS)
    def test_reduce_leaves_the_result_on_dst_only(self, world, size):
        w = world(size)
        cases = [(dt, op, dst) for dt in ("float32", "bfloat16", "int64", "bool")
                 for op in ops_for(dt) for dst in range(size)]

        def body(r):
            out = []
            for i, (dt, op, dst) in enumerate(cases):
                x = self.as_input(sample(r, (2, 3), dt, salt=i), i)
                w.pgs[r].reduce(x, dst=dst, op=op)
                out.append(self.to_numpy(x))
            return out

        results = w.run(body)
        for i, (dt, op, dst) in enumerate(cases):
            parts = [sample(q, (2, 3), dt, salt=i) for q in range(size)]
            for r in range(size):
                want = reduce_ref(parts, op) if r == dst else parts[r]
                assert_matches(results[r][i], want, f"rank {r}: reduce {op.name} {dt} dst={dst}")

    @pytest.mark.parametrize("size", WORLDS)
    def test_reduce_scatter_matches_numpy(self, world, size):
        w = world(size)
        cases = [(dt, shape, op) for dt in DTYPES for shape in ((2, 3), (0,))
                 for op in ops_for(dt)] + [("float32", (20_003,), ReduceOp.SUM)]

        def body(r):
            out = []
            for i, (dt, shape, op) in enumerate(cases):
                ins = [self.as_input(sample(r, shape, dt, salt=100 * i + j), j) for j in range(size)]
                o = self.as_input(np.zeros(shape, np_dtype(dt)), i)
                w.pgs[r].reduce_scatter(o, ins, op=op)
                out.append(self.to_numpy(o))
            return out

        results = w.run(body)
        for i, (dt, shape, op) in enumerate(cases):
            for r in range(size):
                want = reduce_ref([sample(q, shape, dt, salt=100 * i + r) for q in range(size)], op)
                assert_matches(results[r][i], want, f"rank {r}: reduce_scatter {op.name} {dt}{shape}")

    # ------------------------------------------------------------------ data movement

    @pytest.mark.parametrize("size", WORLDS)
    def test_broadcast_from_every_root(self, world, size):
        w = world(size)
        cases = [(dt, shape, src) for dt in DTYPES for shape in ((0,), (3, 5))
                 for src in range(size)] + [("float32", (LARGE,), size - 1)]

        def body(r):
            out = []
            for i, (dt, shape, src) in enumerate(cases):
                x = self.as_input(sample(r, shape, dt, salt=i), i)
                w.pgs[r].broadcast(x, src=src)
                out.append(self.to_numpy(x))
            return out

        results = w.run(body)
        for i, (dt, shape, src) in enumerate(cases):
            for r in range(size):
                assert_matches(results[r][i], sample(src, shape, dt, salt=i),
                               f"rank {r}: broadcast {dt}{shape} src={src}")

    @pytest.mark.parametrize("size", WORLDS)
    def test_all_gather_fills_the_list_in_rank_order(self, world, size):
        w = world(size)
        cases = [(dt, shape) for dt in DTYPES for shape in ((0,), (2, 3))] + [("float32", (20_003,))]

        def body(r):
            out = []
            for i, (dt, shape) in enumerate(cases):
                outs = [self.as_input(np.zeros(shape, np_dtype(dt)), i + j) for j in range(size)]
                w.pgs[r].all_gather(outs, self.as_input(sample(r, shape, dt, salt=i), i))
                out.append([self.to_numpy(o) for o in outs])
            return out

        results = w.run(body)
        for i, (dt, shape) in enumerate(cases):
            for r in range(size):
                for q in range(size):
                    assert_matches(results[r][i][q], sample(q, shape, dt, salt=i),
                                   f"rank {r}: all_gather {dt}{shape} part {q}")

    @pytest.mark.parametrize("size", WORLDS)
    def test_all_gather_into_tensor_stacks_in_rank_order(self, world, size):
        w = world(size)
        cases = [(dt, layout) for dt in DTYPES for layout in ("flat", "stacked")]

        def body(r):
            out = []
            for i, (dt, layout) in enumerate(cases):
                shape = (size * 6,) if layout == "flat" else (size, 2, 3)
                o = self.as_input(np.zeros(shape, np_dtype(dt)), i)
                w.pgs[r].all_gather_into_tensor(o, self.as_input(sample(r, (2, 3), dt, salt=i), i + 1))
                out.append(self.to_numpy(o))
            return out

        results = w.run(body)
        for i, (dt, layout) in enumerate(cases):
            want = np.stack([sample(q, (2, 3), dt, salt=i) for q in range(size)])
            want = want.reshape(-1) if layout == "flat" else want
            for r in range(size):
                assert_matches(results[r][i], want, f"rank {r}: all_gather_into_tensor {dt} {layout}")

    @pytest.mark.parametrize("size", WORLDS)
    def test_gather_fills_the_list_on_dst_only(self, world, size):
        w = world(size)
        cases = [(dt, dst) for dt in DTYPES for dst in range(size)]

        def body(r):
            out = []
            for i, (dt, dst) in enumerate(cases):
                x = sample(r, (2, 3), dt, salt=i)
                gl = [self.as_input(np.zeros((2, 3), np_dtype(dt)), j) for j in range(size)]
                # Non-destination ranks pass None or an empty list, as torch allows.
                given = gl if r == dst else (None if i % 2 else [])
                w.pgs[r].gather(self.as_input(x, i), given, dst=dst)
                out.append([self.to_numpy(g) for g in gl] if r == dst else None)
            return out

        results = w.run(body)
        for i, (dt, dst) in enumerate(cases):
            for q in range(size):
                assert_matches(results[dst][i][q], sample(q, (2, 3), dt, salt=i),
                               f"gather {dt} dst={dst} part {q}")

    @pytest.mark.parametrize("size", WORLDS)
    def test_scatter_from_every_src(self, world, size):
        w = world(size)
        cases = [(dt, src) for dt in DTYPES for src in range(size)]

        def body(r):
            out = []
            for i, (dt, src) in enumerate(cases):
                sl = ([self.as_input(sample(100 + j, (2, 3), dt, salt=i), j) for j in range(size)]
                      if r == src else None)
                o = self.as_input(np.zeros((2, 3), np_dtype(dt)), i)
                w.pgs[r].scatter(o, sl, src=src)
                out.append(self.to_numpy(o))
            return out

        results = w.run(body)
        for i, (dt, src) in enumerate(cases):
            for r in range(size):
                assert_matches(results[r][i], sample(100 + r, (2, 3), dt, salt=i),
                               f"rank {r}: scatter {dt} src={src}")

    @pytest.mark.parametrize("size", WORLDS)
    def test_all_to_all_routes_every_block(self, world, size):
        w = world(size)

        # Block (i -> j) has i + j + 1 elements, so per-pair sizes differ but a rank's own
        # block keeps its size, which every backend (NCCL included) supports.
        def block(i, j, dt, salt):
            return sample(10 * i + j, i + j + 1, dt, salt=salt)

        def body(r):
            out = []
            for i, dt in enumerate(DTYPES):
                ins = [self.as_input(block(r, j, dt, i), j) for j in range(size)]
                outs = [self.as_input(np.zeros(j + r + 1, np_dtype(dt)), j + 1) for j in range(size)]
                w.pgs[r].all_to_all(outs, ins)
                out.append([self.to_numpy(o) for o in outs])
            return out

        results = w.run(body)
        for i, dt in enumerate(DTYPES):
            for r in range(size):
                for j in range(size):
                    assert_matches(results[r][i][j], block(j, r, dt, i),
                                   f"rank {r}: all_to_all {dt} block from {j}")

    # ------------------------------------------------------------------ point to point

    @pytest.mark.parametrize("size", (2, 3))
    def test_send_recv_around_a_ring(self, world, size):
        w = world(size)

        def body(r):
            pg = w.pgs[r]
            right, left = (r + 1) % size, (r - 1) % size
            out = []
            for i, dt in enumerate(DTYPES):
                buf = self.as_input(np.zeros((2, 3), np_dtype(dt)), i)
                sw = pg.send(self.as_input(sample(r, (2, 3), dt, salt=i), i + 1), dst=right,
                             tag=i, async_op=True)
                rw = pg.recv(buf, src=left, tag=i, async_op=True)
                assert rw.wait(timeout=GROUP_TIMEOUT_S) and sw.wait(timeout=GROUP_TIMEOUT_S)
                out.append(self.to_numpy(buf))
            # The module-level calls on this group (world ranks = group ranks here).
            big = np.zeros(20_003, np.float32)
            if r % 2 == 0:
                dist.send(sample(r, 20_003, "float32"), dst=right, group=pg)
                got = dist.recv(big, src=left, group=pg)
            else:
                got = dist.recv(big, src=left, group=pg)
                dist.send(sample(r, 20_003, "float32"), dst=right, group=pg)
            assert got == left
            out.append(big)
            return out

        results = w.run(body)
        for r in range(size):
            left = (r - 1) % size
            for i, dt in enumerate(DTYPES):
                assert_matches(results[r][i], sample(left, (2, 3), dt, salt=i),
                               f"rank {r}: recv {dt} from {left}")
            assert_matches(results[r][-1], sample(left, 20_003, "float32"), f"rank {r}: dist.recv")

    def test_recv_from_any_source_names_the_sender(self, world):
        if not self.any_source_recv:
            pytest.skip("this backend matches point-to-point messages by peer only (src= required)")
        w = world(3)

        def body(r):
            pg = w.pgs[r]
            if r == 0:
                got = {}
                for _ in range(2):
                    buf = np.zeros(1, np.int64)
                    src = dist.recv(buf, src=None, group=pg)
                    got[src] = int(buf[0])
                return got
            pg.send(np.array([100 * r]), dst=0)
            return None

        assert w.run(body)[0] == {1: 100, 2: 200}

    def test_recv_matches_tags_out_of_order(self, world):
        if not self.tags_reorder:
            pytest.skip("this backend ignores tags (NCCL matches by peer and order only)")
        w = world(2)

        def body(r):
            pg = w.pgs[r]
            if r == 0:
                pg.send(np.arange(4, dtype=np.float32), dst=1, tag=7)
                pg.send(np.full(2, 5, np.int16), dst=1, tag=8)
                return None
            b8, b7 = np.zeros(2, np.int16), np.zeros(4, np.float32)
            pg.recv(b8, src=0, tag=8)
            pg.recv(b7, src=0, tag=7)
            return b8, b7

        b8, b7 = w.run(body)[1]
        assert_matches(b8, np.full(2, 5, np.int16), "recv tag 8")
        assert_matches(b7, np.arange(4, dtype=np.float32), "recv tag 7")

    # ------------------------------------------------------------------ barriers, objects

    @pytest.mark.parametrize("size", WORLDS)
    def test_barriers_and_object_collectives(self, world, size):
        w = world(size)

        def body(r):
            pg = w.pgs[r]
            assert pg.barrier(timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S)).is_completed()
            assert pg.barrier(async_op=True).wait(timeout=GROUP_TIMEOUT_S) is True
            assert pg.monitored_barrier(timeout=GROUP_TIMEOUT_S, wait_all_ranks=True) is None
            objs = pg.all_gather_object({"rank": r, "name": f"r{r}" * (r + 1)})
            lst = [("hello", 1), [1, 2, 3], None] if r == size - 1 else [None] * 3
            pg.broadcast_object_list(lst, src=size - 1)
            slots = [None] * size
            dist.all_gather_object(slots, r * 10, group=pg)
            return objs, lst, slots

        for objs, lst, slots in w.run(body):
            assert objs == [{"rank": q, "name": f"r{q}" * (q + 1)} for q in range(size)]
            assert lst == [("hello", 1), [1, 2, 3], None]
            assert slots == [10 * q for q in range(size)]

    @pytest.mark.parametrize("absent, wait_all, named", [((2,), False, "rank 2"),
                                                         ((1, 2), True, "ranks 1, 2")])
    def test_monitored_barrier_names_the_absent_ranks(self, world, absent, wait_all, named):
        w = world(3)
        present = [r for r in range(3) if r not in absent]

        def body(r):
            t0 = time.monotonic()
            with pytest.raises(CollectiveTimeout) as info:
                w.pgs[r].monitored_barrier(timeout=SHORT_S, wait_all_ranks=wait_all)
            return str(info.value), time.monotonic() - t0

        for r, (text, took) in zip(present, w.run(body, ranks=present)):
            assert f"{named} did not reach monitored_barrier" in text, f"rank {r}: {text}"
            assert took < SHORT_S + SLACK_S, f"rank {r} took {took:.1f}s"

    # ------------------------------------------------------------------ Work

    @pytest.mark.parametrize("size", (2, 3))
    def test_async_work_lifecycle(self, world, size):
        w = world(size)
        late = threading.Event()

        def body(r):
            pg = w.pgs[r]
            if r == size - 1:
                assert late.wait(GROUP_TIMEOUT_S), "rank 0 never let the late rank go"
            x = np.full(100, r + 1.0)
            work = pg.all_reduce(x, async_op=True)
            seen: list = []
            work.add_done_callback(seen.append)
            if r == 0:
                try:
                    assert not work.is_completed() and not work.is_success()
                    with pytest.raises(CollectiveTimeout, match="did not complete within the 0.05s"):
                        work.wait(timeout=0.05)
                    assert not work.is_completed() and work.exception() is None  # still running
                finally:
                    late.set()
            assert work.wait(timeout=GROUP_TIMEOUT_S) is True
            assert work.is_completed() and work.is_success() and work.exception() is None
            assert wait_for(lambda: work.is_completed() and seen == [work]), seen
            assert work.result()[0] is x
            after: list = []
            work.add_done_callback(after.append)  # already done: runs at once
            assert after == [work]
            # Several outstanding calls of mixed kinds, waited for in reverse order.
            arrays = [np.full(n, r + i, np.float32) for i, n in enumerate((10, 20_003, LARGE))]
            works = [pg.all_reduce(a, async_op=True) for a in arrays]
            b = np.full(5, r, np.int32)
            outs = [np.zeros(3, np.int64) for _ in range(size)]
            works.append(pg.broadcast(b, src=size - 1, async_op=True))
            works.append(pg.all_gather(outs, np.full(3, r, np.int64), async_op=True))
            works.append(pg.barrier(async_op=True))
            for wk in reversed(works):
                assert wk.wait(timeout=GROUP_TIMEOUT_S) is True
            return x, arrays, b, outs

        total = size * (size + 1) / 2
        for r, (x, arrays, b, outs) in enumerate(w.run(body)):
            assert_matches(x, np.full(100, total), f"rank {r}: async all_reduce")
            for i, a in enumerate(arrays):
                want = np.full(a.size, sum(q + i for q in range(size)), np.float32)
                assert_matches(a, want, f"rank {r}: outstanding all_reduce {i}")
            assert_matches(b, np.full(5, size - 1, np.int32), f"rank {r}: outstanding broadcast")
            for q in range(size):
                assert_matches(outs[q], np.full(3, q, np.int64), f"rank {r}: outstanding all_gather")

    def test_async_work_at_world_one_is_done_at_once(self, world):
        w = world(1)
        pg = w.pgs[0]
        x = np.arange(5.0)
        work = pg.all_reduce(x, op=ReduceOp.AVG, async_op=True)
        assert work.wait(timeout=GROUP_TIMEOUT_S) is True and work.is_success()
        assert work.result()[0] is x
        assert_matches(x, np.arange(5.0), "all_reduce at W=1")

    def test_failed_async_work_reports_its_exception(self, world):
        w = world(2)  # rank 1 never calls
        work = w.pgs[0].all_reduce(np.ones(3), async_op=True, timeout=SHORT_S)
        failed: list = []
        work.add_done_callback(failed.append)
        with pytest.raises(CollectiveTimeout, match="rank 1 never arrived"):
            work.wait(timeout=SHORT_S + SLACK_S)
        assert work.is_completed() and not work.is_success()
        assert isinstance(work.exception(), CollectiveTimeout)
        assert wait_for(lambda: failed == [work])
        with pytest.raises(CollectiveTimeout):
            work.wait()  # a failed Work keeps raising its error

    # ------------------------------------------------------------------ bad input

    @pytest.mark.parametrize("size", WORLDS)
    def test_bad_arguments_raise_exact_errors_and_submit_nothing(self, world, size):
        w = world(size)
        last = size - 1
        f64 = np.ones(3)
        ro = np.ones(3)
        ro.setflags(write=False)
        untouched = [np.full(3, 7.0) for _ in range(size)]
        cases = [
            (lambda pg: pg.all_reduce(np.ones((4, 4))[:, 1]), ValueError,
             r"^all_reduce tensor must be C-contiguous to be used in place \(shape \(4,\)"),
            (lambda pg: pg.all_reduce([1, 2, 3]), TypeError,
             r"^all_reduce tensor must be a numpy array, a cupy array, a core.Tensor or an object "
             r"exposing __dlpack__ or __array_interface__ .*, got list; for a Python list or number "
             r"pass np\.asarray\(\.\.\.\), which collectives then fill in place\.$"),
            (lambda pg: pg.all_reduce(np.array([object()])), TypeError,
             r"^all_reduce tensor has dtype object; collectives move numeric arrays only\.$"),
            (lambda pg: pg.all_reduce(np.ones(3, np.int32), op=ReduceOp.AVG), ValueError,
             r"^ReduceOp.AVG needs a floating-point dtype, got int32"),
            (lambda pg: pg.all_reduce(f64, op="median"), ValueError, r"^op must be one of ReduceOp.SUM"),
            (lambda pg: pg.all_reduce(ro), ValueError, r"^all_reduce tensor is read-only"),
            (lambda pg: pg.broadcast(f64, src=size), ValueError,
             rf"^broadcast src must be a rank in 0\.\.{last} of this group, got {size}\.$"),
            (lambda pg: pg.reduce(f64, dst=-1), ValueError,
             rf"^reduce dst must be a rank in 0\.\.{last} of this group, got -1\.$"),
            (lambda pg: pg.all_gather(untouched + [np.ones(3)], f64), ValueError,
             rf"^all_gather tensor_list must hold {size} arrays \(one per rank\), got {size + 1}\.$"),
            (lambda pg: pg.all_gather(untouched[:-1] + [np.ones(4)], f64), ShapeError,
             rf"^all_gather tensor_list\[{last}\] is float64\[4\] but the input tensor is float64\[3\]"),
            (lambda pg: pg.all_gather(untouched[:-1] + [np.ones(3, np.float32)], f64), ShapeError,
             rf"^all_gather tensor_list\[{last}\] is float32\[3\] but the input tensor is float64\[3\]"),
            (lambda pg: pg.all_gather_into_tensor(np.ones(2), f64), ShapeError,
             rf"^all_gather_into_tensor output is float64\[2\] but must hold {size} x float64\[3\]"),
            (lambda pg: pg.gather(f64, None, dst=0), ValueError,
             r"^gather needs gather_list on the destination rank 0\.$"),
            (lambda pg: pg.scatter(f64, None, src=0), ValueError,
             r"^scatter needs scatter_list on the source rank 0\.$"),
            (lambda pg: pg.reduce_scatter(f64, untouched[:-1] + [np.ones(2)]), ShapeError,
             rf"^reduce_scatter input_list\[{last}\] is float64\[2\] but the output tensor is float64\[3\]"),
            (lambda pg: pg.all_to_all([np.ones(2, np.float32)] * size, [np.ones(2)] * size), TypeError,
             r"^all_to_all output_list\[0\] is float32\[2\] but input_list\[0\] is float64\[2\]; "
             r"all arrays must share one dtype\.$"),
            (lambda pg: pg.send(f64, dst=0), ValueError, r"^Rank 0 cannot send to itself\.$"),
            (lambda pg: pg.recv(f64, src=0), ValueError, r"^Rank 0 cannot receive from itself\.$"),
            (lambda pg: pg.send(f64, dst=size), ValueError,
             rf"^send dst must be a rank in 0\.\.{last} of this group, got {size}\.$"),
        ]
        if size > 1:
            cases += [
                (lambda pg: pg.gather(f64, untouched, dst=last), ValueError,
                 rf"^gather_list must be None or empty on rank 0, which is not dst {last}\.$"),
                (lambda pg: pg.scatter(f64, untouched, src=last), ValueError,
                 rf"^scatter_list must be None or empty on rank 0, which is not src {last}\.$"),
                (lambda pg: pg.send(f64, dst=1, tag="seven"), ValueError,
                 r"^tag must be a 32-bit int, got 'seven'\.$"),
            ]
        if not self.any_source_recv:
            cases.append((lambda pg: pg.recv(f64, src=None), ValueError, r"cannot receive from any rank"))
        for dt in self.refused_dtypes:
            cases.append((lambda pg, dt=dt: pg.all_reduce(np.ones(3, dt)), TypeError,
                          rf"^all_reduce: .*cannot reduce {dt} arrays"))

        pg = w.pgs[0]
        for i, (call, exc_type, pattern) in enumerate(cases):
            with pytest.raises(exc_type, match=pattern) as info:
                call(pg)
            assert type(info.value) is exc_type, f"case {i}: {type(info.value).__name__}: {info.value}"
        for u in untouched:
            assert_matches(u, np.full(3, 7.0), "an output of a refused call")

        # Nothing was submitted on rank 0: every rank is still in step.
        def body(r):
            x = np.full(4, r + 1.0)
            w.pgs[r].all_reduce(x)
            return x

        for r, x in enumerate(w.run(body)):
            assert_matches(x, np.full(4, size * (size + 1) / 2), f"rank {r}: all_reduce after refusals")

    @pytest.mark.parametrize("case", sorted(MISMATCHES))
    def test_mismatched_calls_raise_collective_mismatch_naming_both(self, world, case, request):
        reason = self.mismatch_xfails.get(case)
        if reason:
            request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
        call, mine, theirs = MISMATCHES[case]
        w = world(3)

        # The deviating rank's own timeout expires last: its diagnosis must not depend on
        # whether the others, which time out first, have already failed.
        def body(r):
            call(w.pgs[r], r == 2, 2 * MISMATCH_TIMEOUT_S if r == 2 else MISMATCH_TIMEOUT_S)

        outcomes = w.outcomes(body, timeout=2 * MISMATCH_TIMEOUT_S + 2 * SLACK_S)
        for r, exc in enumerate(outcomes):
            assert isinstance(exc, CollectiveMismatch), f"rank {r}: {exc!r}"
            text = str(exc)
            assert mine in text and theirs in text, f"rank {r}: {text}"
            assert f"Rank {r}" in text and "group 'default'" in text, f"rank {r}: {text}"
        # The group stays failed: the next call fails at once.
        with pytest.raises(CollectiveError):
            w.pgs[0].barrier(timeout=SHORT_S)

    # ------------------------------------------------------------------ timeouts, failures

    @pytest.mark.parametrize("size, absent", [(2, (1,)), (3, (2,)), (3, (1, 2))])
    def test_timeout_names_the_ranks_that_never_arrived(self, world, size, absent):
        w = world(size)
        present = [r for r in range(size) if r not in absent]
        named = ("rank " if len(absent) == 1 else "ranks ") + ", ".join(map(str, absent))

        def body(r):
            t0 = time.monotonic()
            with pytest.raises(CollectiveTimeout) as info:
                w.pgs[r].all_reduce(np.ones(10, np.float32), timeout=SHORT_S)
            return str(info.value), time.monotonic() - t0

        for r, (text, took) in zip(present, w.run(body, ranks=present)):
            assert f"{named} never arrived" in text, f"rank {r}: {text}"
            assert f"Rank {r}" in text and "all_reduce #1" in text and "group 'default'" in text, text
            assert f"{SHORT_S:g}s" in text, text
            assert took < SHORT_S + SLACK_S, f"rank {r} took {took:.1f}s"

    @pytest.mark.parametrize("size", (2, 3))
    def test_abort_fails_this_rank_at_once_and_the_others_within_their_timeout(self, world, size):
        w = world(size)
        w.pgs[0].abort()
        with pytest.raises(CollectiveError):
            w.pgs[0].all_reduce(np.ones(3))

        def body(r):
            t0 = time.monotonic()
            with pytest.raises(CollectiveError):
                w.pgs[r].all_reduce(np.ones(3), timeout=SHORT_S)
            return time.monotonic() - t0

        for r, took in zip(range(1, size), w.run(body, ranks=range(1, size))):
            assert took < SHORT_S + SLACK_S, f"rank {r} took {took:.1f}s"

    @pytest.mark.parametrize("size", (1, 2))
    def test_a_destroyed_group_refuses_work(self, world, size):
        w = world(size)
        w.run(lambda r: w.pgs[r].shutdown())
        for pg in w.pgs:
            pg.shutdown()  # a second shutdown is a no-op
            with pytest.raises(GroupDestroyed, match="after it was destroyed"):
                pg.all_reduce(np.ones(3))

    # ------------------------------------------------------------------ subgroups

    def test_new_group_subsets_work_beside_the_world(self, world):
        w = world(3)
        sub = w.form([0, 2], "group1")  # what new_group([0, 2]) builds on its members
        solo = w.form([1], "group2")

        def body(r):
            pg = w.pgs[r]
            res = {}
            x = np.full(3, r + 1.0)
            pg.all_reduce(x)
            res["world"] = x
            if r in sub:
                g = sub[r]
                assert (g.rank(), g.size()) == ([0, 2].index(r), 2)
                y = np.full(4, r + 1.0)
                g.all_reduce(y)
                res["sub all_reduce"] = y
                # Module-level calls take world ranks and translate them to the group's.
                b = np.full(2, r, np.int64)
                dist.broadcast(b, src=2, group=g)
                res["sub broadcast"] = b
                red = np.full(2, r + 1, np.int32)
                dist.reduce(red, dst=2, op=ReduceOp.MAX, group=g)
                res["sub reduce"] = red
                gl = [np.zeros(1, np.int32) for _ in range(2)] if r == 0 else None
                dist.gather(np.array([r], np.int32), gl, dst=0, group=g)
                res["sub gather"] = gl
                s = np.zeros(1)
                dist.scatter(s, [np.array([0.5]), np.array([2.5])] if r == 2 else None, src=2, group=g)
                res["sub scatter"] = s
                m = np.zeros(3)
                if r == 0:
                    dist.send(np.full(3, 9.0), dst=2, group=g)
                else:
                    dist.recv(m, src=0, group=g)
                res["sub p2p"] = m
                with pytest.raises(ValueError, match=r"src 1 is not a member of group 'group1'"):
                    dist.broadcast(b, src=1, group=g)
            else:
                g = solo[r]
                z = np.full(2, 5.0)
                g.all_reduce(z, op=ReduceOp.AVG)
                res["solo"] = z
            x2 = np.full(1, 10.0 * r)
            pg.all_reduce(x2, op=ReduceOp.MAX)  # the world group is still in step
            res["world after"] = x2
            return res

        out = w.run(body)
        for r in range(3):
            assert_matches(out[r]["world"], np.full(3, 6.0), f"rank {r}: world")
            assert_matches(out[r]["world after"], np.full(1, 20.0), f"rank {r}: world after")
        for r in (0, 2):
            assert_matches(out[r]["sub all_reduce"], np.full(4, 4.0), f"rank {r}: sub all_reduce")
            assert_matches(out[r]["sub broadcast"], np.full(2, 2, np.int64), f"rank {r}: sub broadcast")
            assert_matches(out[r]["sub scatter"], np.array([0.5 if r == 0 else 2.5]), f"rank {r}: scatter")
        assert_matches(out[2]["sub reduce"], np.full(2, 3, np.int32), "sub reduce on dst")
        assert_matches(out[0]["sub reduce"], np.full(2, 1, np.int32), "sub reduce off dst")
        assert [int(v[0]) for v in out[0]["sub gather"]] == [0, 2]
        assert_matches(out[2]["sub p2p"], np.full(3, 9.0), "sub p2p")
        assert_matches(out[1]["solo"], np.full(2, 5.0), "a group of one")
