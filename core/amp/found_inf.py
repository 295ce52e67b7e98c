"""Who has a say in a GradScaler's skip: parameters registered by a layer above core.

A data-parallel wrapper (collectives' DistributedDataParallel) registers the parameters it
replicates together with an agreement: a function from this rank's inf/NaN verdict to the
verdict of its whole group. `GradScaler.unscale_` applies the agreements registered for its
optimizer's parameters, so every replica skips the same steps without the user asking for it.
core never imports collectives: the function comes down through this registry.

Every rank must reach the same agreements in the same order, since each is a collective: they
are looked up over all of an optimizer's parameters (never only those with a gradient, which
can differ between ranks) and applied in registration order.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Any, Callable, Iterable

Agreement = Callable[[bool], bool]

_lock = threading.Lock()
_order = itertools.count()
# id(parameter) -> (a weak reference to it, (registration number, agreement)). The weak
# reference drops the entry when the parameter dies, so a new tensor at a reused id is not
# taken for a registered one.
_registered: dict[int, tuple[weakref.ref, tuple[int, Agreement]]] = {}


class AgreementHandle:
    """Returned by register_found_inf_agreement; remove() unregisters those parameters."""

    def __init__(self, ids: list[int], entry: tuple[int, Agreement]) -> None:
        self._ids = ids
        self._entry = entry

    def remove(self) -> None:
        """Stop applying the agreement to these parameters (idempotent)."""
        with _lock:
            for pid in self._ids:
                current = _registered.get(pid)
                if current is not None and current[1] is self._entry:
                    del _registered[pid]
        self._ids = []


def register_found_inf_agreement(params: Iterable[Any], agree: Agreement) -> AgreementHandle:
    """Make `agree` decide, with its group, any GradScaler step over one of `params`.

    A parameter registered again takes the newer agreement (one replica group per parameter).
    """
    if not callable(agree):
        raise TypeError(
            f"register_found_inf_agreement: agree must be a callable taking this rank's verdict "
            f"(bool) and returning the group's, got {type(agree).__name__}."
        )
    entry = (next(_order), agree)
    ids = []
    with _lock:
        for p in params:
            pid = id(p)
            _registered[pid] = (weakref.ref(p, _forget(pid)), entry)
            ids.append(pid)
    return AgreementHandle(ids, entry)


def _forget(pid: int) -> Callable[[weakref.ref], None]:
    def drop(ref: weakref.ref) -> None:
        with _lock:
            current = _registered.get(pid)
            if current is not None and current[0] is ref:
                del _registered[pid]

    return drop


def agreements_for(params: Iterable[Any]) -> list[Agreement]:
    """The distinct agreements registered for any of `params`, in registration order."""
    found: dict[int, Agreement] = {}
    with _lock:
        for p in params:
            hit = _registered.get(id(p))
            if hit is not None and hit[0]() is p:
                number, agree = hit[1]
                found[number] = agree
    return [found[n] for n in sorted(found)]
