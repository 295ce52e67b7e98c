"""The generic Join protocol with a small Joinable of its own (DDP's hook is tested elsewhere).

The joinable sums one number per iteration across ranks with all_reduce; a rank that has run
out of iterations shadows that all_reduce with 0 in its join hook, so the ranks still iterating
see the sum of their own contributions only.
"""

from __future__ import annotations

import numpy as np
import pytest

from shoal.collectives.ddp.join import EarlyTermination, Join, JoinHook, Joinable
from test_ddp_threaded import run_ranks


class _SumHook(JoinHook):
    def __init__(self, joinable: "Summer") -> None:
        self.joinable = joinable

    def main_hook(self) -> None:
        self.joinable.group.all_reduce(np.zeros(1))  # shadow one iteration's collective
        self.joinable.shadowed += 1

    def post_hook(self, is_last_joiner: bool) -> None:
        self.joinable.last_joiner = is_last_joiner


class Summer(Joinable):
    """all_reduces one value per iteration; records what it saw."""

    def __init__(self, group) -> None:
        super().__init__()
        self.group = group
        self.sums: list[float] = []
        self.remaining: list = []
        self.shadowed = 0
        self.last_joiner = None

    def step(self, value: float) -> None:
        self.remaining.append(Join.notify_join_context(self))
        buf = np.array([value])
        self.group.all_reduce(buf)
        self.sums.append(float(buf[0]))

    def join_hook(self, **kwargs) -> JoinHook:
        return _SumHook(self)

    @property
    def join_device(self):
        return "cpu"

    @property
    def join_process_group(self):
        return self.group


def test_joined_ranks_shadow_until_everyone_is_done():
    iterations = [1, 3, 2]

    def body(group):
        summer = Summer(group)
        with Join([summer]):
            for _ in range(iterations[group.rank()]):
                summer.step(10.0 ** group.rank())
        return summer.sums, summer.remaining, summer.shadowed, summer.last_joiner

    results = run_ranks(3, body)
    # Iteration 0: all three ranks add 1 + 10 + 100; iteration 1: ranks 1 and 2; then rank 1.
    assert results[1][0] == [111.0, 110.0, 10.0]
    assert results[2][0] == [111.0, 110.0]
    assert [r[1] for r in results] == [[3], [3, 2, 1], [3, 2]]
    assert [r[2] for r in results] == [2, 0, 1]  # iterations shadowed after joining
    assert [r[3] for r in results] == [False, True, False]  # rank 1 joined last


def test_throw_on_early_termination_raises_everywhere():
    def body(group):
        summer = Summer(group)
        with pytest.raises(EarlyTermination, match="exhausted"):
            with Join([summer], throw_on_early_termination=True):
                for _ in range(1 if group.rank() == 0 else 3):
                    summer.step(1.0)

    run_ranks(2, body)


def test_disabled_join_does_not_communicate():
    def body(group):
        summer = Summer(group)
        with Join([summer], enable=False):
            summer.step(1.0)
        return summer.remaining

    assert run_ranks(2, body) == [[None], [None]]


def test_join_rejects_bad_joinables():
    class Forgetful(Summer):
        def __init__(self, group) -> None:  # never calls Joinable.__init__
            self.group = group

    def body(group):
        with pytest.raises(ValueError, match="at least one Joinable"):
            Join([])
        with pytest.raises(TypeError, match="never called Joinable.__init__"):
            Join([Forgetful(group)])
        other = Summer(object())
        with pytest.raises(ValueError, match="same process group"):
            Join([Summer(group), other])

    run_ranks(1, body)


def test_an_exception_in_the_block_propagates_without_shadowing():
    def body(group):
        summer = Summer(group)
        with pytest.raises(KeyError):
            with Join([summer]):
                raise KeyError("boom")
        assert not summer._join_config.enable  # reset on the way out
        return len(group.ops)

    assert run_ranks(2, body) == [0, 0]
