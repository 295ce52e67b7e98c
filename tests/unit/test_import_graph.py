"""What each entry point imports, in a fresh interpreter: a process pays for what it uses.

`shoal run` starts with `import shoal.launcher.cli`, and every restart of a worker pays its own
imports again, so these bounds are what keeps launch and death-to-resumed short (issue 40):

- the launcher's CLI parses its flags with core's leaf modules (settings, config, errors,
  timeouts, netaddr) and the rendezvous rules, and nothing of collectives, rpc_agent,
  numpy, scipy or grpc; its agent then loads the store and the rendezvous, still no numpy;
- `import shoal.collectives` loads no numpy, tensor, scipy, grpc or rpc_agent (a store's user
  needs none of them); a process group then loads numpy, but not core's tensors or ops;
- `import shoal.core` loads nothing: the torch-like namespace builds on first use, and
  fft, linalg and special (scipy) load only when named.
"""

from __future__ import annotations

import json
import subprocess
import sys

# A fresh interpreter's start and imports; generous, since the machine may be loaded.
TIMEOUT_S = 60


def _modules_after(code: str) -> set[str]:
    """The names in sys.modules after running `code` in a fresh interpreter."""
    script = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=TIMEOUT_S, check=True)
    return set(json.loads(out.stdout.splitlines()[-1]))


def _loaded(modules: set[str], packages: tuple[str, ...]) -> list[str]:
    return sorted(m for m in modules if any(m == p or m.startswith(p + ".") for p in packages))


def test_the_launcher_cli_loads_no_collectives_compute_or_rpc() -> None:
    modules = _modules_after("import shoal.launcher.cli")
    assert not _loaded(modules, ("shoal.collectives", "shoal.rpc_agent", "numpy", "scipy",
                                 "grpc", "google.protobuf", "aetcd", "prometheus_client"))
    # core's leaf modules only: no tensor, ops or namespace (each of those loads numpy).
    core = {m for m in _loaded(modules, ("shoal.core",)) if m != "shoal.core"}
    assert core <= {"shoal.core.config", "shoal.core.errors", "shoal.core.netaddr",
                    "shoal.core.settings", "shoal.core.timeouts"}, sorted(core)
    # The job's secret (core.auth, cryptography) is read when a command runs, not to parse.
    assert not _loaded(modules, ("cryptography", "shoal.core.auth"))
    # The rendezvous' rules, not its handler, sealing or backends.
    elastic = set(_loaded(modules, ("shoal.elastic",)))
    assert elastic <= {"shoal.elastic", "shoal.elastic.api", "shoal.elastic.rendezvous",
                       "shoal.elastic.rendezvous.registry"}, sorted(elastic)


def test_the_agent_of_shoal_run_loads_no_numpy_scipy_grpc_or_rpc_agent() -> None:
    # What `shoal run` imports once its flags are parsed: the agent, the store, the rendezvous.
    modules = _modules_after("import shoal.launcher.job, shoal.launcher.rendezvous_setup\n"
                             "import shoal.elastic.rendezvous.store_backend")
    assert "shoal.collectives.store.tcp" in modules
    assert not _loaded(modules, ("numpy", "scipy", "grpc", "shoal.rpc_agent", "shoal.core.tensor",
                                 "shoal.collectives.api"))


def test_importing_collectives_loads_no_numpy_scipy_grpc_or_rpc_agent() -> None:
    modules = _modules_after("import shoal.collectives")
    assert not _loaded(modules, ("scipy", "grpc", "shoal.rpc_agent", "numpy", "shoal.core.tensor",
                                 "shoal.elastic", "shoal.launcher"))


def test_a_process_group_loads_no_scipy_grpc_or_rpc_agent() -> None:
    # What a worker of `shoal run` imports before its first all_reduce.
    modules = _modules_after("import shoal.collectives as dist\n"
                             "dist.init_process_group, dist.all_reduce\n"
                             "import shoal.collectives.backends.tcp.group")
    assert "numpy" in modules  # the check below is meaningful only if this loaded for real
    assert not _loaded(modules, ("scipy", "grpc", "shoal.rpc_agent", "shoal.elastic",
                                 "shoal.core.linalg", "shoal.core.fft", "shoal.core.special",
                                 "shoal.core.func"))
    # numpy arrays need none of core's tensors, nor the profiler's op instrumentation (the
    # ledger records into core.profiler.state; `profile` loads when a profiler is made).
    assert not _loaded(modules, ("shoal.core.tensor", "shoal.core.ops", "shoal.core.nn",
                                 "shoal.core.profiler.profile", "shoal.core.profiler.instrument"))


def test_importing_core_loads_nothing() -> None:
    assert not _loaded(_modules_after("import shoal.core"), ("numpy", "shoal.core.tensor"))


def test_cores_namespace_loads_no_scipy() -> None:
    modules = _modules_after("import shoal.core as core\ncore.Tensor, core.nn.Linear, core.add")
    assert "shoal.core.tensor" in modules
    assert not _loaded(modules, ("scipy", "shoal.core.linalg", "shoal.core.fft",
                                 "shoal.core.special", "shoal.core.func"))


def test_core_submodules_load_on_first_use() -> None:
    # `core.linalg.inv` and `from shoal.core import linalg` both work, before anything else
    # of core loaded, and name the same module.
    names = ["fft", "linalg", "special", "func", "jit", "vision", "utils"]
    code = "\n".join(["import shoal.core as core"]
                     + [f"from shoal.core import {n}\nassert {n} is core.{n}" for n in names]
                     + ["core.linalg.inv, core.fft.fft, core.special.erf"])
    modules = _modules_after(code)
    assert {f"shoal.core.{n}" for n in names} <= modules
