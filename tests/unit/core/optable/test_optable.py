"""Runs the op table (entries_*.py) against torch: forward values and dtypes per dtype, the
gradient in float64, the in-place variant, aliasing, the error type of one bad input, and that
every form (core.op, Tensor.op) agrees. An aspect core gets wrong today is a strict xfail with
its reason, so a fix shows up as XPASS and the mark must go."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal import core
from tests.unit.core.optable import entries_elementwise, entries_reduce, entries_tensor
from tests.unit.core.optable import entries_complex, entries_everyday
from tests.unit.core.optable import entries_linalg
from tests.unit.core.optable import entries_aten, entries_fft, entries_special
from tests.unit.core.optable import entries_conv
from tests.unit.core.optable.table import (
    GRAD_TOLERANCE, A, Lib, OpInfo, assert_like, assert_same, materialise, tensors_of,
)

ENTRIES: list[OpInfo] = (
    entries_elementwise.ENTRIES + entries_reduce.ENTRIES + entries_tensor.ENTRIES
    + entries_complex.ENTRIES + entries_everyday.ENTRIES + entries_linalg.ENTRIES
    + entries_fft.ENTRIES + entries_special.ENTRIES + entries_aten.ENTRIES
    + entries_conv.ENTRIES)


def _aliasable(entry: OpInfo) -> int | None:
    """The first sample whose first argument is a tensor of at least one element."""
    for i, sample in enumerate(entry.samples):
        first = sample.args[0] if sample.args else None
        if isinstance(first, A) and first.dtype is None and int(np.prod(first.shape)) > 0:
            return i
    return None


def _aspects(entry: OpInfo) -> list[str]:
    """The checks that apply to an entry."""
    aspects = [f"forward-{dt}" for dt in entry.dtypes]
    if len(entry.forms) > 1:
        aspects.append("forms")
    if entry.grad:
        aspects.append("backward")
    if entry.inplace:
        aspects.append("inplace")
    if not entry.random and _aliasable(entry) is not None:
        aspects.append("alias")
    if entry.error:
        aspects.append("error")
    return aspects


def _reason(entry: OpInfo, aspect: str) -> str | None:
    if entry.missing:
        return entry.missing
    return entry.xfail.get(aspect) or (
        entry.xfail.get("forward") if aspect.startswith("forward-") else None)


def _cases():
    for entry in ENTRIES:
        for aspect in _aspects(entry):
            reason = _reason(entry, aspect)
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            yield pytest.param(entry, aspect, id=f"{entry.name}-{aspect}", marks=marks)


@pytest.mark.parametrize("entry,aspect", list(_cases()))
def test_op(entry: OpInfo, aspect: str) -> None:
    """One aspect of one op, in core and in torch."""
    if aspect.startswith("forward-"):
        _forward(entry, aspect.removeprefix("forward-"))
    else:
        {"forms": _forms, "backward": _backward, "inplace": _inplace, "alias": _alias,
         "error": _error}[aspect](entry)


def test_xfail_keys_name_real_aspects() -> None:
    """A reason filed under an aspect the entry does not run would hide nothing: refuse it."""
    stale = [f"{e.name}: {key}" for e in ENTRIES for key in e.xfail
             if key not in _aspects(e) and key != "forward"]
    assert not stale, stale


def test_names_are_unique() -> None:
    """One entry per op, so a reason is never split over two."""
    names = [e.name for e in ENTRIES]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def _both(entry: OpInfo, data: tuple, form: str | None = None, grad: bool = False) -> tuple:
    """(core's result, torch's result, core's args, torch's args); an error torch raises must
    be raised by core too, as the same type, and then the sample is done (None results)."""
    their_args, their_kwargs = materialise(torch, data, grad)
    my_args, my_kwargs = materialise(core, data, grad)
    try:
        theirs = entry.run(torch, their_args, their_kwargs, form)
    except Exception as exc:  # noqa: BLE001 - any torch error is the expected one for core
        with pytest.raises(builtin_type(exc)):
            entry.run(core, my_args, my_kwargs, form)
        return None, None, my_args, their_args
    mine = entry.run(core, my_args, my_kwargs, form)
    return mine, theirs, my_args, their_args


def builtin_type(exc: BaseException) -> type:
    """The Python exception class torch's error is (torch's own subclasses are its detail)."""
    return next(c for c in type(exc).__mro__ if c.__module__ == "builtins")


def _forward(entry: OpInfo, dtype: str) -> None:
    lib = Lib(dtype)
    for i, sample in enumerate(entry.samples):
        mine, theirs, _, _ = _both(entry, lib.arrays(sample))
        check = assert_like if entry.random else assert_same
        check(mine, theirs, f"{entry.name} sample {i} in {dtype}")


def _forms(entry: OpInfo) -> None:
    for form in entry.forms[1:]:
        data = Lib(entry.dtypes[0]).arrays(entry.samples[0])
        their_args, their_kwargs = materialise(torch, data)
        expected = entry.run(torch, their_args, their_kwargs)
        my_args, my_kwargs = materialise(core, data)
        check = assert_like if entry.random else assert_same
        check(entry.run(core, my_args, my_kwargs, form), expected, f"{entry.name} as a {form}")


def _backward(entry: OpInfo) -> None:
    lib = Lib("float64" if "float64" in entry.dtypes else entry.dtypes[0])
    checked = 0
    for i, sample in enumerate(entry.samples):
        mine, theirs, my_args, their_args = _both(entry, lib.arrays(sample), grad=True)
        if theirs is None:
            continue
        t_out = next((t for t in tensors_of(theirs) if t.requires_grad), None)
        if t_out is None:
            continue
        m_out = tensors_of(mine)[tensors_of(theirs).index(t_out)]
        weights = lib.rng.standard_normal(tuple(t_out.shape))
        t_out.backward(torch.from_numpy(weights).to(t_out.dtype))
        m_out.backward(core.from_numpy(weights.astype(m_out.array.dtype)))
        for j, (m, t) in enumerate(zip(tensors_of(my_args), tensors_of(their_args))):
            what = f"{entry.name} sample {i}: gradient of argument {j}"
            if t.grad is None:
                assert m.grad is None, f"{what}: torch has none"
                continue
            assert m.grad is not None, f"{what}: core has none"
            rtol, atol = GRAD_TOLERANCE
            np.testing.assert_allclose(m.grad.numpy(), t.grad.numpy(), rtol=rtol, atol=atol,
                                       err_msg=what)
        checked += 1
    assert checked, f"{entry.name}: no sample has a gradient in torch; set grad=False"


def _inplace(entry: OpInfo) -> None:
    lib = Lib(entry.dtypes[0])
    for i, sample in enumerate(entry.samples):
        if not isinstance(sample.args[0], A):
            continue
        data = lib.arrays(sample)
        (mine, *my_rest), my_kwargs = materialise(core, data)
        (theirs, *their_rest), their_kwargs = materialise(torch, data)
        t_version = theirs._version
        try:
            t_result = getattr(theirs, entry.inplace)(*their_rest, **their_kwargs)
        except Exception as exc:  # noqa: BLE001 - core must raise what torch raises
            with pytest.raises(builtin_type(exc)):
                getattr(mine, entry.inplace)(*my_rest, **my_kwargs)
            continue
        m_version = mine._version
        m_result = getattr(mine, entry.inplace)(*my_rest, **my_kwargs)
        what = f"{entry.inplace} sample {i}"
        assert (m_result is mine) == (t_result is theirs), f"{what}: returns self in torch"
        assert_same(mine, theirs, what)
        assert mine._version - m_version == theirs._version - t_version, f"{what}: version"


def _shares(out: torch.Tensor, base: torch.Tensor) -> bool:
    return out.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


def _alias(entry: OpInfo) -> None:
    """A view shares storage (writes go both ways); anything else is a copy."""
    dtype = entry.dtypes[0]
    data = Lib(dtype).arrays(entry.samples[_aliasable(entry)])
    with torch.no_grad(), core.no_grad():
        mine, theirs, my_args, their_args = _both(entry, data)
        if theirs is None:
            pytest.fail(f"{entry.name}: torch refuses the alias sample; pick another first")
        m_outs, t_outs = tensors_of(mine), tensors_of(theirs)
        if not t_outs:
            return
        shared = _shares(t_outs[0], their_args[0])
        assert shared == entry.view, f"table: {entry.name}'s view={entry.view}, torch's {shared}"
        fill = True if dtype == "bool" else 7
        my_args[0].fill_(fill)
        their_args[0].fill_(fill)
        assert_same(m_outs, t_outs, f"{entry.name}'s result after its input was written")
        if entry.view:
            _write_through(m_outs[0], t_outs[0], my_args[0], their_args[0], entry.name)


def _write_through(m_out, t_out, m_base, t_base, name: str) -> None:
    fill = False if t_out.dtype == torch.bool else 3
    try:
        t_out.fill_(fill)
    except RuntimeError:  # torch refuses writes into an expanded view; core must too
        with pytest.raises(RuntimeError):
            m_out.fill_(fill)
        return
    m_out.fill_(fill)
    assert_same(m_base, t_base, f"{name}: its input after a write through the view")


def _error(entry: OpInfo) -> None:
    sample, expected = entry.error
    data = Lib(entry.dtypes[0]).arrays(sample)
    their_args, their_kwargs = materialise(torch, data)
    with pytest.raises(expected):  # the table's claim about torch
        entry.run(torch, their_args, their_kwargs)
    my_args, my_kwargs = materialise(core, data)
    with pytest.raises(expected):
        entry.run(core, my_args, my_kwargs)


# Public names of core and Tensor that are not ops, so they have no entry: each with why.
NOT_OPS = {
    **dict.fromkeys(("dtypes", "nn", "optim", "data", "multiprocessing", "amp", "profiler",
                     "backends", "cuda", "linalg", "testing", "distributions"),
                    "a module; its ops are entries by their own names"),
    **dict.fromkeys(("Tensor", "Device", "device", "DType", "Size", "FloatTensor",
                     "DoubleTensor", "LongTensor", "IntTensor", "RemovableHandle", "Generator"),
                    "a type, tested in tests/unit/core/test_core_torch_names.py and test_tensor.py"),
    **dict.fromkeys(("get_default_dtype", "set_default_dtype"),
                    "process state, not an op (tests/unit/core/test_default_dtype.py)"),
    **dict.fromkeys(("enable_grad", "no_grad", "set_grad_enabled", "is_grad_enabled",
                     "autocast", "get_autocast_dtype", "is_autocast_enabled"),
                    "a mode, not an op (tests/unit/core/test_autograd.py, amp/)"),
    **dict.fromkeys(("get_rng_state", "set_rng_state", "manual_seed", "initial_seed",
                     "are_deterministic_algorithms_enabled", "use_deterministic_algorithms",
                     "is_deterministic_algorithms_warn_only_enabled", "retain_freed_memory",
                     "load", "save"),
                    "global state or files (test_determinism.py, test_serialization.py)"),
    # Tensor's metadata and autograd plumbing (tests/unit/core/test_tensor.py, test_autograd.py).
    **dict.fromkeys(("array", "data", "grad", "grad_fn", "requires_grad", "is_leaf", "shape",
                     "dtype", "device", "ndim", "nbytes", "is_cuda", "is_sparse", "is_pinned",
                     "retains_grad", "dim", "size", "numel", "element_size",
                     "is_floating_point", "numpy", "cpu", "cuda", "backward", "register_hook",
                     "register_post_accumulate_grad_hook", "requires_grad_", "retain_grad"),
                    "metadata or autograd plumbing, not an op"),
}


def _core_names() -> set[str]:
    """core's public functions and Tensor's public methods, operators included (errors are
    classes, not ops)."""
    from shoal.core.ops import bind, inplace  # the tables bind_methods installs

    names = {n for n in core.__all__ if callable(getattr(core, n)) and not (
        isinstance(getattr(core, n), type) and issubclass(getattr(core, n), BaseException))}
    names |= {n for n in dir(core.Tensor) if not n.startswith("_")}
    names |= set(bind._operators()) | set(inplace.OPERATORS)
    return names - set(NOT_OPS)


def test_every_op_of_core_and_tensor_has_an_entry() -> None:
    """A new op or method without an entry (or a NOT_OPS line) fails here, so the table stays
    whole as core grows."""
    covered = {e.name for e in ENTRIES} | {e.inplace for e in ENTRIES if e.inplace}
    covered |= {name for e in ENTRIES for name in e.covers}
    missing = sorted(_core_names() - covered)
    assert not missing, f"op table entries missing for {missing} (tests/unit/core/optable/)"
