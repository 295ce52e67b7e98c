"""A GradScaler's state travels in elastic checkpoints (untrusted reader, no allowed globals)."""

from shoal import core
from shoal.core.amp import GradScaler
from shoal.elastic.checkpoint import Checkpointer


def test_grad_scaler_state_round_trips_through_an_elastic_checkpoint(tmp_path):
    model = core.nn.Linear(3, 2)
    opt = core.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    for _ in range(3):  # two clean steps grow the scale, the third starts the tracker again
        opt.zero_grad()
        scaler.scale(model(core.ones(1, 3)).sum()).backward()
        scaler.step(opt)
        scaler.update()
    ckpt = Checkpointer(str(tmp_path), token="job-secret")
    ckpt.save(3, {"model": model.state_dict(), "scaler": scaler.state_dict()})
    step, state = ckpt.load_latest()
    restored = GradScaler("cpu")
    restored.load_state_dict(state["scaler"])
    assert step == 3 and restored.state_dict() == scaler.state_dict()
    assert restored.get_scale() == 2048.0 and restored.state_dict()["_growth_tracker"] == 1
