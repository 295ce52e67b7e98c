"""torch.distributed's module-level names that need no group: Backend, DebugLevel, the is_*
answers, get_node_local_rank and the WORLD attributes, each checked against torch in the same
process where torch is installed."""

from __future__ import annotations

import pytest

import shoal.collectives as dist
from shoal.collectives import debug
from shoal.collectives.store.hash import HashStore


@pytest.fixture
def torch_dist():
    torch_dist = pytest.importorskip("torch.distributed")
    if not torch_dist.is_available():
        pytest.skip("this torch has no torch.distributed")
    return torch_dist


@pytest.fixture(autouse=True)
def clean_world():
    yield
    dist.destroy_process_group()


def test_backend_names_as_torch(torch_dist):
    for name in ("gloo", "GLOO", "nccl", "Nccl", "mpi", "foo"):
        assert dist.Backend(name) == torch_dist.Backend(name)
    for attr in ("GLOO", "NCCL", "MPI", "UCC", "UNDEFINED"):
        assert getattr(dist.Backend, attr) == getattr(torch_dist.Backend, attr)
    with pytest.raises(ValueError, match="Backend name must be a str, got int"):
        dist.Backend(3)
    with pytest.raises(ValueError):
        torch_dist.Backend(3)


def test_debug_level_from_the_environment(torch_dist, monkeypatch):
    monkeypatch.delenv("SHOAL_DISTRIBUTED_DEBUG", raising=False)
    for value in ("OFF", "INFO", "DETAIL"):
        monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", value)
        debug.set_debug_level_from_env()
        torch_dist.set_debug_level_from_env()
        assert dist.get_debug_level().name == torch_dist.get_debug_level().name == value
        assert dist.get_debug_level() == getattr(dist.DebugLevel, value)
    monkeypatch.setenv("SHOAL_DISTRIBUTED_DEBUG", "info")  # shoal's own variable wins
    debug.set_debug_level_from_env()
    assert dist.get_debug_level() is dist.DebugLevel.INFO
    monkeypatch.setenv("SHOAL_DISTRIBUTED_DEBUG", "loud")
    with pytest.raises(ValueError, match="must be one of OFF, INFO or DETAIL, got 'LOUD'"):
        debug.set_debug_level_from_env()
    monkeypatch.delenv("SHOAL_DISTRIBUTED_DEBUG")
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG")
    debug.set_debug_level_from_env()
    torch_dist.set_debug_level_from_env()
    assert dist.get_debug_level() is dist.DebugLevel.OFF


def test_availability_and_launch_answers(torch_dist, monkeypatch):
    assert dist.is_available() and dist.is_gloo_available()
    assert dist.is_gloo_available() == torch_dist.is_gloo_available()
    assert dist.is_mpi_available() is False and dist.is_ucc_available() is False
    assert isinstance(dist.is_nccl_available(), bool)  # True only with cupy, a GPU and NCCL
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert dist.is_torchelastic_launched() is torch_dist.is_torchelastic_launched() is False
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")  # what shoal run sets
    assert dist.is_torchelastic_launched() is torch_dist.is_torchelastic_launched() is True


def test_node_local_rank(torch_dist, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(RuntimeError, match="LOCAL_RANK is not in the environment"):
        torch_dist.get_node_local_rank()
    with pytest.raises(RuntimeError, match="LOCAL_RANK is not in the environment"):
        dist.get_node_local_rank()
    assert dist.get_node_local_rank(fallback_rank=3) == torch_dist.get_node_local_rank(fallback_rank=3) == 3
    monkeypatch.setenv("LOCAL_RANK", "2")
    assert dist.get_node_local_rank(fallback_rank=3) == torch_dist.get_node_local_rank(fallback_rank=3) == 2


def test_world_follows_the_default_group():
    assert dist.group.WORLD is None and dist.GroupMember.WORLD is None
    pg = dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1, timeout=5)
    assert dist.group.WORLD is pg and dist.GroupMember.WORLD is pg
    assert dist.get_backend() == dist.get_backend(dist.group.WORLD) == "gloo"  # not "tcp"
    assert dist.get_rank(dist.group.WORLD) == 0
    sub = dist.new_group([0])
    assert dist.get_backend(sub) == "gloo"
    assert dist.get_group_rank(sub, 0) == 0 and dist.get_global_rank(sub, 0) == 0
    with pytest.raises(ValueError, match="Global rank 1 is not part of group"):
        dist.get_group_rank(sub, 1)
    with pytest.raises(ValueError, match="Group rank 1 is not part of group"):
        dist.get_global_rank(sub, 1)
    mine, every = dist.new_subgroups(group_size=1)
    assert every == [mine] and dist.get_process_group_ranks(mine) == [0]
    with pytest.raises(ValueError, match=r"The world size \(1\) must be divisible by group_size \(2\)"):
        dist.new_subgroups(group_size=2)
    dist.destroy_process_group()
    assert dist.group.WORLD is None
    dist.init_process_group("tcp", store=HashStore(), rank=0, world_size=1, timeout=5)
    assert dist.get_backend() == "tcp"


def test_init_takes_torchs_keyword_arguments(torch_dist):
    import inspect

    theirs = set(inspect.signature(torch_dist.init_process_group).parameters)
    ours = set(inspect.signature(dist.init_process_group).parameters)
    assert {p for p in theirs if not p.startswith("_")} <= ours, theirs - ours
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1, timeout=5,
                            pg_options=None, device_id=None)
    assert dist.get_world_size() == 1


def test_module_level_functions_take_torchs_parameter_names(torch_dist):
    """Every parameter torch's function has, shoal's has by the same name (a torch script
    passing keywords runs unchanged)."""
    import inspect

    checked = 0
    for name in dist.distributed.__all__:
        theirs = getattr(torch_dist, name, None)
        if theirs is None or not callable(theirs) or inspect.isclass(theirs):
            continue
        try:
            their_params = inspect.signature(theirs).parameters
        except (TypeError, ValueError):
            continue  # a builtin without a signature
        ours = inspect.signature(getattr(dist, name)).parameters
        missing = [p for p, v in their_params.items() if not p.startswith("_")
                   and v.kind not in (v.VAR_KEYWORD, v.VAR_POSITIONAL) and p not in ours]
        assert not missing, f"{name} lacks torch's {missing}"
        checked += 1
    assert checked >= 40, checked
