"""Pipes that split one stream into several or merge several into one: fork, demux and mux.

fork and demux return child pipes that share one iterator over their source and buffer what
one child read ahead of the others, with torch's rules (torch.utils.data.datapipes.iter.
combining): iterating a child again starts a new pass for all of them (with a warning when
some had not finished), and the iterators of the pass before are invalidated.
"""

from __future__ import annotations

import copy as copymodule
import warnings
from collections import deque
from typing import Any, Callable, Iterator, Optional, Union

from shoal.core.data.datapipes.iter import IterDataPipe, _ManySources, functional


def _check_instances(num_instances: int) -> None:
    if num_instances < 1:
        raise ValueError(
            f"Expected `num_instances` larger than 0, but {num_instances} is found")


class _Container:
    """What fork's and demux's children share: the source's one iterator, each child's stop,
    and which pass (generation) the live iterators belong to."""

    def __init__(self, source: IterDataPipe, num_instances: int, buffer_size: int,
                 what: str) -> None:
        self.source, self.num_instances, self.buffer_size = source, num_instances, buffer_size
        if buffer_size < 0:
            warnings.warn(f"Unlimited buffer size is set for `{what}`, please be aware of OOM "
                          "at random places", UserWarning, stacklevel=4)
        self.generation: Optional[int] = None
        self._iterator: Optional[Iterator] = None
        self._stopped = [True] * num_instances

    def begin(self, child: "_Child") -> int:
        """A child starts iterating: a new pass if it already read in this one (torch's rule:
        a child that has not iterated since the last reset joins the current pass)."""
        if self.generation is None:
            self.generation = 0
        elif self.generation == child.generation:
            self.generation += 1
            if not self.finished():
                warnings.warn("Some child DataPipes are not exhausted when __iter__ is called. "
                              "We are resetting the buffer and each child DataPipe will read "
                              "from the start again.", UserWarning, stacklevel=3)
            self.reset()
        return self.generation

    def _start(self, instance_id: int) -> None:
        if self._iterator is None and self._stopped[instance_id]:
            self._iterator = iter(self.source)
            self._stopped = [False] * self.num_instances

    def finished(self) -> bool:
        """Whether the source ran out and every child stopped."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget the pass: its iterator, buffers and positions."""
        raise NotImplementedError

    def items(self, instance_id: int) -> Iterator:
        """Child `instance_id`'s items in this pass."""
        raise NotImplementedError

    def length(self, instance_id: int) -> int:
        """Child `instance_id`'s length."""
        raise NotImplementedError


class _Forked(_Container):
    """Every child sees every item; the buffer holds those between the slowest and fastest."""

    def __init__(self, source: IterDataPipe, num_instances: int, buffer_size: int,
                 copy: Optional[str]) -> None:
        super().__init__(source, num_instances, buffer_size, "fork")
        copies = {None: lambda x: x, "shallow": copymodule.copy, "deep": copymodule.deepcopy}
        if copy not in copies:
            raise ValueError(f"Unknown copy method `{copy}` requested, choose one of None, "
                             "`shallow` or `deep`.")
        self.copy_fn: Callable = copies[copy]
        self.reset()

    def reset(self) -> None:
        self._iterator = None
        self.buffer: deque = deque()
        self.pointers = [0] * self.num_instances  # the index of each child's next item
        self.slowest = self.leading = 0
        self.end: Optional[int] = None
        self._stopped = [True] * self.num_instances

    def finished(self) -> bool:
        return self.end is not None and all(self._stopped)

    def length(self, instance_id: int) -> int:
        return len(self.source)

    def items(self, instance_id: int) -> Iterator:
        self._start(instance_id)
        try:
            while not self._stopped[instance_id]:
                self.pointers[instance_id] += 1
                at = self.pointers[instance_id]
                if self.end is not None and at == self.end:
                    self._stopped[instance_id] = True
                    break
                if self.buffer and at <= self.leading:
                    value = self.buffer[at - self.slowest - 1]
                else:
                    self.leading = at
                    try:
                        value = next(self._iterator)
                    except StopIteration:
                        self._stopped[instance_id] = True
                        self._iterator, self.end = None, self.leading
                        continue
                    self.buffer.append(value)
                if at == self.slowest + 1 and self.slowest < min(self.pointers):
                    self.slowest = min(self.pointers)
                    self.buffer.popleft()
                if 0 <= self.buffer_size < self.leading - self.slowest:
                    raise BufferError(f"ForkerIterDataPipe buffer overflow,buffer size "
                                      f"{self.buffer_size} is insufficient.")
                yield self.copy_fn(value)
        finally:
            self._stopped[instance_id] = True
            if all(self._stopped):
                self._iterator = None


