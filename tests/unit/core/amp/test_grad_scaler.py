"""core.amp.GradScaler with torch.amp.GradScaler as the oracle: scale sequence, skipped steps,
final parameters over a scripted pattern of inf/NaN gradients; the misuse errors torch raises."""

import numpy as np
import pytest

from shoal import core
from shoal.core.amp import GradScaler

torch = pytest.importorskip("torch")

# step -> [(which parameter, value)] injected into the scaled gradients after backward.
_PATTERN = {
    2: [("a.weight", float("inf"))],          # only the first optimizer overflows
    5: [("b.bias", float("nan"))],            # only the second
    7: [("a.bias", float("-inf")), ("b.weight", float("inf"))],
    8: [("a.weight", float("nan"))],
}
_STEPS = 16


def _models():
    core.manual_seed(0)
    ours = {"a": core.nn.Linear(4, 3), "b": core.nn.Linear(3, 1)}
    theirs = {"a": torch.nn.Linear(4, 3), "b": torch.nn.Linear(3, 1)}
    with torch.no_grad():
        for k in ours:
            theirs[k].weight.copy_(torch.from_numpy(ours[k].weight.numpy(force=True).copy()))
            theirs[k].bias.copy_(torch.from_numpy(ours[k].bias.numpy(force=True).copy()))
    return ours, theirs


def _param(models, name):
    mod, attr = name.split(".")
    return getattr(models[mod], attr)


# The same scaler spelt in both of torch's orders: torch.amp's (device first) and
# torch.cuda.amp's (init_scale, growth_factor, backoff_factor, growth_interval, enabled).
_SHOAL_SCALERS = {
    "torch.amp": lambda: GradScaler("cpu", init_scale=2.0**10, growth_interval=3),
    "torch.cuda.amp": lambda: GradScaler(2.0**10, 2.0, 0.5, 3),
}


def _run(lib, models, x, y, clip_at, form="torch.amp"):
    nn = core if lib == "shoal" else torch
    scaler = (_SHOAL_SCALERS[form]() if lib == "shoal" else
              torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3))
    opt_a = nn.optim.SGD(models["a"].parameters(), lr=0.05, momentum=0.9)
    opt_b = nn.optim.Adam(models["b"].parameters(), lr=0.01)
    scales, skipped = [], []
    for step in range(_STEPS):
        opt_a.zero_grad()
        opt_b.zero_grad()
        out = models["b"](nn.tanh(models["a"](x)))
        loss = ((out - y) ** 2).mean()
        scaler.scale(loss).backward()
        with (core.no_grad() if lib == "shoal" else torch.no_grad()):
            for name, value in _PATTERN.get(step, []):
                grad = _param(models, name).grad
                if lib == "shoal":
                    grad.array.reshape(-1)[0] = value
                else:
                    grad.view(-1)[0] = value
        if step == clip_at:  # unscale_ first, as torch's docs show for clipping
            scaler.unscale_(opt_a)
            clip = (core.nn.utils.clip_grad_norm_ if lib == "shoal" else
                    torch.nn.utils.clip_grad_norm_)
            clip(models["a"].parameters(), 0.5)
        before = [p.detach().clone() for p in models["a"].parameters()] + [
            p.detach().clone() for p in models["b"].parameters()]
        scaler.step(opt_a)
        scaler.step(opt_b)
        after = list(models["a"].parameters()) + list(models["b"].parameters())
        skipped.append(tuple(
            all(bool((b == a).all()) for b, a in zip(before[i:j], after[i:j], strict=True))
            for i, j in ((0, 2), (2, 4))
        ))
        scaler.update()
        scales.append(scaler.get_scale())
    params = [np.asarray(p.detach().numpy() if lib == "torch" else p.numpy(force=True))
              for m in ("a", "b") for p in (models[m].weight, models[m].bias)]
    return scales, skipped, params, scaler.state_dict()


@pytest.mark.parametrize("form", sorted(_SHOAL_SCALERS))
def test_scale_sequence_skipped_steps_and_parameters_match_torch(form):
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((8, 4)).astype(np.float32)
    y_np = rng.standard_normal((8, 1)).astype(np.float32)
    ours, theirs = _models()
    s_ours = _run("shoal", ours, core.tensor(x_np), core.tensor(y_np), clip_at=4, form=form)
    s_theirs = _run("torch", theirs, torch.from_numpy(x_np), torch.from_numpy(y_np), clip_at=4)
    assert s_ours[0] == s_theirs[0]  # the scale after every update(), bit for bit
    assert s_ours[1] == s_theirs[1]  # which optimizer skipped which step
    assert s_ours[1][2] == (True, False) and s_ours[1][5] == (False, True)
    assert s_ours[1][7] == (True, True) and s_ours[1][0] == (False, False)
    for o, t in zip(s_ours[2], s_theirs[2], strict=True):
        np.testing.assert_allclose(o, t, rtol=1e-5, atol=1e-6)
    assert s_ours[3] == s_theirs[3]  # state_dict: same keys, same values


