"""The plain torch examples (examples/torch/: DDP and FSDP2) run unchanged under `shoal run` on the
"shoal" backend, and end with every rank holding the same parameters (the scripts check it)."""

from __future__ import annotations

import pytest

from tests.support.shoal_run import ROOT, ShoalRun


@pytest.mark.parametrize("script, done", [("ddp.py", "ddp done"), ("fsdp2.py", "fsdp2 done")])
def test_a_torch_example_runs_on_the_shoal_backend_under_shoal_run(tmp_path, script, done):
    args = ["--nproc-per-node", "2", str(ROOT / "examples" / "torch" / script),
            "--backend", "shoal", "--steps", "4"]
    env = {"OMP_NUM_THREADS": "1", "SHOAL_DUMP_DIR": str(tmp_path), "TORCH_CPP_LOG_LEVEL": "ERROR"}
    with ShoalRun(args, env=env) as run:
        assert run.wait(120) == 0, run.tail()
        assert f"{done}: 2 ranks, 4 steps, backend shoal" in run.output, run.tail()
