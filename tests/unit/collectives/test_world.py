"""init_process_group, the backend registry and the module-level API."""

from __future__ import annotations

import numpy as np
import pytest

import shoal.collectives as c
from shoal.collectives.types import BackendUnavailable, CollectiveError
from shoal.collectives.store.hash import HashStore


@pytest.fixture(autouse=True)
def clean_world():
    yield
    c.destroy_process_group()


def test_single_rank_world_from_a_store():
    pg = c.init_process_group("tcp", store=HashStore(), rank=0, world_size=1, timeout=5)
    assert c.is_initialized() and c.get_rank() == 0 and c.get_world_size() == 1
    assert c.get_default_group() is pg and c.get_backend() == "tcp"
    a = np.arange(5.0)
    assert c.all_reduce(a, op=c.ReduceOp.AVG) is None
    np.testing.assert_array_equal(a, np.arange(5.0))
    outs = [np.empty(5)]
    work = c.all_gather(outs, a, async_op=True)
    assert work.wait(timeout=5) and (outs[0] == a).all()
    objs = [None]
    c.all_gather_object(objs, {"x": 1})
    assert objs == [{"x": 1}]
    c.barrier()
    c.destroy_process_group()
    assert not c.is_initialized()


def test_env_init_with_rank0_hosting_the_store(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "0")  # a world of one may let the kernel pick
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("SHOAL_USE_AGENT_STORE", raising=False)
    c.init_process_group(init_method="env://", timeout=10)
    assert c.get_world_size() == 1


def test_file_init_single_rank(tmp_path):
    c.init_process_group("tcp", init_method=f"file://{tmp_path}/store", rank=0, world_size=1, timeout=10)
    b = np.ones(3)
    c.broadcast(b, src=0)
    c.destroy_process_group()
    assert not (tmp_path / "store").exists()  # the last user removes the file


def test_setup_errors_are_clear(monkeypatch):
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="needs the environment variables MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE"):
        c.init_process_group(init_method="env://")
    with pytest.raises(ValueError, match="is not supported; use env://"):
        c.init_process_group(init_method="udp://x:1", rank=0, world_size=1)
    with pytest.raises(ValueError, match="needs rank= and world_size="):
        c.init_process_group(store=HashStore())
    with pytest.raises(BackendUnavailable, match="Unknown process-group backend 'mpi'"):
        c.init_process_group("mpi", store=HashStore(), rank=0, world_size=1)
    with pytest.raises(CollectiveError, match="not initialized"):
        c.all_reduce(np.ones(3))
    c.init_process_group(store=HashStore(), rank=0, world_size=1, timeout=5)
    with pytest.raises(CollectiveError, match="called twice"):
        c.init_process_group(store=HashStore(), rank=0, world_size=1)
    with pytest.raises(ValueError, match=r"src 3 is not a member of group 'default'"):
        c.broadcast(np.ones(2), src=3)


def test_nccl_without_cuda_says_so():
    from shoal.collectives.backends import registry

    if registry.check_backend_availability("nccl") is None:
        pytest.skip("a CUDA device is present")
    with pytest.raises(BackendUnavailable, match="backend 'nccl' needs a CUDA device; none was found"):
        c.init_process_group("nccl", store=HashStore(), rank=0, world_size=1)


def test_registered_backend_is_used():
    from shoal.collectives.backends.tcp.group import ProcessGroupTCP

    made = []

    def factory(store, rank, size, **kw):
        made.append(kw["name"])
        return ProcessGroupTCP(store, rank, size, **kw)

    c.register_backend("mine", factory)
    c.init_process_group("mine", store=HashStore(), rank=0, world_size=1, timeout=5)
    assert made == ["default"]
