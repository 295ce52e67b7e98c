"""The distributed autograd examples under a real `shoal run`: each one's parameters after N
steps equal the same model trained in one process (float64, 1e-10), and every worker ends
with no live distributed autograd context."""

from __future__ import annotations

import numpy as np

from shoal.examples import ddp_rpc, model_parallel, parameter_server
from tests.support.shoal_run import ROOT, ShoalRun

RUN_S = 100.0


def _run(script: str, nproc: int, steps: int, out_dir) -> str:
    args = ["--nproc-per-node", str(nproc), str(ROOT / "examples" / script),
            "--steps", str(steps), "--out", str(out_dir)]
    with ShoalRun(args, name=f"shoal run {script}") as run:
        code = run.wait(RUN_S)
        output = run.output
    assert code == 0, f"{script} exited with {code}:\n{output[-4000:]}"
    return output


def _saved(out_dir) -> dict:
    params: dict = {}
    for path in sorted(out_dir.glob("rank*.npz")):
        params.update(dict(np.load(path)))
    return params


def _assert_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-10, err_msg=name)


def _live_counts(output: str) -> list[str]:
    return [line.split("live dist_autograd contexts: ", 1)[1]
            for line in output.splitlines() if "live dist_autograd contexts: " in line]


def test_model_parallel_equals_one_process(tmp_path):
    output = _run("model_parallel.py", 2, 6, tmp_path)
    _assert_equal(_saved(tmp_path), model_parallel.train_single_process(6))
    assert _live_counts(output) == ["worker0 0, worker1 0"]


def test_ddp_with_rpc_equals_one_process(tmp_path):
    output = _run("ddp_rpc.py", 3, 4, tmp_path)
    _assert_equal(_saved(tmp_path), ddp_rpc.train_single_process(4))
    # Both trainers' DDP replicas ended identical (one digest each, equal).
    digests = {line.split()[-1] for line in output.splitlines()
               if "final params_sha256" in line and "[rank 2]" not in line}
    assert len(digests) == 1, output[-3000:]
    assert sorted(_live_counts(output)) == ["ps 0", "trainer0 0", "trainer1 0"]


def test_parameter_server_equals_one_process(tmp_path):
    output = _run("parameter_server.py", 3, 4, tmp_path)
    _assert_equal(_saved(tmp_path), parameter_server.train_single_process(4, 2))
    assert sorted(_live_counts(output)) == ["ps 0", "trainer1 0", "trainer2 0"]
