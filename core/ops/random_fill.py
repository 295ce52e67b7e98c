"""torch's in-place random fills (normal_, uniform_, bernoulli_, exponential_, random_,
geometric_, cauchy_, log_normal_), bernoulli, multinomial, normal, the *_like draws and the
Tensor.new_* creators.

Each fill takes `generator=` (a core.Generator: torch's Mersenne Twister, so uniform_ and
normal_ give torch's values for the same seed) or draws from core's global generator
(core.manual_seed). A fill is an in-place update: torch refuses it on a leaf that requires
grad in grad mode, and it counts in the tensor's version counter.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from shoal.core import backend, dtypes
from shoal.core.ops import creation, random as _random
from shoal.core.ops._util import val, wrap, xp_of
from shoal.core.tensor import Tensor, check_inplace


def _uniform(t: Tensor, n: int, generator: Any, op: str) -> Any:
    """n uniforms in [0, 1) in t's float precision, from `generator` or the global one."""
    dt = t.array.dtype
    wide = np.float64 if dt == np.float64 else np.float32
    if generator is not None:
        return _random.uniform_from(_random.check_generator(generator, op), n, wide)
    xp = xp_of(t.array)
    return _random.generator(xp, backend.device_of(t.array).index).random(n, dtype=wide)


def _normal(t: Tensor, n: int, generator: Any, op: str) -> Any:
    dt = t.array.dtype
    if generator is not None:
        return _random.normal_from(_random.check_generator(generator, op), n, dt)
    xp = xp_of(t.array)
    wide = np.float64 if dt == np.float64 else np.float32
    return _random.generator(xp, backend.device_of(t.array).index).standard_normal(n, dtype=wide)


def _write(t: Tensor, values: Any, op: str) -> Tensor:
    check_inplace(t, op)
    dst = t.array
    xp = xp_of(dst)
    dst[...] = xp.asarray(values).reshape(dst.shape).astype(dst.dtype, copy=False)
    return t


def _floating(t: Tensor, op: str) -> None:
    if t.array.dtype.kind not in "fV":
        raise RuntimeError(f"{op} expects floating point dtypes, got {t.dtype}")


def uniform_(self: Tensor, from_: float = 0.0, to: float = 1.0, *, generator: Any = None,
             **kw: Any) -> Tensor:
    """Fill with U(from, to) samples."""
    from_ = kw.pop("from", from_)
    _floating(self, "uniform_")
    u = _uniform(self, self.numel(), generator, "uniform_")
    return _write(self, u * (to - from_) + from_, "uniform_")


def normal_(self: Tensor, mean: float = 0.0, std: float = 1.0, *, generator: Any = None) -> Tensor:
    """Fill with N(mean, std^2) samples."""
    _floating(self, "normal_")
    if std < 0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {std}")
    z = _normal(self, self.numel(), generator, "normal_")
    return _write(self, z * std + mean, "normal_")


def exponential_(self: Tensor, lambd: float = 1.0, *, generator: Any = None) -> Tensor:
    """Fill with Exp(lambd) samples."""
    _floating(self, "exponential_")
    if lambd <= 0:
        raise RuntimeError(f"exponential_ expects lambda > 0.0, but found lambda={lambd}")
    u = _uniform(self, self.numel(), generator, "exponential_")
    return _write(self, -np.log1p(-u) / lambd, "exponential_")


def geometric_(self: Tensor, p: float, *, generator: Any = None) -> Tensor:
    """Fill with the number of Bernoulli(p) trials up to the first success."""
    if not 0 < p < 1:
        raise RuntimeError(f"geometric_ expects p to be in (0, 1), but got p={p}")
    u = _uniform(self, self.numel(), generator, "geometric_")
    return _write(self, np.ceil(np.log1p(-u) / np.log1p(-p)).clip(min=1), "geometric_")


def cauchy_(self: Tensor, median: float = 0.0, sigma: float = 1.0, *, generator: Any = None) -> Tensor:
    """Fill with Cauchy(median, sigma) samples."""
    _floating(self, "cauchy_")
    u = _uniform(self, self.numel(), generator, "cauchy_")
    return _write(self, median + sigma * np.tan(np.pi * (u - 0.5)), "cauchy_")


