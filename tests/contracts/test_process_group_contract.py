"""Every process-group backend passes `ProcessGroupContract`: tcp in each local transport mode
(SHOAL_LOCAL_TRANSPORT=shm, unix, tcp), nccl over the stand-in runtime, and nccl on real GPUs
(skipped without cupy and enough devices). Ranks are threads of this process.

The numpy reference the contract compares with is itself checked against torch.distributed's
gloo backend (torch is the test oracle), on the same inputs, where torch is installed.
"""

from __future__ import annotations

import datetime

import numpy as np
import pytest

from shoal.collectives import ProcessGroupTCP
from shoal.collectives.backends.nccl import runtime as nccl_runtime
from tests.support.nccl_standin import FakeRuntime, dev, new_worlds
from tests.support.pg_contract import (
    DTYPES,
    ProcessGroupContract,
    np_dtype,
    ops_for,
    reduce_ref,
    sample,
)
from tests.support.thread_world import current_rank, on_threads, raise_first

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------------------- tcp

class _TCP(ProcessGroupContract):
    mode = "shm"
    more_dtypes = ("int8", "uint8", "int16", "complex64")

    def prepare(self, monkeypatch):
        monkeypatch.setenv("SHOAL_LOCAL_TRANSPORT", self.mode)

    def make_group(self, job, store, rank, size, *, name, global_ranks, timeout):
        return ProcessGroupTCP(store, rank, size, timeout=timeout, name=name,
                               global_ranks=global_ranks)


class TestTCPSharedMemory(_TCP):
    """Unix sockets between ranks, shared memory for large all_reduces (the default)."""

    mode = "shm"


class TestTCPUnixSockets(_TCP):
    mode = "unix"


class TestTCPLoopback(_TCP):
    mode = "tcp"


# ----------------------------------------------------------------------------- nccl

# What NCCL cannot see: it exchanges no description of a call, so ranks whose calls move the
# same bytes run them together, each with its own dtype and op.
_NCCL_RUNS_IT = (
    "nccl does not detect {what}: rank 2's {theirs} runs with the others' {mine} and no rank "
    "raises (NCCL compares no call descriptions; the watchdog looks only after a timeout)")
NCCL_MISMATCH_XFAILS = {
    "dtype of one size": _NCCL_RUNS_IT.format(
        what="a dtype mismatch of equal itemsize", theirs="all_reduce(int32[10])",
        mine="all_reduce(float32[10])"),
    "reduce op": _NCCL_RUNS_IT.format(
        what="a reduce-op mismatch", theirs="all_reduce(op=MAX)", mine="all_reduce(op=SUM)"),
}


class _NCCL(ProcessGroupContract):
    any_source_recv = False  # NCCL matches messages by peer
    tags_reorder = False  # and ignores tags
    more_dtypes = ("int8", "uint8", "complex64")
    refused_dtypes = ("int16", "uint16")
    mismatch_xfails = NCCL_MISMATCH_XFAILS


class TestNCCLStandIn(_NCCL):
    """ProcessGroupNCCL over tests.support.nccl_standin on CPU: its ordering, staging, Work,
    bootstrap and watchdog run for real; NCCL and CUDA are the stand-in's threads."""

    def device_array(self, x):
        return dev(x)

    def from_device(self, arr):
        return np.array(arr)  # the base class: a copy off the stand-in's "device"

    def start_job(self, world):
        worlds = new_worlds()
        return {r: FakeRuntime(worlds, device=r) for r in range(world)}

    def end_job(self, job):
        for rt in job.values():
            rt.close()

    def make_group(self, job, store, rank, size, *, name, global_ranks, timeout):
        from shoal.collectives.backends.nccl.group import ProcessGroupNCCL

        me = global_ranks[rank]
        return ProcessGroupNCCL(store, rank, size, timeout=timeout, name=name,
                                global_ranks=global_ranks, device=me, runtime=job[me])