class _Demuxed(_Container):
    """Each item goes to the child classifier_fn names; the others' items wait in buffers."""

    def __init__(self, source: IterDataPipe, num_instances: int,
                 classifier_fn: Callable[[Any], Optional[int]], drop_none: bool,
                 buffer_size: int) -> None:
        super().__init__(source, num_instances, buffer_size, "demux")
        self.classifier_fn, self.drop_none = classifier_fn, drop_none
        self.reset()

    def reset(self) -> None:
        self._iterator = None
        self.buffers: list[deque] = [deque() for _ in range(self.num_instances)]
        self.buffered = 0
        self.source_done = False
        self._stopped = [True] * self.num_instances

    def finished(self) -> bool:
        return self.source_done and all(self._stopped)

    def length(self, instance_id: int) -> int:
        raise TypeError(f"the length of a demux child is unknown before iterating "
                        f"(child {instance_id}), as in torch")

    def _find(self, instance_id: int) -> Any:
        while True:
            if self.source_done or self._stopped[instance_id]:
                raise StopIteration
            value = next(self._iterator)
            where = self.classifier_fn(value)
            if where is None and self.drop_none:
                continue
            if where is None or not 0 <= where < self.num_instances:
                raise ValueError("Output of the classification fn should be between 0 and "
                                 f"{self.num_instances - 1}. {where} is returned.")
            if where == instance_id:
                return value
            self.buffers[where].append(value)
            self.buffered += 1
            if 0 <= self.buffer_size < self.buffered:
                raise BufferError(f"DemultiplexerIterDataPipe buffer overflow, buffer size "
                                  f"{self.buffer_size} is insufficient.")

    def items(self, instance_id: int) -> Iterator:
        if self._iterator is None and self._stopped[instance_id]:
            self.source_done = False
        self._start(instance_id)
        try:
            while not self._stopped[instance_id]:
                if self.buffers[instance_id]:
                    self.buffered -= 1
                    yield self.buffers[instance_id].popleft()
                    continue
                try:
                    value = self._find(instance_id)
                except StopIteration:
                    self._stopped[instance_id] = True
                    self.source_done = True
                    self._iterator = None
                    continue
                yield value
        finally:
            self._stopped[instance_id] = True
            if all(self._stopped):
                self._iterator = None
            self.buffered -= len(self.buffers[instance_id])
            self.buffers[instance_id].clear()


class _Child(IterDataPipe):
    """One output of fork or demux."""

    def __init__(self, container: _Container, instance_id: int) -> None:
        self.container, self.instance_id = container, instance_id
        self.generation: Optional[int] = None

    def sources(self) -> list[IterDataPipe]:
        return [self.container.source]

    def __len__(self) -> int:
        return self.container.length(self.instance_id)


def _child_iter(self: _Child) -> "_ChildIterator":
    """Joins (or starts) the container's pass when iter() is called, as torch's hook does."""
    self.generation = self.container.begin(self)
    return _ChildIterator(self, self.generation)


# Set after the class is made: IterDataPipe wraps a class's own __iter__ into a generator,
# whose body (and so the pass bookkeeping) would wait for the first next().
_Child.__iter__ = _child_iter  # type: ignore[method-assign]


class _ChildIterator:
    """A child's iterator; it fails once another pass has started."""

    def __init__(self, child: _Child, generation: int) -> None:
        self.child, self.generation = child, generation
        self.items = child.container.items(child.instance_id)

    def __iter__(self) -> "_ChildIterator":
        return self

    def __next__(self) -> Any:
        if self.child.container.generation != self.generation:
            raise RuntimeError(
                "This iterator has been invalidated, because a new iterator has been created "
                f"from one of the ChildDataPipes of {type(self.child.container.source).__name__}.")
        return next(self.items)


@functional("fork")
class Forker(IterDataPipe):
    """num_instances pipes that each yield every item of the source (a list; the source
    itself when num_instances is 1)."""

    def __new__(cls, datapipe: IterDataPipe, num_instances: int, buffer_size: int = 1000,
                copy: Optional[str] = None) -> Union[IterDataPipe, list]:
        _check_instances(num_instances)
        if num_instances == 1:
            return datapipe
        container = _Forked(datapipe, num_instances, buffer_size, copy)
        return [_Child(container, i) for i in range(num_instances)]


@functional("demux")
class Demultiplexer(IterDataPipe):
    """num_instances pipes; item x goes to pipe classifier_fn(x) (dropped when that is None
    and drop_none, else an error)."""

    def __new__(cls, datapipe: IterDataPipe, num_instances: int,
                classifier_fn: Callable[[Any], Optional[int]], drop_none: bool = False,
                buffer_size: int = 1000) -> list:
        _check_instances(num_instances)
        container = _Demuxed(datapipe, num_instances, classifier_fn, drop_none, buffer_size)
        return [_Child(container, i) for i in range(num_instances)]


@functional("mux")
class Multiplexer(_ManySources):
    """One item from each pipe in turn, in whole rounds, until one pipe runs out."""

    def __iter__(self) -> Iterator:
        iterators = [iter(d) for d in self.datapipes]
        while True:
            round_ = []
            for it in iterators:
                try:
                    round_.append(next(it))
                except StopIteration:
                    return  # the round is left unfinished, so its items are dropped (torch)
            yield from round_

    def __len__(self) -> int:
        return min(len(d) for d in self.datapipes) * len(self.datapipes)
