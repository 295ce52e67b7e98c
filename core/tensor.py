"""`Tensor`: an ndarray (numpy or cupy) in `.array`, plus the autograd state torch users expect.

Ops live in core/ops (forward and backward side by side) and are bound as methods at the end
of this module.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import numpy as np

from shoal.core import autograd
from shoal.core import backend
from shoal.core import dtypes
from shoal.core.autograd import AutogradError, RemovableHandle
from shoal.core.grad_mode import grad_mode


class Tensor:
    """An n-dimensional array with autograd; `.array` is the numpy/cupy array it wraps."""

    # Slots keep attribute access fast on the hot path; __dict__ stays so that callers (DDP,
    # nn) may attach their own attributes as they can on torch tensors.
    __slots__ = (
        "array",
        "grad",
        "requires_grad",
        "grad_fn",
        "_hooks",
        "_post_hooks",
        "_retains_grad",
        "_vc",
        "__dict__",
        "__weakref__",
    )
    # Makes `ndarray <op> Tensor` call Tensor's reflected operator instead of numpy's.
    __array_priority__ = 1000.0

    def __init__(self, data: Any, requires_grad: bool = False) -> None:
        if isinstance(data, Tensor):
            data = data.array
        elif not backend.is_array(data):
            data = np.asarray(data)
        self.array = data
        self.grad: Tensor | None = None
        self.requires_grad = bool(requires_grad)
        self.grad_fn: autograd.Node | None = None
        self._hooks: dict | None = None
        self._post_hooks: dict | None = None
        self._retains_grad = False
        self._vc: list | None = None
        if requires_grad:
            _check_float(self, "requires_grad=True")

    # -- metadata ---------------------------------------------------------------------------
    # torch's `.data`: the same storage seen by a tensor autograd does not track. Unlike
    # detach(), its version counter is its own, so in-place updates through it are invisible
    # to the graph's saved-tensor checks (torch's documented hazard, kept for fidelity).
    @property
    def data(self) -> "Tensor":
        """A tensor sharing this storage, outside autograd (requires_grad=False, own version)."""
        return wrap(self.array)

    @data.setter
    def data(self, value: "Tensor") -> None:
        if not isinstance(value, Tensor):
            kind = type(value)
            name = kind.__qualname__ if kind.__module__ == "builtins" else (
                f"{kind.__module__}.{kind.__qualname__}")
            raise TypeError(f"Variable data has to be a tensor, but got {name}")
        if self.requires_grad and value.array.dtype.kind not in "fcV" and (
            value.array.dtype != dtypes.bfloat16.np
        ):
            raise AutogradError(
                "data set to a tensor that requires gradients must be floating point or complex "
                "dtype"
            )
        self.array = value.array

    @property
    def shape(self) -> tuple:
        """The shape as a tuple of ints."""
        return self.array.shape

    @property
    def dtype(self) -> dtypes.DType:
        """The element type (a core dtype such as core.float32)."""
        return dtypes.from_np(self.array.dtype)

    @property
    def device(self) -> backend.Device:
        """Where the data lives: device('cpu') or device('cuda:N')."""
        return backend.device_of(self.array)

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return self.array.ndim

    @property
    def _version(self) -> int:
        """How many in-place updates this tensor's storage has had (torch's version counter)."""
        vc = self._vc
        return 0 if vc is None else vc[0]

    @property
    def is_leaf(self) -> bool:
        """True for tensors no recorded op produced (user-created tensors, parameters)."""
        return self.grad_fn is None

    @property
    def is_cuda(self) -> bool:
        """True when the data is a cupy array."""
        return not isinstance(self.array, np.ndarray)

    @property
    def is_sparse(self) -> bool:
        """Always False: shoal's tensors are dense."""
        return False

    def is_pinned(self) -> bool:
        """Whether the data sits in page-locked host memory (shoal's cpu arrays never do)."""
        return False

    def dim(self) -> int:
        """The number of dimensions."""
        return self.array.ndim

    def size(self, dim: int | None = None) -> Any:
        """The shape, or one dimension's length."""
        return self.array.shape if dim is None else self.array.shape[dim]

    def numel(self) -> int:
        """The number of elements."""
        return int(self.array.size)

    def element_size(self) -> int:
        """Bytes per element."""
        return self.array.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of data."""
        return int(self.array.nbytes)

    def is_floating_point(self) -> bool:
        """True for float16/bfloat16/float32/float64."""
        return self.dtype.is_floating_point

    def is_complex(self) -> bool:
        """True for complex64/complex128."""
        return self.array.dtype.kind == "c"

    def __len__(self) -> int:
        if self.array.ndim == 0:
            raise TypeError("len() of a 0-d tensor")
        return self.array.shape[0]

    def __iter__(self) -> Any:
        if self.array.ndim == 0:
            raise TypeError("iteration over a 0-d tensor")
        return (self[i] for i in range(self.array.shape[0]))

    __hash__ = object.__hash__  # tensors hash by identity, as in torch (== is elementwise)

    # -- conversion -------------------------------------------------------------------------
    def item(self) -> Any:
        """The single element as a Python number."""
        if self.array.size != 1:
            raise ValueError(
                f"item(): only one-element tensors can be converted to a Python number, "
                f"got shape {tuple(self.array.shape)}."
            )
        return self.array.item() if isinstance(self.array, np.ndarray) else self.array.get().item()

    def tolist(self) -> Any:
        """The data as nested Python lists."""
        return self.numpy(force=True).tolist()

    def numpy(self, force: bool = False) -> np.ndarray:
        """The data as a numpy array, shared without a copy on cpu (copied from cuda)."""
        if self.requires_grad and not force:
            raise AutogradError(
                "numpy(): the tensor requires grad; call tensor.detach().numpy() instead."
            )
        data = self.array
        return data if isinstance(data, np.ndarray) else data.get()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.numpy(force=True)
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __float__(self) -> float:
        return float(self.item())

    def __int__(self) -> int:
        return int(self.item())

    def __index__(self) -> int:
        if self.dtype.is_floating_point or self.array.size != 1:
            raise TypeError("only integer tensors of a single element can be used as an index")
        return int(self.item())

    def __bool__(self) -> bool:
        if self.array.size != 1:
            raise ValueError(
                f"The truth value of a tensor with {self.array.size} elements is ambiguous."
            )
        return bool(self.item())

    def __repr__(self) -> str:
        data = self.numpy(force=True)
        body = np.array2string(data, separator=", ", prefix="tensor(",
                               formatter=_complex_formatter(data))
        extras = []
        if self.device.type != "cpu":
            extras.append(f"device='{self.device}'")
        if self.array.dtype not in (np.float32, np.int64, np.bool_, np.complex64):
            extras.append(f"dtype={self.dtype!r}")
        if self.grad_fn is not None:
            extras.append(f"grad_fn=<{self.grad_fn.name()}>")
        elif self.requires_grad:
            extras.append("requires_grad=True")
        return "tensor(" + body + "".join(", " + e for e in extras) + ")"

    def to(self, *args: Any, **kwargs: Any) -> "Tensor":
        """Move to a device and/or cast to a dtype: t.to('cuda'), t.to(core.float16)."""
        target_dev = kwargs.pop("device", None)
        target_dt = kwargs.pop("dtype", None)
        kwargs.pop("non_blocking", None)
        copy = kwargs.pop("copy", False)
        if kwargs:
            raise TypeError(f"to(): unexpected keyword arguments {sorted(kwargs)}")
        for a in args:
            if isinstance(a, Tensor):
                target_dev, target_dt = a.device, a.dtype
            elif isinstance(a, dtypes.DType) or (
                not isinstance(a, (str, backend.Device)) and a is not None
            ):
                target_dt = a
            else:
                target_dev = a
        from shoal.core.ops import shape as _shape_ops  # noqa: PLC0415 - the ops import Tensor

        return _shape_ops.to(self, target_dev, target_dt, copy)

    def cpu(self) -> "Tensor":
        """This tensor on the cpu."""
        return self.to("cpu")

    def cuda(self, index: int | None = None) -> "Tensor":
        """This tensor on a cuda device."""
        return self.to("cuda" if index is None else f"cuda:{index}")

    def float(self) -> "Tensor":
        """Cast to float32."""
        return self.to(dtypes.float32)

    def double(self) -> "Tensor":
        """Cast to float64."""
        return self.to(dtypes.float64)

    def half(self) -> "Tensor":
        """Cast to float16."""
        return self.to(dtypes.float16)

    def bfloat16(self) -> "Tensor":
        """Cast to bfloat16."""
        return self.to(dtypes.bfloat16)

    def long(self) -> "Tensor":
        """Cast to int64."""
        return self.to(dtypes.int64)

    def int(self) -> "Tensor":
        """Cast to int32."""
        return self.to(dtypes.int32)

    def bool(self) -> "Tensor":
        """Cast to bool."""
        return self.to(dtypes.bool_)

    def type(self, dtype: Any) -> "Tensor":
        """Cast to a dtype."""
        return self.to(dtypes.get(dtype))

    def type_as(self, other: "Tensor") -> "Tensor":
        """Cast to another tensor's dtype."""
        return self.to(other.dtype)

    # -- autograd ---------------------------------------------------------------------------
    def detach(self) -> "Tensor":
        """A tensor sharing this data and its version counter, cut from the graph."""
        out = Tensor(self.array)
        if self._vc is None:
            self._vc = [0]
        out._vc = self._vc
        return out

    def detach_(self) -> "Tensor":
        """Cut this tensor from the graph in place."""
        self.grad_fn = None
        self.requires_grad = False
        return self

    def requires_grad_(self, requires_grad: bool = True) -> "Tensor":
        """Set requires_grad on a leaf; returns self."""
        if self.grad_fn is not None and not requires_grad:
            raise AutogradError(
                "requires_grad_(False) on a non-leaf tensor; use detach() to cut it from the graph."
            )
        if requires_grad:
            _check_float(self, "requires_grad_()")
        self.requires_grad = bool(requires_grad)
        return self

    def retain_grad(self) -> None:
        """Keep .grad on this non-leaf tensor after backward."""
        if not self.requires_grad:
            raise AutogradError("retain_grad() on a tensor that does not require grad.")
        if self.grad_fn is not None:
            self._retains_grad = True

    @property
    def retains_grad(self) -> bool:
        """Whether a non-leaf keeps its .grad."""
        return self._retains_grad

    def backward(
        self, gradient: "Tensor | None" = None, retain_graph: bool | None = None,
        create_graph: bool = False,
    ) -> None:
        """Accumulate d(self)/d(leaf) into every leaf's .grad; `gradient` is needed unless scalar.

        With create_graph=True the leaves' .grad get a graph of their own (double backward)."""
        if gradient is None and self.array.dtype.kind == "c":
            raise AutogradError(
                "grad can be implicitly created only for real scalar outputs: backward() without "
                f"a gradient needs a real output, got dtype {self.dtype!r}."
            )
        if create_graph:
            autograd.backward(self, gradient, retain_graph, create_graph=True)
            return
        g = None
        if gradient is not None:
            g = gradient.array if isinstance(gradient, Tensor) else gradient
            if not backend.is_array(g):
                g = np.asarray(g, dtype=self.array.dtype)
        autograd.backward(self, g, bool(retain_graph))

    def register_hook(self, hook: Callable[["Tensor"], "Tensor | None"]) -> RemovableHandle:
        """Call hook(grad) when this tensor's grad is computed; a returned tensor replaces it."""
        if not self.requires_grad:
            raise AutogradError(
                "register_hook() on a tensor that does not require grad; no gradient will reach it."
            )
        if self._hooks is None:
            self._hooks = {}
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def register_post_accumulate_grad_hook(
        self, hook: Callable[["Tensor"], None]
    ) -> RemovableHandle:
        """On a leaf: call hook(tensor) right after its .grad received a backward's gradient."""
        if self.grad_fn is not None:
            raise AutogradError(
                "register_post_accumulate_grad_hook() only works on leaf tensors; this one was "
                f"produced by {self.grad_fn.name()}."
            )
        if not self.requires_grad:
            raise AutogradError(
                "register_post_accumulate_grad_hook() on a tensor that does not require grad."
            )
        if self._post_hooks is None:
            self._post_hooks = {}
        handle = RemovableHandle(self._post_hooks)
        self._post_hooks[handle.id] = hook
        return handle

    # -- in-place updates: torch's rules (core/ops/inplace.py has +=, add_, sub_, mul_, div_) ----
    def zero_(self) -> "Tensor":
        """Fill with zeros in place."""
        check_inplace(self, "zero_")
        self.array.fill(0)
        return self

    def fill_(self, value: Any) -> "Tensor":
        """Fill with a value in place; an integer out of the dtype's range wraps, as in torch."""
        check_inplace(self, "fill_")
        arr = self.array
        arr.fill(_fill_value(_scalar(value), arr.dtype))
        return self

    def addcmul_(self, t1: Any, t2: Any, value: Any = 1) -> "Tensor":
        """self += value * t1 * t2, in place."""
        check_inplace(self, "addcmul_")
        prod = _raw(t1) * _raw(t2)
        if value != 1:
            prod *= _scalar(value)
        self.array += prod
        return self

    def addcdiv_(self, t1: Any, t2: Any, value: Any = 1) -> "Tensor":
        """self += value * t1 / t2, in place."""
        check_inplace(self, "addcdiv_")
        q = _raw(t1) / _raw(t2)
        if value != 1:
            q *= _scalar(value)
        self.array += q
        return self

    def copy_(self, src: Any) -> "Tensor":
        """Copy src's values into this tensor in place (broadcasting, casting, across devices)."""
        check_inplace(self, "copy_")
        s = _raw(src)
        if backend.is_array(s) and backend.device_of(s) != backend.device_of(self.array):
            s = backend.to_device(s, backend.device_of(self.array))
        xp = backend.array_module(self.array)
        xp.copyto(self.array, s, casting="unsafe")
        return self

    # -- DLPack -----------------------------------------------------------------------------
    # __dlpack__ is bound from core/ops/interop.py (it wraps dtype errors).

    def __dlpack_device__(self) -> tuple:
        """The DLPack (device type, index) of the data."""
        return self.array.__dlpack_device__()


