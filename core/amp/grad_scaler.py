"""`core.amp.GradScaler`: dynamic loss scaling with torch's names, state and scale arithmetic.

The loss is multiplied by `scale` before backward so float16 gradients do not underflow;
`unscale_` divides the gradients back and records whether any is inf/NaN; `step` skips the
optimizer's step when one is; `update` halves the scale after a skipped step and doubles it
after `growth_interval` clean steps in a row. The scale is kept as a float32 number (torch keeps
a float32 tensor), so a sequence of scales matches torch's bit for bit.

Data parallel training: every rank must skip the same steps or the replicas drift apart. With
DDP's averaged gradients an inf on one rank reaches all of them, but not an inf in a gradient
DDP does not reduce (a parameter outside the wrapped module) or one that appears after the
reduction. So the verdict is agreed: `unscale_` passes this rank's verdict through the
agreements registered for the optimizer's parameters (core/amp/found_inf.py; DDP registers its
own) or through the scaler's own `found_inf_agreement` (set by collectives.amp's
agree_on_found_inf), and every rank uses what they return.
"""

from __future__ import annotations

import enum
import inspect
from typing import Any, Callable, Iterable

import numpy as np

from shoal.core import backend
from shoal.core.amp import found_inf
from shoal.core.tensor import Tensor

_F16 = np.dtype(np.float16)


class _Stage(enum.Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _new_optimizer_state() -> dict:
    return {"stage": _Stage.READY, "found_inf": None}


_DEVICES = ("cpu", "cuda")


def _torch_amp_order(
    device: str = "cuda", init_scale: float = 2.0**16, growth_factor: float = 2.0,
    backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True,
) -> dict:
    """torch.amp.GradScaler's parameters: the device first."""
    return dict(locals())


def _torch_cuda_amp_order(
    init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
    growth_interval: int = 2000, enabled: bool = True,
) -> dict:
    """torch.cuda.amp.GradScaler's parameters: no device (it is "cuda"), init_scale first."""
    return dict(locals(), device="cuda")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float, np.number)) and not isinstance(value, (bool, np.bool_))


