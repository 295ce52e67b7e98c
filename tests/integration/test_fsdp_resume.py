"""`shoal run` restarts a fully_shard job from its sharded checkpoint, a later launch at
another world size trains on from it, and a node joining a `--nnodes 1:2` job makes the group
resume at twice the world size from the checkpoint the smaller group saved
(tests/integration/workers/fsdp_resume.py).

4 ranks train 2 steps, rank 1 dies after step 2's save, the agent restarts the group, which
resumes from step 2 and ends at step 4; then 3 ranks (another launch, the same checkpoint
directory and job secret) load the 4-rank checkpoint and train to step 6. The result equals one
process training 6 steps on the whole batches: float64, and what differs is only the order of
the reduce_scatter's sums (a few ulps) under Adam's update, which is bounded by lr per step, so
1e-9 holds with a wide margin.
"""

from __future__ import annotations

import importlib.util
import re
import uuid

import numpy as np

from shoal import core
from tests.support.shoal_run import WORKERS, ShoalRun

JOB_TIMEOUT = 120
WORKER = WORKERS / "fsdp_resume.py"


def _worker_module():
    spec = importlib.util.spec_from_file_location("fsdp_resume_worker", WORKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_restart_then_a_launch_at_another_world_size_resume_from_sharded_checkpoints(tmp_path):
    ck = str(tmp_path / "ck")
    env = {"SHOAL_AUTH_TOKEN": "fsdp-resume-secret"}
    first = ShoalRun(["--standalone", "--nproc-per-node", "4", "--max-restarts", "1",
                      "--checkpoint-dir", ck, str(WORKER), "--steps", "4", "--die-after", "2"],
                     env=env, name="4 ranks")
    with first:
        assert first.wait(JOB_TIMEOUT) == 0, first.tail()
    assert "rank 1 dies after step 2" in first.output, first.tail()
    assert "rank 0 of 4 resumed at step 2 from step-2" in first.output, first.tail()

    second = ShoalRun(["--standalone", "--nproc-per-node", "3", "--max-restarts", "0",
                       "--checkpoint-dir", ck, str(WORKER), "--steps", "6"],
                      env=env, name="3 ranks")
    with second:
        assert second.wait(JOB_TIMEOUT) == 0, second.tail()
    assert "rank 0 of 3 resumed at step 4 from step-4" in second.output, second.tail()

    final = core.load(tmp_path / "ck" / "final.safetensors")
    want = _worker_module().reference(6)
    assert sorted(final) == sorted(want)
    for name, value in want.items():
        np.testing.assert_allclose(final[name].numpy(), value, rtol=1e-9, atol=1e-10,
                                   err_msg=name)


def test_a_node_joining_resumes_the_job_at_twice_the_world_size(tmp_path):
    ck = str(tmp_path / "ck")
    env = {"SHOAL_AUTH_TOKEN": "fsdp-join-secret"}
    base = ["--nnodes", "1:2", "--nproc-per-node", "2", "--max-restarts", "3",
            "--rdzv-id", f"job-{uuid.uuid4().hex[:8]}",
            "--rdzv-conf", "heartbeat_interval=0.25,heartbeat_timeout=2,last_call_timeout=0.5",
            "--checkpoint-dir", ck]
    # Slow steps while 2 ranks train (a 10 s window for node B to start and join, however
    # loaded the machine), full speed once 4 do.
    worker = [str(WORKER), "--steps", "12", "--step-sleep", "1.0", "--sleep-below", "4"]
    a = ShoalRun(base + ["--rdzv-endpoint", "127.0.0.1:0", "--node-rank", "0"] + worker,
                 env=env, name="node A")
    with a:
        a.wait_for(r"step 2 saved at world size 2", JOB_TIMEOUT)
        b = ShoalRun(base + ["--rdzv-endpoint", f"127.0.0.1:{a.store_port()}",
                             "--node-rank", "1"] + worker, env=env, name="node B")
        with b:
            assert b.wait(JOB_TIMEOUT) == 0, b.tail()
            assert a.wait(JOB_TIMEOUT) == 0, a.tail()
    resumed = re.search(r"rank 0 of 4 resumed at step (\d+) from step-\d+", a.output)
    assert resumed and int(resumed.group(1)) >= 2, a.tail()
    assert "step 12 saved at world size 4" in a.output, a.tail()
    final = core.load(tmp_path / "ck" / "final.safetensors")
    for name, value in _worker_module().reference(12).items():
        np.testing.assert_allclose(final[name].numpy(), value, rtol=1e-9, atol=1e-10,
                                   err_msg=name)