def _gpu_count() -> int:
    if nccl_runtime.unavailable_reason() is not None:
        return 0
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


@pytest.mark.gpu
@pytest.mark.skipif(nccl_runtime.unavailable_reason() is not None,
                    reason=f"real nccl needs cupy, a CUDA device and NCCL: "
                           f"{nccl_runtime.unavailable_reason()}")
class TestNCCLOnGPUs(_NCCL):
    """The real runtime, one GPU per rank (rank r on cuda:r), numpy and Tensor inputs staged."""

    def device_array(self, x):
        import cupy

        if x.dtype == np_dtype("bfloat16"):
            return None  # cupy has no bfloat16 arrays; these stay on the host
        with cupy.cuda.Device(current_rank() or 0):  # rank r's group runs on cuda:r
            return cupy.asarray(x)

    def from_device(self, arr):
        import cupy

        cupy.cuda.Device(arr.device.id).synchronize()
        return cupy.asnumpy(arr)

    def start_job(self, world):
        count = _gpu_count()
        if count < world:
            pytest.skip(f"a world of {world} needs {world} GPUs (one per rank); this machine has {count}")
        return None

    def make_group(self, job, store, rank, size, *, name, global_ranks, timeout):
        from shoal.collectives.backends.nccl.group import ProcessGroupNCCL

        return ProcessGroupNCCL(store, rank, size, timeout=timeout, name=name,
                                global_ranks=global_ranks, device=global_ranks[rank])


# ----------------------------------------------------------------------------- the reference

@pytest.fixture(scope="module")
def gloo():
    """(torch, torch.distributed, groups(size) -> one ProcessGroupGloo per thread rank)."""
    torch = pytest.importorskip("torch")
    tdist = pytest.importorskip("torch.distributed")
    if not tdist.is_available() or not tdist.is_gloo_available():
        pytest.skip("this torch has no gloo backend")
    groups = {}

    def make(size):
        if size not in groups:
            store = tdist.HashStore()
            made = on_threads(lambda r: tdist.ProcessGroupGloo(
                store, r, size, datetime.timedelta(seconds=30)), range(size), 30)
            raise_first(made)
            groups[size] = [made[r] for r in range(size)]
        return groups[size]

    return torch, tdist, make


