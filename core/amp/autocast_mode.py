"""`core.autocast`: which dtype each op runs in inside a mixed-precision region, as torch's.

The region's state is per thread (as torch's) and per device type: autocast("cpu") changes only
ops whose inputs live on the host, autocast("cuda") only ops on cupy arrays. The ops themselves
apply the policy on entry (core/ops/_autocast.py); this module holds the state and the lists.

The lists are torch's for the ops core has (torch 2.x, aten/src/ATen/autocast_mode.cpp):

- lower precision on both devices: matmul, linear, conv1d, conv2d, scaled_dot_product_attention,
  prelu, conv3d and conv_transpose1d/2d/3d.
  Every floating input but float64 is cast down (float64 stays, as torch leaves it).
- float32 on both devices: the losses (mse_loss, cross_entropy, nll_loss, l1_loss, huber_loss,
  kl_div, the margin and embedding losses, ...; binary_cross_entropy on the cpu only).
- float32 on cuda only: exp, log, pow, sum, softmax, log_softmax, logsumexp, layer_norm. torch's
  CPU lists leave these in their input's dtype, and the CPU table test holds shoal to torch.
- every other op runs in its inputs' dtype, mixed inputs promoted as outside autocast (bfloat16
  with float32 gives float32), which is what torch's "promote" list does for cat and stack.

Backward: each cast is a recorded op, so an op's backward runs in the dtype its forward used
and the cast's backward returns the gradient to the parameter's own dtype (float32 weights
get float32 gradients).

Cache: as torch's, a float32 leaf that requires grad (a weight) is cast down once per outermost
region and the copy reused (tied or repeated weights); the cache empties when the outermost
region exits. Casts made with grad mode off are not cached, so a no_grad use cannot hand a
graph-less copy to a later use that needs gradients.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import numpy as np

from shoal.core import dtypes

LOWER = frozenset({
    "matmul", "linear", "conv1d", "conv2d", "scaled_dot_product_attention", "prelu",
    "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
})
# The losses torch runs in float32 under autocast on both devices (binary_cross_entropy only on
# the cpu: torch refuses it under cuda autocast, as unsafe in float16).
_FP32_LOSSES = frozenset({
    "mse_loss", "cross_entropy", "nll_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
    "binary_cross_entropy_with_logits", "kl_div", "soft_margin_loss", "margin_ranking_loss",
    "hinge_embedding_loss", "cosine_embedding_loss", "poisson_nll_loss", "triplet_margin_loss",
    "multi_margin_loss", "multilabel_margin_loss",
})
FP32 = {
    "cpu": _FP32_LOSSES | {"binary_cross_entropy", "prod"},
    "cuda": _FP32_LOSSES | {
        "exp", "log", "pow", "sum", "softmax", "log_softmax", "logsumexp", "layer_norm", "prod",
    },
}
_DEVICE_TYPES = ("cpu", "cuda")
_DEFAULT_DTYPE = {"cpu": dtypes.bfloat16, "cuda": dtypes.float16}
_ALLOWED = {"cpu": (dtypes.bfloat16, dtypes.float16), "cuda": (dtypes.float16,)}


class AutocastState(threading.local):
    """The low-precision numpy dtype in force per device type on this thread (None: off)."""

    def __init__(self) -> None:
        self.lower: dict[str, np.dtype | None] = {"cpu": None, "cuda": None}
        self.active = False  # any device type on: the ops' one-attribute fast check
        self.nesting = 0  # autocast regions entered and not yet left (enabled or not)
        self.cache_enabled = True
        self.cache: dict[int, tuple] = {}  # id(weight) -> (weight, its low-precision copy)


STATE = AutocastState()


def is_autocast_enabled(device_type: str = "cuda") -> bool:
    """Whether autocast is on for device_type in this thread."""
    return STATE.lower[_check_device(device_type)] is not None


def get_autocast_dtype(device_type: str) -> dtypes.DType:
    """The dtype autocast uses (or would use) for device_type: its region's, else the default."""
    current = STATE.lower[_check_device(device_type)]
    return dtypes.from_np(current) if current is not None else _DEFAULT_DTYPE[device_type]


def _check_device(device_type: str) -> str:
    if not isinstance(device_type, str):  # torch's check and wording: a device object is refused
        raise ValueError(
            f"Expected `device_type` of type `str`, got: `{type(device_type)}`"
        )
    if device_type not in _DEVICE_TYPES:
        raise ValueError(
            f"autocast: device_type must be one of {_DEVICE_TYPES}, got {device_type!r}."
        )
    return device_type


class autocast:  # noqa: N801 - torch's name
    """Run matmul/linear/conv/attention in low precision and losses in float32 in a region.

    A context manager (`with core.autocast("cpu"):`) and a decorator (`@core.autocast("cpu")`).
    Regions nest; `enabled=False` turns autocast off inside an enclosing region.
    """

    def __init__(
        self, device_type: str, dtype: Any = None, enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> None:
        self.device_type = _check_device(device_type)
        self.fast_dtype = _DEFAULT_DTYPE[device_type] if dtype is None else dtypes.get(dtype)
        if self.fast_dtype not in _ALLOWED[device_type]:
            extra = " (cupy has no bfloat16)" if device_type == "cuda" else ""
            raise dtypes.DTypeError(
                f"autocast: on {device_type} the dtype must be one of "
                f"{list(_ALLOWED[device_type])}{extra}, got {self.fast_dtype!r}."
            )
        self.enabled = bool(enabled)
        self.cache_enabled = cache_enabled
        self._saved: list[tuple] = []

    def __enter__(self) -> "autocast":
        self._saved.append((STATE.lower[self.device_type], STATE.cache_enabled))
        STATE.lower[self.device_type] = self.fast_dtype.np if self.enabled else None
        STATE.active = any(v is not None for v in STATE.lower.values())
        if self.cache_enabled is not None:
            STATE.cache_enabled = bool(self.cache_enabled)
        STATE.nesting += 1
        return self

    def __exit__(self, *exc: Any) -> None:
        STATE.lower[self.device_type], STATE.cache_enabled = self._saved.pop()
        STATE.active = any(v is not None for v in STATE.lower.values())
        STATE.nesting -= 1
        if STATE.nesting == 0:
            STATE.cache.clear()  # weights change between steps: never reuse a cast across them

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def in_region(*args: Any, **kwargs: Any) -> Any:
            with autocast(self.device_type, self.fast_dtype, self.enabled, self.cache_enabled):
                return fn(*args, **kwargs)

        return in_region
