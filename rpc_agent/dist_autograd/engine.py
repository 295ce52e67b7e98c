"""The distributed backward pass (torch's FAST mode) and the context manager around it.

One pass, on every worker the context touched:
- A worker *begins* the pass on first contact (the starting worker with its roots; the others
  when a `begin` or a gradient message arrives): it counts dependencies over the graph that
  its roots and all of its send functions reach (core.autograd.GraphTask), tells its peers to
  begin too, and at once answers "no gradient" for every recv function outside that graph.
- Each send function then receives exactly one message (a gradient, or None when backward
  never reaches it), so each node runs once, when its last contribution lands. The recv
  functions that finish in one step are sent back batched, one message per peer.
- A message is answered only after the work it caused here, and the messages that work sent,
  are done. Every piece of work is caused by the starting worker's roots, so when its own
  messages are answered, the whole pass is over on every worker; an error anywhere travels
  back along the same answers, and a dead peer fails the message pending on it.
- The gradients a message's own work produces for the worker that sent it ride back on the
  answer instead of going out as a message of their own, and the sender feeds them in before it
  counts the message answered. A model split in two stages thus takes one round trip per
  backward instead of two nested ones (torch's engine sends them as a second request).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Any, Optional

from shoal.core.autograd import GraphTask, post_accumulate_hooks
from shoal.core.tensor import Tensor
from shoal.rpc_agent import _current, metrics
from shoal.rpc_agent.types import RpcError
from shoal.rpc_agent.context import _local as _context_local
from shoal.rpc_agent.context import context_id as _context_id
from shoal.rpc_agent.dist_autograd import container, release
from shoal.rpc_agent.dist_autograd.types import ContextIdTypeError, DistAutogradError
from shoal.rpc_agent.functions import async_execution
from shoal.rpc_agent.futures import Future

logger = logging.getLogger(__name__)

_pass_counter = itertools.count(1)


# ----------------------------------------------------------------------------- context

class context:  # noqa: N801  (torch's name)
    """A distributed autograd context: `with context() as context_id:`; calls made inside the
    block record the graph across workers. On exit the context ends on every worker it
    touched. (A class rather than a generator: it sits on every training step's path.)"""

    __slots__ = ("_agent", "_cid", "_outer")

    def __enter__(self) -> int:
        agent = _current.get()
        outer = getattr(_context_local, "context_id", None)
        if outer is not None and container.get(outer) is not None:
            raise DistAutogradError(
                f"Already have an autograd context id for this thread (context {outer}); "
                "contexts do not nest."
            )
        self._agent, self._outer = agent, outer
        cid = self._cid = container.new_context(agent.info.id).context_id
        _context_local.context_id = cid
        return cid

    def __exit__(self, *exc: object) -> None:
        _context_local.context_id = self._outer
        release.end_here(self._cid, None)


# ----------------------------------------------------------------------------- queries

def _check_id(context_id: Any) -> int:
    if isinstance(context_id, bool) or not isinstance(context_id, int):
        raise ContextIdTypeError(
            f"A distributed autograd context id is an int, got {context_id!r}."
        )
    return context_id


def get_gradients(context_id: int) -> dict:
    """{tensor: gradient} for this worker's leaves in the context (nothing touches `.grad`).

    Raises:
        DistAutogradError: no live context of that id on this worker.
    """
    agent = _current.get()
    ctx = container.retrieve(_check_id(context_id), agent.info.name)
    with ctx.lock:
        return {leaf: grad for leaf, grad in ctx.grads.values()}


def live_context_count() -> int:
    """How many distributed autograd contexts are live on this worker."""
    return container.live_count()


# ----------------------------------------------------------------------------- one pass

class _Pass:
    """One backward pass's state on this worker."""

    __slots__ = ("agent", "ctx", "pass_id", "retain_graph", "outbox", "shown", "task",
                 "hold_for", "sent", "informed")

    def __init__(self, agent, ctx, pass_id: tuple, retain_graph: bool, roots: list) -> None:
        self.agent = agent
        self.ctx = ctx
        self.pass_id = pass_id
        self.retain_graph = retain_graph
        self.outbox: dict[int, list] = {}
        # Leaves whose .grad shows the context's gradient while their post-accumulate hooks
        # (DDP's reducer) run, as torch's reducer works on the context's gradient.
        self.shown: dict[int, tuple] = {}
        # While a feed runs (under ctx.lock): the peer whose message caused it (its gradients
        # wait for the answer), the messages sent so far, and every peer messaged in the pass.
        self.hold_for: Optional[int] = None
        self.sent: list = []
        self.informed: set = set()
        self.task = GraphTask(list(ctx.sends.values()) + roots, retain_graph, self._sink,
                              self._before_node)

    def _before_node(self) -> None:
        """Gradients finished so far leave before the engine runs another node: that node may
        block (DDP's finalize waits for its all-reduce), and the peers' work can overlap it, as
        torch's engine sends each recv function's gradient when it runs. Leaves finished by
        one node still go together, one message per peer."""
        outbox = self.outbox
        if outbox and (len(outbox) > 1 or self.hold_for not in outbox):
            self.sent += self.flush()

    def _sink(self, leaf: Any, g: Any, owned: bool) -> None:
        ctx = self.ctx
        received = ctx.recvs.get(id(leaf))
        if received is not None:
            _, src, send_id = received
            if g is not None and not owned:
                g = g.copy()  # the engine may still add into what it does not own
            self.outbox.setdefault(src, []).append((send_id, g))
            return
        if g is None:
            return
        data = leaf.array
        if g.dtype != data.dtype:
            g, owned = g.astype(data.dtype), True
        entry = ctx.grads.get(id(leaf))
        if entry is None:
            # A plain Tensor, as local autograd's .grad (a Parameter's type would make the
            # gradient itself require grad)
            grad = Tensor(g if owned else g.copy())
            ctx.grads[id(leaf)] = (leaf, grad)
        else:
            grad = entry[1]
            grad.array = grad.array + g
        hooks = post_accumulate_hooks(leaf)
        if hooks:
            if id(leaf) not in self.shown:
                self.shown[id(leaf)] = (leaf, leaf.grad)
            leaf.grad = grad
            for hook in hooks:
                hook(leaf)

    def start(self, roots: list) -> None:
        """Answer None for recv functions outside the graph, then seed the roots."""
        for tensor, src, send_id in self.ctx.recvs.values():
            if not self.task.expects(tensor):
                self.outbox.setdefault(src, []).append((send_id, None))
        for root in roots:
            seed = root.array.copy()
            seed[...] = 1
            self.task.feed(root, seed)

    def feed(self, items: list) -> None:
        """Feed gradients that arrived for this worker's send functions. Call with ctx.lock
        held."""
        ctx = self.ctx
        for send_id, grad in items:
            tensor = ctx.sends.get(send_id)
            if tensor is None:
                raise DistAutogradError(
                    f"Worker {self.agent.info.name!r} has no send function {send_id} in "
                    f"distributed autograd context {ctx.context_id}."
                )
            self.task.feed(tensor, grad)

    def flush(self) -> list:
        """Send what finished, one message per peer, except what is for `hold_for` (it rides
        on the answer to that peer's message); the messages' Futures, whose answers may carry
        gradients for this worker (see `answered` and `_drive`)."""
        hold_for = self.hold_for
        held = self.outbox.pop(hold_for, None) if hold_for is not None else None
        outbox, self.outbox = self.outbox, ({hold_for: held} if held else {})
        if not outbox:
            return []
        self.informed.update(outbox)
        me = self.agent.info.id
        metrics.DIST_BATCHES_AS_MESSAGE.inc(len(outbox))
        with _context_id(None):
            return [
                self.agent.call(
                    peer, _receive_gradients,
                    (self.ctx.context_id, self.pass_id, self.retain_graph, items, me,
                     release.take(peer)),
                    None, None, "async")
                for peer, items in outbox.items()
            ]

    def take_answer(self, items: Optional[list]) -> list:
        """Feed the gradients an answer carried back; the messages that sent."""
        if not items:
            return []
        with self.ctx.lock:
            self.hold_for = None
            self.feed(items)
            sent = self.send_finished()
            self.finish_if_done()
        return sent

    def send_finished(self) -> list:
        """After a feed (under ctx.lock): the messages it sent while it ran (see _before_node)
        and those of what is left in the outbox, sent now."""
        sent, self.sent = self.sent, []
        return sent + self.flush()

    def answered(self, sent: list) -> list:
        """Futures done once each message in `sent` is answered and what its answer carried
        back is fed here, with the messages that caused answered too."""
        return [self._taking_answer(fut) for fut in sent]

    def _taking_answer(self, sent: Future) -> Future:
        """`sent`'s answer may carry gradients for this worker: a Future done once they are
        fed and the messages they caused are answered (their work is part of the message's)."""
        answered: Future = Future("a distributed autograd message and the work it returned")

        def on_answer(fut: Future) -> None:
            exc = fut.exception()
            items = fut.value() if exc is None else None
            if exc is not None or not items:
                _settle(answered, exc)
                return
            try:
                futures = self.answered(self.take_answer(items))
            except BaseException as err:  # noqa: BLE001  (fails the pass's wait with it)
                answered.set_exception(err)
                return
            _all_ok(futures).add_done_callback(lambda f: _settle(answered, f.exception()))

        sent.add_done_callback(on_answer)
        return answered

    def take_held(self, origin: int) -> list:
        """The items held for `origin`'s answer. Call with ctx.lock held."""
        held = self.outbox.pop(origin, None)
        if held:
            metrics.DIST_BATCHES_ON_ANSWER.inc()
        return held or []

    def finish_if_done(self) -> None:
        if self.task is None or not self.task.done:
            return
        self.task = None  # it holds our bound _sink: no cycle left for the collector
        for leaf, previous in self.shown.values():
            leaf.grad = previous
        self.shown.clear()
        ctx = self.ctx
        ctx.passes.pop(self.pass_id, None)
        ctx.finished_passes.add(self.pass_id)
        if not self.retain_graph:
            ctx.graph_freed = True


def _begin(agent, ctx, pass_id: tuple, retain_graph: bool, origin: Optional[int],
           roots: list = ()) -> tuple[Optional[_Pass], list]:
    """This worker's pass state, begun now if this is its first contact; the Futures of the
    messages beginning it sent. Call with ctx.lock held."""
    state = ctx.passes.get(pass_id)
    if state is not None or pass_id in ctx.finished_passes:
        return state, []
    if ctx.failure is not None:
        raise DistAutogradError(
            f"Distributed autograd context {ctx.context_id} failed on worker "
            f"{agent.info.name!r}: {ctx.failure}"
        ) from ctx.failure
    if ctx.graph_freed:
        raise DistAutogradError(
            f"Distributed autograd context {ctx.context_id} already ran a backward pass "
            f"without retain_graph=True on worker {agent.info.name!r}; its graph is freed, so "
            "a second backward needs retain_graph=True on the first."
        )
    state = _Pass(agent, ctx, pass_id, retain_graph, list(roots))
    ctx.passes[pass_id] = state
    state.hold_for = origin
    state.start(list(roots))
    futures = state.send_finished()
    # A peer that got gradients begins on their arrival: only the others need a begin.
    informed = state.informed
    me = agent.info.id
    peers = ctx.peer_ids()
    if peers:
        with _context_id(None):
            futures += [
                agent.call(peer, _begin_remote,
                           (ctx.context_id, pass_id, retain_graph, me, release.take(peer)),
                           None, None, "async")
                for peer in peers if peer not in (me, origin) and peer not in informed
            ]
    state.finish_if_done()
    return state, futures


def _live_context(agent, cid: int) -> Any:
    ctx = container.get(cid)
    if ctx is None:
        why = container.failure_of(cid)
        raise DistAutogradError(
            f"Distributed autograd context {cid} is not live on worker {agent.info.name!r} "
            + (f"({why})" if why else "(it ended)")
            + ", so its backward pass cannot run there."
        )
    return ctx


@async_execution
def _begin_remote(cid: int, pass_id: tuple, retain_graph: bool, origin: int,
                  released: list) -> Future:
    release.apply(released, origin)
    agent = _current.get()
    ctx = _live_context(agent, cid)
    with ctx.lock:
        state, sent = _begin(agent, ctx, pass_id, retain_graph, origin)
        if state is None:
            return _done()  # this worker's part already ran
        held = state.take_held(origin)
    return _answer(state.answered(sent), held)


@async_execution
def _receive_gradients(cid: int, pass_id: tuple, retain_graph: bool, items: list,
                       origin: int, released: list) -> Future:
    release.apply(released, origin)
    agent = _current.get()
    ctx = _live_context(agent, cid)
    with ctx.lock:
        state, sent = _begin(agent, ctx, pass_id, retain_graph, origin)
        if state is None:
            raise DistAutogradError(
                f"Gradients for distributed autograd context {cid} reached worker "
                f"{agent.info.name!r} after its part of backward pass {pass_id} had finished."
            )
        state.hold_for = origin
        state.feed(items)
        sent += state.send_finished()
        held = state.take_held(origin)
        state.finish_if_done()
    return _answer(state.answered(sent), held)


def _answer(futures: list, held: list) -> Future:
    """The answer to a message: once the messages its work sent are answered, the gradients
    its work produced for the sender (`held`), or None."""
    return _all_ok(futures).then(lambda f: (f.value(), held or None)[1])


# ----------------------------------------------------------------------------- backward

def _check_roots(cid: int, roots: Any) -> list:
    if isinstance(roots, Tensor):
        roots = [roots]
    if not isinstance(roots, (list, tuple)) or not roots:
        raise DistAutogradError(
            f"backward(context {cid}): roots must be a non-empty list of Tensors, got "
            f"{roots!r}."
        )
    for i, root in enumerate(roots):
        if not isinstance(root, Tensor):
            raise DistAutogradError(
                f"backward(context {cid}): root {i} is a {type(root).__name__}, not a Tensor."
            )
        if root.array.size != 1:
            raise DistAutogradError(
                f"backward(context {cid}): root {i} has shape {tuple(root.shape)}; distributed "
                "backward starts from scalars only."
            )
        if not root.requires_grad:
            raise DistAutogradError(
                f"backward(context {cid}): root {i} does not require grad, so there is "
                "nothing to differentiate."
            )
    return list(roots)


def backward(context_id: int, roots: Any, retain_graph: bool = False) -> None:
    """Run backward from scalar `roots` across every worker the context touched; gradients
    accumulate in the context (`get_gradients`), never in `.grad`.

    Raises:
        DistAutogradError: bad roots, an unknown or ended context, a second backward without
            retain_graph, or a failure on any worker (the message names it).
    """
    agent = _current.get()
    cid = _check_id(context_id)
    ctx = container.retrieve(cid, agent.info.name)
    roots = _check_roots(cid, roots)
    pass_id = (agent.info.id, next(_pass_counter))
    start = time.perf_counter()
    try:
        with ctx.lock:
            state, sent = _begin(agent, ctx, pass_id, bool(retain_graph), None, roots)
        _drive(state, sent)
        if state.task is not None:
            raise DistAutogradError(
                f"The backward pass of distributed autograd context {cid} ended on worker "
                f"{agent.info.name!r} with send functions that never received a gradient."
            )
    except DistAutogradError:
        metrics.DIST_BACKWARD_ERROR.inc()
        raise
    except Exception as exc:
        metrics.DIST_BACKWARD_ERROR.inc()
        if isinstance(exc, RpcError) or ctx.failure is not None:
            raise DistAutogradError(
                f"The backward pass of distributed autograd context {cid} failed: {exc}"
            ) from exc
        raise
    metrics.DIST_BACKWARD_OK.inc()
    metrics.DIST_BACKWARD_SECONDS.observe(time.perf_counter() - start)


def _drive(state: _Pass, sent: list) -> None:
    """Wait in the starting thread until its messages are answered, feeding here what the
    answers carry back. One message at a time (a two-stage model's every round) is waited on
    directly and its answer fed by this thread: no callback, so no hand-off to a pool thread
    and back on the way. Several go through `answered`, failing as soon as any fails."""
    while sent:
        if len(sent) == 1:
            fut = sent.pop()
            fut.wait()
            sent = state.take_answer(fut.value())
        else:
            _all_ok(state.answered(sent)).wait()
            return


def backward_on_owner(rref, context_id: int, retain_graph: bool) -> None:
    """RRef.backward's work on the owner: the RRef's value is the root."""
    value = rref.local_value()
    if context_id == -1:
        value.backward(retain_graph=retain_graph)
    else:
        backward(context_id, [value], retain_graph)


# ----------------------------------------------------------------------------- futures

def _done() -> Future:
    fut: Future = Future("nothing to wait for")
    fut.set_result(None)
    return fut


def _settle(fut: Future, exc: Optional[BaseException]) -> None:
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(None)


def _all_ok(futures: list) -> Future:
    """Done when every future is; fails as soon as one fails, with its exception."""
    combined: Future = Future(f"{len(futures)} distributed autograd message(s)")
    if not futures:
        combined.set_result(None)
        return combined
    remaining = [len(futures)]
    lock = threading.Lock()

    def one_done(fut: Future) -> None:
        exc = fut.exception()
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
            if combined.done():
                return
            if exc is not None:
                combined.set_exception(exc)
            elif last:
                combined.set_result(None)

    for fut in futures:
        fut.add_done_callback(one_done)
    return combined