def _parameters(signature):
    return [(p.name, p.default) for p in signature.parameters.values() if p.name != "self"]


def test_both_constructor_orders_have_torchs_parameters_and_defaults():
    """help(GradScaler) shows torch.amp's form; a number first follows torch.cuda.amp's."""
    import inspect

    from shoal.core.amp import grad_scaler

    assert _parameters(inspect.signature(GradScaler)) == _parameters(
        inspect.signature(torch.amp.GradScaler.__init__))
    assert _parameters(inspect.signature(grad_scaler._torch_cuda_amp_order)) == _parameters(
        inspect.signature(torch.cuda.amp.GradScaler.__init__))


@pytest.mark.parametrize("args", [(1024.0,), (1024.0, 3.0), (1024.0, 3.0, 0.25, 7),
                                  (512, 4.0, 0.125, 9, True), (1024.0, 3.0, 0.25, 7, False)])
def test_a_number_first_is_init_scale_as_in_torch_cuda_amp(args):
    """torch.cuda.amp.GradScaler(*args) is torch.amp.GradScaler("cuda", *args) (torch's own
    deprecation note); without CUDA torch disables that one, so the oracle's values come from
    the same arguments after a device on the CPU."""
    ours = GradScaler(*args)
    theirs = torch.amp.GradScaler("cpu", *args)
    assert ours.device == "cuda"  # torch.cuda.amp's scaler is for cuda
    assert ours.is_enabled() == theirs.is_enabled()
    assert ours.state_dict() == theirs.state_dict()
    if ours.is_enabled():
        assert ours.get_scale() == float(args[0]) != 2.0**16


def test_a_str_first_is_the_device_as_in_torch_amp():
    ours = GradScaler("cpu", 1024.0, 3.0, 0.25, 7)
    theirs = torch.amp.GradScaler("cpu", 1024.0, 3.0, 0.25, 7)
    assert ours.device == "cpu" and ours.state_dict() == theirs.state_dict()
    assert GradScaler().device == "cuda" and GradScaler(device="cpu").device == "cpu"
    assert GradScaler(init_scale=8.0).get_scale() == 8.0  # keywords alone: torch.amp's order


def test_constructor_misuse_is_a_clear_error():
    with pytest.raises(ValueError,
                       match=r"GradScaler: device must be 'cpu' or 'cuda', got 'xpu'\."):
        GradScaler("xpu")
    with pytest.raises(ValueError, match=r"device must be 'cpu' or 'cuda', got 'tpu'\."):
        GradScaler(device="tpu", init_scale=4.0)
    with pytest.raises(TypeError, match=r"GradScaler: the first argument must be a device "
                                        r"\('cpu' or 'cuda', torch.amp's order\) or init_scale "
                                        r"\(a number, torch.cuda.amp's order\), got None\."):
        GradScaler(None)
    with pytest.raises(TypeError, match=r"GradScaler \(torch.cuda.amp's order, init_scale "
                                        r"first\): got an unexpected keyword argument 'device'"):
        GradScaler(1024.0, device="cpu")
    with pytest.raises(TypeError, match=r"GradScaler \(torch.amp's order, device first\): "
                                        r"multiple values for argument 'device'"):
        GradScaler("cpu", device="cpu")
    with pytest.raises(TypeError, match=r"init_scale first\): too many positional arguments"):
        GradScaler(1.0, 2.0, 0.5, 1, True, "cpu")
    with pytest.raises(ValueError, match=r"GradScaler: init_scale must be a finite number > 0, "
                                         r"got 0\.0\."):
        GradScaler(0.0)
    with pytest.raises(ValueError, match=r"init_scale must be a finite number > 0, got inf\."):
        GradScaler("cpu", float("inf"))


def test_state_dict_round_trips_between_shoal_and_torch():
    theirs = torch.amp.GradScaler("cpu", init_scale=128.0, growth_factor=3.0, backoff_factor=0.25,
                                  growth_interval=7)
    ours = GradScaler("cpu")
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict() == theirs.state_dict()
    back = core.load(_saved(ours.state_dict()))
    again = GradScaler()
    again.load_state_dict(back)
    assert again.get_scale() == 128.0 and again.get_growth_interval() == 7