_new = object.__new__
_ndarray = np.ndarray


def wrap(data: Any) -> Tensor:
    """A new tensor around the array `data`, with no graph: Tensor(data) without its checks.

    Every op's output goes through here, so it sets the slots itself rather than run __init__.
    """
    if data.__class__ is not _ndarray and isinstance(data, np.generic):
        data = np.asarray(data)
    out = _new(Tensor)
    out.array = data
    out.grad = None
    out.requires_grad = False
    out.grad_fn = None
    # Tensor's own slots, set from its own module: this is its constructor's fast path.
    out._hooks = None  # noqa: SLF001
    out._post_hooks = None  # noqa: SLF001
    out._retains_grad = False  # noqa: SLF001
    out._vc = None  # noqa: SLF001
    return out


LEAF_INPLACE = "a leaf Variable that requires grad is being used in an in-place operation."


def check_inplace(t: Tensor, op: str) -> None:
    """Refuse what torch refuses, then count the update in t's version counter.

    torch's refusal: a leaf that requires grad, in grad mode. A tensor inside a graph is
    refused too, by the ops that do not record themselves (core/ops/inplace.py's do).
    """
    if t.requires_grad and grad_mode.enabled:
        if t.grad_fn is None:
            raise AutogradError(f"{LEAF_INPLACE} ({op}: wrap it in core.no_grad(), as optimizers do)")
        raise AutogradError(
            f"{op}: this in-place update is not recorded in the autograd graph, and the tensor "
            f"was produced by {t.grad_fn.name()}; use the out-of-place op or clone() first."
        )
    bump_version(t)