class TestReferenceAgreesWithTorchGloo:
    """The contract's numpy answers are torch gloo's answers, on the same inputs (ranks as
    threads of this process, each with its own ProcessGroupGloo over one HashStore)."""

    @staticmethod
    def _t(torch, x: np.ndarray):
        # torch has no ml_dtypes: bfloat16 travels as float32 bits' top half.
        if x.dtype == np_dtype("bfloat16"):
            return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(x.copy())

    @staticmethod
    def _n(t, dtype: str) -> np.ndarray:
        if dtype == "bfloat16":
            return t.float().numpy().astype(np_dtype("bfloat16"))
        return t.numpy()

    @staticmethod
    def _run(pgs, fn):
        out = on_threads(fn, range(len(pgs)), 30)
        raise_first(out)
        return [out[r] for r in range(len(pgs))]

    @pytest.mark.parametrize("size", (2, 3))
    @pytest.mark.parametrize("dtype", DTYPES)
    def test_reductions(self, gloo, size, dtype):
        torch, tdist, make = gloo
        pgs = make(size)
        cases = [(op, dst) for op in ops_for(dtype) for dst in range(size)]

        def body(r):
            got = []
            for i, (op, dst) in enumerate(cases):
                top = getattr(tdist.ReduceOp, op.name)
                t = self._t(torch, sample(r, (2, 3), dtype, salt=i))
                opts = tdist.AllreduceOptions()
                opts.reduceOp = top
                pgs[r].allreduce([t], opts).wait()
                red = self._t(torch, sample(r, (2, 3), dtype, salt=i))
                ropts = tdist.ReduceOptions()
                ropts.reduceOp, ropts.rootRank = top, dst
                pgs[r].reduce([red], ropts).wait()
                ins = [self._t(torch, sample(r, (2, 3), dtype, salt=100 * i + j)) for j in range(size)]
                out = self._t(torch, np.zeros((2, 3), np_dtype(dtype)))
                rsopts = tdist.ReduceScatterOptions()
                rsopts.reduceOp = top
                pgs[r].reduce_scatter([out], [ins], rsopts).wait()
                got.append((self._n(t, dtype), self._n(red, dtype), self._n(out, dtype)))
            return got

        results = self._run(pgs, body)
        for i, (op, dst) in enumerate(cases):
            want = reduce_ref([sample(q, (2, 3), dtype, salt=i) for q in range(size)], op)
            for r in range(size):
                all_reduced, reduced, scattered = results[r][i]
                what = f"rank {r}: {op.name} {dtype}"
                np.testing.assert_allclose(all_reduced.astype(np.float64), want.astype(np.float64),
                                           rtol=1e-2, err_msg="all_reduce " + what)
                if r == dst:  # off dst, gloo leaves partial results; shoal keeps the input
                    np.testing.assert_allclose(reduced.astype(np.float64), want.astype(np.float64),
                                               rtol=1e-2, err_msg="reduce " + what)
                rs_want = reduce_ref([sample(q, (2, 3), dtype, salt=100 * i + r) for q in range(size)], op)
                np.testing.assert_allclose(scattered.astype(np.float64), rs_want.astype(np.float64),
                                           rtol=1e-2, err_msg="reduce_scatter " + what)

    @pytest.mark.parametrize("size", (2, 3))
    def test_data_movement(self, gloo, size):
        torch, tdist, make = gloo
        pgs = make(size)
        last = size - 1

        def body(r):
            pg = pgs[r]
            b = torch.from_numpy(sample(r, (2, 3), "int64"))
            bo = tdist.BroadcastOptions()
            bo.rootRank = last
            pg.broadcast([b], bo).wait()
            outs = [torch.zeros(2, 3, dtype=torch.int64) for _ in range(size)]
            pg.allgather([outs], [torch.from_numpy(sample(r, (2, 3), "int64"))]).wait()
            go = tdist.GatherOptions()
            go.rootRank = 0
            gl = [[torch.zeros(2, 3, dtype=torch.int64) for _ in range(size)]] if r == 0 else []
            pg.gather(gl, [torch.from_numpy(sample(r, (2, 3), "int64"))], go).wait()
            so = tdist.ScatterOptions()
            so.rootRank = last
            sl = [[torch.from_numpy(sample(100 + j, (2, 3), "int64")) for j in range(size)]] if r == last else []
            s = torch.zeros(2, 3, dtype=torch.int64)
            pg.scatter([s], sl, so).wait()
            # all_to_all with per-pair sizes i + j + 1, as the contract's check sends them.
            send = np.concatenate([sample(10 * r + j, r + j + 1, "int64") for j in range(size)])
            recv = torch.zeros(sum(j + r + 1 for j in range(size)), dtype=torch.int64)
            pg.alltoall_base(recv, torch.from_numpy(send), [j + r + 1 for j in range(size)],
                             [r + j + 1 for j in range(size)]).wait()
            return b.numpy(), [o.numpy() for o in outs], [g.numpy() for g in gl[0]] if gl else None, \
                s.numpy(), recv.numpy()

        for r, (b, outs, gl, s, a2a) in enumerate(self._run(pgs, body)):
            np.testing.assert_array_equal(b, sample(last, (2, 3), "int64"))
            for q in range(size):
                np.testing.assert_array_equal(outs[q], sample(q, (2, 3), "int64"))
                if r == 0:
                    np.testing.assert_array_equal(gl[q], sample(q, (2, 3), "int64"))
            np.testing.assert_array_equal(s, sample(100 + r, (2, 3), "int64"))
            want = np.concatenate([sample(10 * j + r, j + r + 1, "int64") for j in range(size)])
            np.testing.assert_array_equal(a2a, want)