def _saved(obj):
    import io

    buf = io.BytesIO()
    core.save(obj, buf)
    buf.seek(0)
    return buf


def test_disabled_scaler_is_a_pass_through():
    model = core.nn.Linear(2, 1)
    opt = core.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(enabled=False)
    loss = model(core.ones(1, 2)).sum()
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    loss.backward()
    w = model.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    assert not core.equal(model.weight.detach(), w)


def test_misuse_raises_as_torch_does():
    model = core.nn.Linear(2, 1)
    opt = core.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler()
    with pytest.raises(RuntimeError, match=r"No inf checks were recorded prior to update\(\)\."):
        scaler.update()
    scaler.scale(model(core.ones(1, 2)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called on this "
                                           r"optimizer since the last update\(\)\."):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called since the last "
                                           r"update\(\)\."):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step\(\)\."):
        scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        scaler.step(opt, closure=lambda: 0.0)
    scaler.update()
    with pytest.raises(RuntimeError, match="The source state dict is empty"):
        scaler.load_state_dict({})
    with pytest.raises(ValueError, match=r"GradScaler: growth_factor must be > 1.0, got 1.0\."):
        GradScaler(growth_factor=1.0)
    half = core.nn.Linear(2, 1).to(core.float16)
    half_opt = core.optim.SGD(half.parameters(), lr=0.1)
    half(core.ones(1, 2, dtype=core.float16)).sum().backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients."):
        GradScaler().unscale_(half_opt)


def test_found_inf_agreement_hook_decides_for_every_rank():
    """What collectives' agreement installs: this rank's clean gradients still skip the step."""
    model = core.nn.Linear(2, 1)
    opt = core.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler(init_scale=4.0)
    seen = []
    scaler.found_inf_agreement = lambda local: seen.append(local) or True  # another rank saw inf
    scaler.scale(model(core.ones(1, 2)).sum()).backward()
    w = model.weight.detach().clone()
    assert scaler.step(opt) is None
    scaler.update()
    assert seen == [False] and core.equal(model.weight.detach(), w) and scaler.get_scale() == 2.0


def _one_step(model, scaler):
    opt = core.optim.SGD(model.parameters(), lr=0.1)
    opt.zero_grad()
    scaler.scale(model(core.ones(1, 2)).sum()).backward()
    w = model.weight.detach().clone()
    scaler.step(opt)
    scaler.update()
    return not core.equal(model.weight.detach(), w)  # whether it stepped


def test_agreements_registered_for_parameters_decide_for_any_scaler_over_them():
    """What DDP registers (core/amp/found_inf.py): every scaler stepping those parameters passes
    its verdict through the agreements, in registration order, even for parameters without a
    gradient; remove() and the parameter's death unregister."""
    from shoal.core.amp.found_inf import agreements_for, register_found_inf_agreement

    model, other = core.nn.Linear(2, 1), core.nn.Linear(2, 1)
    calls = []
    second = register_found_inf_agreement([other.bias], lambda v: calls.append(("2", v)) or v)
    first = register_found_inf_agreement(model.parameters(),
                                          lambda v: calls.append(("1", v)) or True)
    found = agreements_for([other.bias, model.weight, other.bias])  # each once, as registered
    assert [agree(False) for agree in found] == [False, True]
    assert calls == [("2", False), ("1", False)]
    calls.clear()
    assert not _one_step(model, GradScaler(init_scale=4.0))  # the group saw an inf: skipped
    assert calls == [("1", False)]
    frozen = core.nn.Parameter(core.ones(1))  # no gradient on this rank, still looked up
    opt = core.optim.SGD([frozen, other.bias], lr=0.1)
    scaler = GradScaler(init_scale=4.0)
    scaler.unscale_(opt)
    assert calls[-1] == ("2", False)
    own = GradScaler(init_scale=4.0)
    own.found_inf_agreement = lambda v: v  # a scaler's own agreement replaces the registered
    assert _one_step(model, own) and len(calls) == 2
    first.remove()
    first.remove()
    assert agreements_for(model.parameters()) == []
    assert _one_step(model, GradScaler(init_scale=4.0))
    register_found_inf_agreement(model.parameters(), lambda v: True)
    weight_id = id(model.weight)
    del model, opt
    import gc

    gc.collect()
    from shoal.core.amp import found_inf

    assert weight_id not in found_inf._registered  # a dead parameter's id is forgotten
    second.remove()
    with pytest.raises(TypeError, match=r"register_found_inf_agreement: agree must be a "
                                        r"callable taking this rank's verdict \(bool\) and "
                                        r"returning the group's, got int\."):
        register_found_inf_agreement([], 3)