def log_normal_(self: Tensor, mean: float = 1.0, std: float = 2.0, *, generator: Any = None) -> Tensor:
    """Fill with exp(N(mean, std^2)) samples."""
    _floating(self, "log_normal_")
    z = _normal(self, self.numel(), generator, "log_normal_")
    return _write(self, np.exp(z * std + mean), "log_normal_")


def random_(self: Tensor, from_: int = 0, to: int | None = None, *, generator: Any = None,
            **kw: Any) -> Tensor:
    """Fill with integers in [from, to) (to: the dtype's mantissa or maximum when None)."""
    from_ = kw.pop("from", from_)
    if to is None:
        dt = self.array.dtype
        to = (1 << np.finfo(dt).nmant + 1) + 1 if dt.kind == "f" else (
            2 if dt == np.bool_ else int(np.iinfo(dt).max) + 1)
    n = self.numel()
    if generator is not None:
        ints = _random.integers_from(_random.check_generator(generator, "random_"), from_, to, n)
    else:
        if from_ >= to:
            raise RuntimeError(f"random_ expects 'from' to be less than 'to', but got "
                               f"from={from_} >= to={to}")
        ints = _random.generator(np).integers(from_, to, n)
    return _write(self, ints, "random_")


def bernoulli_(self: Tensor, p: Any = 0.5, *, generator: Any = None) -> Tensor:
    """Fill with 1 where a uniform draw falls below p (a number or a tensor of probabilities)."""
    probs = val(p)
    if np.any(np.asarray(probs) < 0) or np.any(np.asarray(probs) > 1):
        raise RuntimeError("bernoulli_ expects p to be in [0, 1]")
    u = _uniform(self, self.numel(), generator, "bernoulli_").reshape(self.shape)
    return _write(self, u < probs, "bernoulli_")


def bernoulli(input: Tensor, p: Any = None, *, generator: Any = None) -> Tensor:  # noqa: A002
    """A tensor of 0/1 draws with probabilities `input` (or the number p), in input's dtype."""
    probs = input.array if p is None else p
    if p is None and (np.any(probs < 0) or np.any(probs > 1)):
        raise RuntimeError("Expected p_in >= 0 && p_in <= 1 to be true, but got false.")
    out = creation.empty_like(input) if hasattr(creation, "empty_like") else \
        creation.zeros_like(input)
    u = _uniform(input, input.numel(), generator, "bernoulli").reshape(input.shape)
    out.array[...] = (u < probs).astype(out.array.dtype)
    return out


def multinomial(input: Tensor, num_samples: int, replacement: bool = False, *,  # noqa: A002
                generator: Any = None) -> Tensor:
    """num_samples category positions per row of (unnormalised) probabilities `input`."""
    probs = input.array.astype(np.float64)
    if input.ndim not in (1, 2):
        raise RuntimeError("prob_dist must be 1 or 2 dim")
    if np.any(probs < 0) or not np.all(np.isfinite(probs)):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    rows = probs.reshape(-1, probs.shape[-1])
    if np.any(rows.sum(axis=1) <= 0):
        raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
    if not replacement and num_samples > rows.shape[1]:
        raise RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without "
                           "replacement")
    out = np.empty((rows.shape[0], num_samples), np.int64)
    for r, row in enumerate(rows):  # one draw loop per row, vectorised within it
        out[r] = _draw_row(input, row / row.sum(), num_samples, replacement, generator)
    return wrap(out.reshape(probs.shape[:-1] + (num_samples,)))


def _draw_row(input: Tensor, p: Any, k: int, replacement: bool, generator: Any) -> Any:  # noqa: A002
    if replacement:
        u = _uniform(input, k, generator, "multinomial").astype(np.float64)
        return np.minimum(np.searchsorted(np.cumsum(p), u, side="right"), p.size - 1)
    # without replacement: the k largest of log(u)/p (exponential race, Efraimidis-Spirakis)
    u = _uniform(input, p.size, generator, "multinomial").astype(np.float64)
    with np.errstate(divide="ignore"):
        keys = np.where(p > 0, np.log(np.maximum(u, 1e-300)) / p, -np.inf)
    return np.argsort(-keys, kind="stable")[:k]


