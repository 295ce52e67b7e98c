"""examples/dp_sgd.py under `shoal run` with two ranks: per-sample gradients from vmap equal a
loop over samples, clipped and noised sums averaged by DDP keep the replicas equal, and the
model learns despite the noise."""

from __future__ import annotations

import re

from tests.support.shoal_run import ROOT, ShoalRun

EXAMPLE = ROOT / "examples" / "dp_sgd.py"


def test_dp_sgd_under_ddp_learns_and_keeps_replicas_equal(tmp_path):
    args = ["--standalone", "--nproc-per-node", "2", str(EXAMPLE), "--steps", "30"]
    with ShoalRun(args, name="dp_sgd") as run:
        assert run.wait(120) == 0, run.tail()
    out = run.output
    check = re.search(r"max \|vmap - loop\| = (\S+)", out)
    # float32 per-sample gradients of a 16-32-3 MLP: the batched GEMMs and the loop's sum in
    # another order, a few ulp of values below 1 (1.2e-7 each)
    assert check and float(check.group(1)) < 1e-5, out[-3000:]
    digests = set(re.findall(r"rank \d params ([0-9a-f]{16})", out))
    assert len(digests) == 1 and len(re.findall(r"rank \d params", out)) == 2, out[-3000:]
    losses = [float(v) for v in re.findall(r"step \d+ loss (\S+)", out)]
    clipped = [float(v) for v in re.findall(r"clipped (\S+)", out)]
    assert len(losses) == 30 and len(clipped) == 30, out[-3000:]
    # the mean of the last five against the first five: noise moves single steps by ~0.1
    assert sum(losses[-5:]) < 0.75 * sum(losses[:5]), losses
    assert clipped[0] > 0.5  # the bound is active: early gradients exceed it