def bump_version(t: Tensor) -> None:
    """Count one in-place update of t (autograd compares it with what its nodes saw)."""
    counter = t._vc  # noqa: SLF001 - Tensor's own slot, from its own module
    if counter is None:
        t._vc = [1]  # noqa: SLF001
    else:
        counter[0] += 1


def _check_float(t: Tensor, what: str) -> None:
    if t.array.dtype.kind not in "fVc" and t.array.dtype != dtypes.bfloat16.np:
        raise AutogradError(
            f"{what}: only floating point tensors can require gradients (complex ones too), got "
            f"dtype {t.dtype!r}."
        )


def _fill_value(value: Any, dt: np.dtype) -> Any:
    """value as a dt scalar, by torch's rule: a negative int wraps into an unsigned dtype, any
    other value outside the integer dtype's range is refused."""
    if dt.kind in "iu" and not isinstance(value, bool):
        info = np.iinfo(dt)
        wraps = dt.kind == "u" and isinstance(value, (int, np.integer)) and value < 0
        if not wraps and not info.min <= value <= info.max:
            raise RuntimeError(f"value cannot be converted to type {dt.name}_t without overflow")
    return np.asarray(value).astype(dt)[()]


def _complex_formatter(data: np.ndarray) -> dict | None:
    """torch's complex layout for repr: real parts aligned, each imaginary part written right
    after its real one ("-8.+0.j", where numpy aligns imaginary parts too: "-8. +0.j")."""
    if data.dtype.kind != "c" or data.size == 0:
        return None
    try:
        from numpy._core.arrayprint import FloatingFormat  # noqa: PLC0415 - repr only
    except ImportError:  # numpy moved its private formatter: keep numpy's own layout
        return None
    opts = np.get_printoptions()
    args = (opts["precision"], opts["floatmode"], opts["suppress"])
    legacy = opts.get("legacy") or sys.maxsize  # numpy's own value for "no legacy mode"
    real = FloatingFormat(data.real.ravel(), *args, legacy=legacy)
    imag = FloatingFormat(data.imag.ravel(), *args, sign=True, legacy=legacy)
    return {"complexfloat": lambda z: real(z.real) + imag(z.imag).strip() + "j"}


def _raw(x: Any) -> Any:
    """A Tensor's array, or a Python scalar as it is (so float32 arrays stay float32)."""
    if isinstance(x, Tensor):
        return x.array
    return x


def _scalar(x: Any) -> Any:
    if isinstance(x, Tensor):
        return x.item()
    return x


# Bind the ops as methods (ops import Tensor from this module, which is complete by now).
from shoal.core.ops import bind as _bind  # noqa: E402 - needs Tensor defined

_bind.bind_methods(Tensor)