class GradScaler:
    """Scales the loss, unscales gradients, skips steps with inf/NaN gradients, adapts the scale.

    Takes torch.amp's parameters, `GradScaler(device="cuda", init_scale=2.0**16,
    growth_factor=2.0, backoff_factor=0.5, growth_interval=2000, enabled=True)`, and also
    torch.cuda.amp's older order without the device, `GradScaler(init_scale, growth_factor,
    backoff_factor, growth_interval, enabled)`: a str first argument is the device, a number is
    init_scale. (Reading a number as the device would silently keep the default scale.)
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if args and _is_number(args[0]):
            order, form = "torch.cuda.amp's order, init_scale first", _torch_cuda_amp_order
        elif not args or isinstance(args[0], str):
            order, form = "torch.amp's order, device first", _torch_amp_order
        else:
            raise TypeError(
                f"GradScaler: the first argument must be a device ('cpu' or 'cuda', torch.amp's "
                f"order) or init_scale (a number, torch.cuda.amp's order), got {args[0]!r}."
            )
        try:
            inspect.signature(form).bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"GradScaler ({order}): {exc}.") from exc
        self._configure(**form(*args, **kwargs))

    def _configure(
        self, device: str, init_scale: float, growth_factor: float, backoff_factor: float,
        growth_interval: int, enabled: bool,
    ) -> None:
        if device not in _DEVICES:
            raise ValueError(f"GradScaler: device must be 'cpu' or 'cuda', got {device!r}.")
        if not _is_number(init_scale) or not 0.0 < float(init_scale) < float("inf"):
            raise ValueError(
                f"GradScaler: init_scale must be a finite number > 0, got {init_scale!r}."
            )
        if growth_factor <= 1.0:
            raise ValueError(f"GradScaler: growth_factor must be > 1.0, got {growth_factor}.")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"GradScaler: backoff_factor must be in (0, 1), got {backoff_factor}.")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(
                f"GradScaler: growth_interval must be a positive int, got {growth_interval!r}."
            )
        # Kept for torch's signature and inspection; shoal unscales gradients wherever they live.
        self.device = device
        self._enabled = bool(enabled)
        self._scale = np.float32(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = growth_interval
        self._growth_tracker = 0
        self._per_optimizer: dict[int, dict] = {}
        self.found_inf_agreement: Callable[[bool], bool] | None = None

    # -- the training-loop calls ------------------------------------------------------------
    def scale(self, outputs: Any) -> Any:
        """outputs * scale (a tensor, or tensors nested in lists/tuples); as is when disabled."""
        if not self._enabled:
            return outputs
        if isinstance(outputs, Tensor):
            return outputs * float(self._scale)  # a Python float keeps the loss's dtype
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, Iterable):
            return map(self.scale, outputs)
        raise TypeError(
            f"GradScaler.scale: outputs must be a Tensor or an iterable of Tensors, got "
            f"{type(outputs).__name__}."
        )

    def _state(self, optimizer: Any) -> dict:
        return self._per_optimizer.setdefault(id(optimizer), _new_optimizer_state())

    def unscale_(self, optimizer: Any) -> None:
        """Divide optimizer's gradients by the scale in place; record whether any is inf/NaN."""
        if not self._enabled:
            return
        state = self._state(optimizer)
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update()."
            )
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        # As torch: the reciprocal in float64, rounded to float32, then multiplied in.
        inv_scale = np.float32(1.0 / np.float64(self._scale))
        found = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.array
                if g.dtype == _F16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                # Checked before scaling: inv_scale cannot turn a finite gradient non-finite.
                if not bool(backend.array_module(g).isfinite(g).all()):
                    found = True
                g *= g.dtype.type(inv_scale)
        for agree in self._agreements(optimizer):
            found = bool(agree(found))  # a collective: every rank calls each, whatever it saw
        state["found_inf"] = found
        state["stage"] = _Stage.UNSCALED

    def _agreements(self, optimizer: Any) -> list:
        """This scaler's own agreement if it has one, else those registered for the optimizer's
        parameters (DDP registers its replicas'), looked up over every parameter, with a
        gradient or not, so that every rank finds the same ones."""
        if self.found_inf_agreement is not None:
            return [self.found_inf_agreement]
        return found_inf.agreements_for(
            p for group in optimizer.param_groups for p in group["params"]
        )

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """unscale_ (if not done yet), then optimizer.step() unless a gradient was inf/NaN."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        state = self._state(optimizer)
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is _Stage.READY:
            self.unscale_(optimizer)
        retval = None if state["found_inf"] else optimizer.step(*args, **kwargs)
        state["stage"] = _Stage.STEPPED
        return retval

    def update(self, new_scale: Any = None) -> None:
        """Shrink after a skipped step, grow after growth_interval clean steps; or set new_scale."""
        if not self._enabled:
            return
        if new_scale is not None:
            value = new_scale.item() if isinstance(new_scale, Tensor) else new_scale
            self._scale = np.float32(value)
        else:
            verdicts = [s["found_inf"] for s in self._per_optimizer.values()
                        if s["found_inf"] is not None]
            if not verdicts:
                raise RuntimeError("No inf checks were recorded prior to update().")
            if any(verdicts):
                self._scale = np.float32(self._scale * np.float32(self._backoff_factor))
                self._growth_tracker = 0
            else:
                self._growth_tracker += 1
                if self._growth_tracker == self._growth_interval:
                    grown = np.float32(self._scale * np.float32(self._growth_factor))
                    if np.isfinite(grown):  # torch never grows the scale to inf
                        self._scale = grown
                    self._growth_tracker = 0
        self._per_optimizer.clear()

    # -- inspection and checkpoints ---------------------------------------------------------
    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled)."""
        return float(self._scale) if self._enabled else 1.0

    def get_growth_factor(self) -> float:
        """The factor the scale grows by."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Set the factor the scale grows by."""
        self._growth_factor = float(new_factor)

    def get_backoff_factor(self) -> float:
        """The factor the scale shrinks by after a skipped step."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Set the factor the scale shrinks by."""
        self._backoff_factor = float(new_factor)

    def get_growth_interval(self) -> int:
        """Clean steps in a row before the scale grows."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Set the clean steps in a row before the scale grows."""
        self._growth_interval = int(new_interval)

    def is_enabled(self) -> bool:
        """Whether this scaler scales at all."""
        return self._enabled

    def state_dict(self) -> dict:
        """torch's keys: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker."""
        if not self._enabled:
            return {}
        return {
            "scale": self.get_scale(),
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            "_growth_tracker": self._growth_tracker,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore what state_dict() returned (a torch GradScaler's state_dict works too)."""
        if not self._enabled:
            return
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled "
                "instance of GradScaler."
            )
        missing = {"scale", "growth_factor", "backoff_factor", "growth_interval",
                   "_growth_tracker"} - set(state_dict)
        if missing:
            raise KeyError(f"GradScaler.load_state_dict: the state lacks {sorted(missing)}.")
        self._scale = np.float32(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._growth_tracker = int(state_dict["_growth_tracker"])


# help() and inspect show torch.amp's form; the older torch.cuda.amp order is in the docstring.
_SHOWN_SIGNATURE = inspect.signature(_torch_amp_order)
GradScaler.__signature__ = _SHOWN_SIGNATURE.replace(  # type: ignore[attr-defined]
    return_annotation=inspect.Signature.empty
)
