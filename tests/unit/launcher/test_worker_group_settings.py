"""What a worker started by `shoal run` does with the settings it is handed: the default
collective timeout (SHOAL_COLLECTIVE_TIMEOUT, from --collective-timeout) and clear errors for a
rank or world size that cannot be. (They sit here, beside the launcher's flags, because the
launcher is what sets them.)"""

import pytest

import shoal.collectives as dist
from shoal.collectives import env
from shoal.collectives.store.hash import HashStore


@pytest.fixture(autouse=True)
def _no_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("rank, size, message", [
    (-5, 2, r"rank must be in \[0, world_size\) = \[0, 2\), got -5"),
    (2, 2, r"rank must be in \[0, world_size\) = \[0, 2\), got 2"),
    (0, 0, r"world_size must be at least 1 \(the number of ranks in the group\), got 0"),
    (0, -3, r"world_size must be at least 1 .*got -3"),
])
def test_impossible_ranks_and_sizes_name_the_value_and_the_rule(rank, size, message):
    with pytest.raises(ValueError, match=message):
        dist.init_process_group("tcp", store=HashStore(), rank=rank, world_size=size, timeout=2)


def test_an_unset_rank_with_a_store_says_what_is_missing():
    with pytest.raises(ValueError, match=r"needs rank= and world_size= \(rank in \[0, world_size\), "
                                         r"world_size >= 1\); got rank=-1 and world_size=2 \(-1 means not given\)"):
        dist.init_process_group("tcp", store=HashStore(), rank=-1, world_size=2, timeout=2)


def test_env_init_checks_the_environment_values_too(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "0")
    with pytest.raises(ValueError, match=r"world_size must be at least 1 .*got 0 .*env://"):
        dist.init_process_group("tcp", init_method="env://", timeout=2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "7")
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size\) = \[0, 2\), got 7"):
        dist.init_process_group("tcp", init_method="env://", timeout=2)


def test_the_collective_timeout_variable_sets_the_groups_default(monkeypatch):
    monkeypatch.setenv("SHOAL_COLLECTIVE_TIMEOUT", "3.5")
    assert env.collective_timeout() == 3.5
    pg = dist.init_process_group("tcp", store=HashStore(), rank=0, world_size=1)
    assert pg.timeout == 3.5
    dist.destroy_process_group()
    pg = dist.init_process_group("tcp", store=HashStore(), rank=0, world_size=1, timeout=7)
    assert pg.timeout == 7  # an explicit timeout beats the variable


@pytest.mark.parametrize("raw", ["0", "-1", "soon", "inf", "nan"])
def test_a_bad_collective_timeout_variable_is_named(monkeypatch, raw):
    monkeypatch.setenv("SHOAL_COLLECTIVE_TIMEOUT", raw)
    with pytest.raises(ValueError, match=rf"SHOAL_COLLECTIVE_TIMEOUT must be a positive, finite "
                                         rf"number of seconds, got '{raw}'"):
        env.collective_timeout()


def test_without_the_variable_the_default_is_600s(monkeypatch):
    monkeypatch.delenv("SHOAL_COLLECTIVE_TIMEOUT", raising=False)
    pg = dist.init_process_group("tcp", store=HashStore(), rank=0, world_size=1)
    assert pg.timeout == 600.0