def normal(mean: Any, std: Any = 1.0, size: Any = None, *, generator: Any = None,
           dtype: Any = None, **_: Any) -> Tensor:
    """Samples of N(mean, std^2): tensors broadcast, or numbers with a size."""
    if size is not None:
        out = creation.zeros(*tuple(size), dtype=dtype)
        return normal_(out, float(mean), float(std), generator=generator)
    m, s = val(mean), val(std)
    shape = np.broadcast_shapes(np.shape(m), np.shape(s))
    like = mean if isinstance(mean, Tensor) else std
    out = creation.zeros(*shape, dtype=like.dtype)
    normal_(out, 0.0, 1.0, generator=generator)
    out.array[...] = out.array * s + m
    return out


def rand_like(input: Tensor, *, dtype: Any = None, device: Any = None,  # noqa: A002
              requires_grad: bool = False, **_: Any) -> Tensor:
    """U(0, 1) samples with input's shape, dtype and device."""
    return creation.rand(*input.shape, dtype=dtype or input.dtype, device=device,
                         requires_grad=requires_grad)


def randn_like(input: Tensor, *, dtype: Any = None, device: Any = None,  # noqa: A002
               requires_grad: bool = False, **_: Any) -> Tensor:
    """N(0, 1) samples with input's shape, dtype and device."""
    return creation.randn(*input.shape, dtype=dtype or input.dtype, device=device,
                          requires_grad=requires_grad)


def randint_like(input: Tensor, low: int = 0, high: int | None = None, *, dtype: Any = None,  # noqa: A002
                 **_: Any) -> Tensor:
    """Integers in [low, high) with input's shape (one bound: [0, low))."""
    if high is None:
        low, high = 0, low
    return creation.randint(low, high, tuple(input.shape), dtype=dtype or input.dtype)


def _new(self: Tensor, fill: Any, size: tuple, dtype: Any, device: Any,
         requires_grad: bool) -> Tensor:
    dims = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
    dev = backend.device(device) if device is not None else backend.device_of(self.array)
    dt = dtypes.to_np(dtype, dev.type) if dtype is not None else self.array.dtype
    xp = backend.xp_for(dev)
    with backend.device_context(dev):
        arr = xp.empty(dims, dt) if fill is None else xp.full(dims, fill, dt)
    return Tensor(arr, requires_grad=requires_grad)


def new_zeros(self: Tensor, *size: Any, dtype: Any = None, device: Any = None,
              requires_grad: bool = False) -> Tensor:
    """Zeros of `size` with self's dtype and device unless given."""
    return _new(self, 0, size, dtype, device, requires_grad)


def new_ones(self: Tensor, *size: Any, dtype: Any = None, device: Any = None,
             requires_grad: bool = False) -> Tensor:
    """Ones of `size` with self's dtype and device unless given."""
    return _new(self, 1, size, dtype, device, requires_grad)


def new_full(self: Tensor, size: Any, fill_value: Any, *, dtype: Any = None, device: Any = None,
             requires_grad: bool = False) -> Tensor:
    """fill_value over `size` with self's dtype and device unless given."""
    return _new(self, fill_value, (tuple(size),), dtype, device, requires_grad)


def new_empty(self: Tensor, *size: Any, dtype: Any = None, device: Any = None,
              requires_grad: bool = False) -> Tensor:
    """An uninitialised tensor of `size` with self's dtype and device unless given."""
    return _new(self, None, size, dtype, device, requires_grad)


def new_tensor(self: Tensor, data: Any, *, dtype: Any = None, device: Any = None,
               requires_grad: bool = False) -> Tensor:
    """A copy of data with self's dtype and device unless given."""
    dev = device if device is not None else backend.device_of(self.array)
    return creation.tensor(val(data) if isinstance(data, Tensor) else data,
                           dtype=dtype or self.dtype, device=dev, requires_grad=requires_grad)
