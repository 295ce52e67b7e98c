"""PyTorch's nn module and criterion test cases (the wheel's torch/testing/_internal/common_nn.py:
get_new_module_tests(), module_tests and criterion_tests) run on shoal and on torch side by side.

The case lists are built twice from torch's file: once as torch wrote it, once through the
renaming shim (torch -> shoal.core), so each shoal case constructs shoal's module with the same
arguments. Random tensors the lists create while being built (targets captured by functional
wrappers) come from torch's generator on both sides, seeded alike, so both lists hold the same
values. Each case then runs torch's module and shoal's with torch's parameters and the same
input in float64 (torch's cases default to double), and compares the output, the input's
gradient and every parameter's gradient.

torch checks each case against its own gradcheck and reference functions; here torch itself is
the reference, which is stricter for shoal (values and gradients must equal torch's).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch

from shoal import core
from tests.torch_ports import shim
from tests.torch_ports.convert import to_core, to_torch

shim._stub_expecttest()
import torch.testing._internal.common_nn as theirs  # noqa: E402 - needs the expecttest stand-in

from tests.torch_ports.ported import common_nn as ours  # noqa: E402

_SEED = 0
_RANDOM = ("randn", "rand", "randint", "randperm", "rand_like", "randn_like", "normal",
           "bernoulli", "multinomial")


def _torch_backed(fn: Callable) -> Callable:
    def draw(*args: Any, **kwargs: Any) -> Any:
        return to_core(fn(*to_torch(args), **to_torch(kwargs)))
    return draw


def _mirror_random_draws() -> None:
    """The shim's `torch` of the ported file draws from torch's generator (shoal's stream
    differs from torch's), so a list built after the same seed holds the same values."""
    renamed = ours.torch
    for name in _RANDOM:
        setattr(renamed, name, _torch_backed(getattr(torch, name)))


@dataclass
class Case:
    """One of torch's cases, as torch builds it and as shoal builds it."""

    name: str
    kind: str  # "module" or "criterion"
    theirs: dict
    ours: dict


_IN_PLACE_RANDOM = ("uniform_", "normal_", "random_", "bernoulli_", "exponential_")


@contextlib.contextmanager
def _in_place_draws_from_torch() -> Any:
    """While shoal's lists are built, a shoal tensor's in-place random fill
    (`torch.empty(15).uniform_()` in the ported file) draws torch's values."""
    saved = {name: vars(core.Tensor).get(name) for name in _IN_PLACE_RANDOM}

    def filler(name: str) -> Callable:
        def fill(self: Any, *args: Any, **kwargs: Any) -> Any:
            theirs_t = to_torch(self).clone()
            getattr(theirs_t, name)(*to_torch(args), **to_torch(kwargs))
            with core.no_grad():
                self.copy_(to_core(theirs_t))
            return self
        return fill

    for name in _IN_PLACE_RANDOM:
        setattr(core.Tensor, name, filler(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            if method is None:
                delattr(core.Tensor, name)
            else:
                setattr(core.Tensor, name, method)


@contextlib.contextmanager
def _double_default() -> Any:
    """torch's and shoal's default dtype float64 (torch's cases are written for it)."""
    core.set_default_dtype(core.float64)
    try:
        with theirs.set_default_dtype(torch.double):
            yield
    finally:
        core.set_default_dtype(core.float32)


def _lists(module: Any) -> list[tuple[str, dict]]:
    # shoal's lists draw from torch's generator too (see _mirror_random_draws)
    draws = _in_place_draws_from_torch() if module is ours else contextlib.nullcontext()
    with _double_default(), draws:
        torch.manual_seed(_SEED)
        built = module.get_new_module_tests()
        torch.manual_seed(_SEED + 1)
        criteria = module.criterion_tests
    return ([("module", d) for d in module.module_tests + built]
            + [("criterion", d) for d in criteria])


def cases() -> list[Case]:
    """Every case, named as torch's test_nn names it (duplicates numbered)."""
    _mirror_random_draws()
    their_list, our_list = _lists(theirs), _lists(ours)
    assert len(their_list) == len(our_list)
    out, seen = [], {}
    for (kind, t), (_, o) in zip(their_list, our_list):
        if "constructor" not in t:  # torch's test_nn looks the class up by its name
            t = dict(t, constructor=getattr(torch.nn, t["module_name"]))
            o = dict(o, constructor=getattr(ours.nn, o["module_name"]))
        name = _name(t)
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            name = f"{name}#{seen[name]}"
        _align_captured(t.get("constructor"), o.get("constructor"))
        if "target_size" in t or "target_fn" in t or "target" in t:
            kind = "criterion"
        out.append(Case(name, kind, t, o))
    return out


def _align_captured(their_fn: Any, our_fn: Any, depth: int = 0) -> None:
    """Give shoal's constructor the tensors torch's captured (a functional case's target `t`,
    drawn while the list was built, after draws shoal's side does not make: torch modules
    initialised at build time), by walking both closures in step."""
    if depth > 4 or their_fn is None or our_fn is None:
        return
    if isinstance(their_fn, type):
        their_fn, our_fn = vars(their_fn).get("forward"), vars(our_fn).get("forward")
    their_cells = getattr(their_fn, "__closure__", None) or ()
    our_cells = getattr(our_fn, "__closure__", None) or ()
    for theirs_cell, ours_cell in zip(their_cells, our_cells):
        value = theirs_cell.cell_contents
        if isinstance(value, torch.Tensor):
            ours_cell.cell_contents = to_core(value)
        elif isinstance(value, dict) and isinstance(ours_cell.cell_contents, dict):
            for key, item in value.items():
                if isinstance(item, torch.Tensor):
                    ours_cell.cell_contents[key] = to_core(item)
        elif callable(value):
            _align_captured(value, ours_cell.cell_contents, depth + 1)


def _name(d: dict) -> str:
    if d.get("fullname"):
        return "test_" + d["fullname"]
    ctor = d.get("constructor")
    base = getattr(ctor, "__name__", None) or d.get("module_name", "?")
    return "test_" + base + ("_" + d["desc"] if d.get("desc") else "")


def _module_and_args(case: Case) -> tuple:
    """(torch module, shoal module, torch input, target or None) in float64."""
    cls_t = theirs.CriterionTest if case.kind == "criterion" else theirs.NewModuleTest
    cls_o = ours.CriterionTest if case.kind == "criterion" else ours.NewModuleTest
    with _double_default():
        t_test = cls_t(**case.theirs)
        torch.manual_seed(_SEED + 2)
        t_module = t_test.constructor(*t_test.constructor_args)
        torch.manual_seed(_SEED + 3)
        t_input = theirs.TestBase._get_input(t_test, False)
        t_target = t_test._get_target() if case.kind == "criterion" else None
        o_test = cls_o(**case.ours)
        torch.manual_seed(_SEED + 2)
        o_module = o_test.constructor(*o_test.constructor_args)
    if isinstance(t_module, torch.nn.Module):
        t_module = t_module.double()
    if isinstance(o_module, core.nn.Module):
        o_module = o_module.double()
        state = {k: to_core(v) for k, v in t_module.state_dict().items()}
        o_module.load_state_dict(state)
    return t_module, o_module, t_input, t_target


def _floats(value: Any) -> list:
    if isinstance(value, (torch.Tensor, core.Tensor)):
        return [value]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _floats(v)]
    return []


def _input_for_torch(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        out = value.detach().clone()
        if out.is_floating_point() or out.is_complex():
            out.requires_grad_(True)
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(_input_for_torch(v) for v in value)
    return value


def run_case(case: Case) -> None:
    """Run the case on both libraries; raise AssertionError naming the first difference."""
    t_module, o_module, raw_input, raw_target = _module_and_args(case)
    t_input, o_input = _input_for_torch(raw_input), to_core(raw_input, requires_grad=True)
    # torch's runners unpack a tuple input: module(*input), criterion(*input, target)
    t_args = t_input if isinstance(t_input, tuple) else (t_input,)
    o_args = o_input if isinstance(o_input, tuple) else (o_input,)
    if case.kind == "criterion":
        t_args += (raw_target,)
        o_args += (to_core(raw_target),)
    t_out = t_module(*t_args)
    o_out = o_module(*o_args)
    t_outs, o_outs = _floats(t_out), _floats(o_out)
    assert len(t_outs) == len(o_outs), f"{len(o_outs)} outputs, torch's {len(t_outs)}"
    for i, (t, o) in enumerate(zip(t_outs, o_outs)):
        _same(f"output {i}", t, o)
    _compare_gradients(case, t_module, o_module, t_input, o_input, t_outs, o_outs)


def _compare_gradients(case: Case, t_module: Any, o_module: Any, t_input: Any, o_input: Any,
                       t_outs: list, o_outs: list) -> None:
    torch.manual_seed(_SEED + 4)
    pairs = [(t, o) for t, o in zip(t_outs, o_outs)
             if t.requires_grad and t.is_floating_point()]
    if not pairs:
        return
    grads = [torch.randn_like(t) for t, _ in pairs]
    torch.autograd.backward([t for t, _ in pairs], grads)
    core.autograd.backward([o for _, o in pairs], [to_core(g) for g in grads])
    for i, (t, o) in enumerate(zip(_floats(t_input), _floats(o_input))):
        if t.grad is not None or o.grad is not None:
            _same(f"input {i}'s gradient", t.grad, o.grad)
    if isinstance(t_module, torch.nn.Module):
        ours_by_name = dict(o_module.named_parameters())
        for name, p in t_module.named_parameters():
            _same(f"{name}'s gradient", p.grad, ours_by_name[name].grad)


def _same(what: str, t: Any, o: Any) -> None:
    if t is None or o is None:
        assert t is None and o is None, f"{what}: shoal's {o is not None}, torch's {t is not None}"
        return
    mine = to_torch(o)
    assert tuple(mine.shape) == tuple(t.shape), f"{what}: shape {tuple(mine.shape)}, torch's " \
        f"{tuple(t.shape)}"
    # both run in float64; summation order and library kernels differ, so torch's float64
    # defaults of assert_close (rtol 1e-7, atol 1e-7) bound the difference
    torch.testing.assert_close(mine.to(t.dtype), t.detach(), msg=lambda m: f"{what}: {m}")
