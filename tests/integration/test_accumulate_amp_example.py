"""examples/accumulate_amp.py under `shoal run`: gradient accumulation with no_sync, bf16
autocast and a GradScaler whose inf/NaN verdict every rank shares."""

from __future__ import annotations

import re

from tests.support.shoal_run import ROOT, ShoalRun

EXAMPLE = ROOT / "examples" / "accumulate_amp.py"


def test_accumulation_with_autocast_and_the_scaler_skips_together_and_learns(tmp_path):
    """Rank 0 alone sees a NaN at step 7: the step is skipped (the scale halves) and the two
    replicas still end bitwise equal; the loss falls over the run."""
    args = ["--standalone", "--nproc-per-node", "2", str(EXAMPLE), "--steps", "12",
            "--micro-batches", "3", "--overflow-at", "6"]
    with ShoalRun(args, name="accumulate_amp") as run:
        assert run.wait(120) == 0, run.tail()
    out = run.output
    assert re.search(r"step 7 loss \S+ scale 2048 skipped", out), out[-3000:]
    assert re.search(r"step 8 loss \S+ scale 1024\b", out), out[-3000:]
    digests = set(re.findall(r"rank \d params ([0-9a-f]{16})", out))
    assert len(digests) == 1 and len(re.findall(r"rank \d params", out)) == 2, out[-3000:]
    losses = [float(v) for v in re.findall(r"step \d+ loss (\S+)", out)]
    assert len(losses) == 12 and losses[-1] < 0.85 * losses[0], losses
