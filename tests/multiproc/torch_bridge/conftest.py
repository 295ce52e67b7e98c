"""Helpers of the torch bridge's multi-process tests: torch's own TCPStore, hosted by the test
process as an agent hosts one, and the environment that points the ranks' env:// at it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


@pytest.fixture
def torch_env():
    """The env for spawned ranks: torch's env:// joins a TCPStore this test bound on port 0."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the ranks are clients; nobody else binds
        "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TORCH_CPP_LOG_LEVEL": "ERROR",
    }
    del store


# torch's interpreter teardown takes seconds on a loaded 2-core machine (1.6 s measured for a
# plain gloo rank at load 12, 5-7 s for three ranks with several groups), past run_ranks' 30 s
# exit allowance when the whole suite runs beside other jobs. The ranks' results arrive before
# that; this allowance is only for the processes to be gone.
EXIT_ALLOWANCE_S = 120.0


@pytest.fixture
def run_torch_ranks():
    """`run_ranks` for torch ranks: the same checks, a longer allowance for exiting."""
    from tests.support.ranks import RankFailed, Ranks

    def run(target, world_size, timeout, env, args=()):
        with Ranks(target, world_size, args, env) as ranks:
            results = ranks.results(timeout)
            errors = {r: v for r, (s, v) in results.items() if s != "ok"}
            if errors:
                raise RankFailed("\n".join(f"rank {r} raised {t}: {m}\n{tb}"
                                           for r, (t, m, tb) in sorted(errors.items())))
            codes = ranks.join(EXIT_ALLOWANCE_S)
            bad = {r: c for r, c in codes.items() if c != 0}
            if bad:
                raise RankFailed(f"Ranks exited with non-zero codes: {bad}.")
            return [results[r][1] for r in range(world_size)]
    return run
