"""The callee's side of the agent: run an incoming call on a pool thread and send its reply
(or its error, or, for remote(), keep the value in the owner's record and say that it is set)."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from shoal.rpc_agent._generated import rpc_pb2
from shoal.rpc_agent.context import context_id as _context_id
from shoal.rpc_agent.dist_autograd import container as autograd_contexts
from shoal.rpc_agent.frames import ERROR, RESPONSE
from shoal.rpc_agent.functions import is_async_execution
from shoal.rpc_agent.futures import AnyFuture
from shoal.rpc_agent.missing_function import explain as explain_missing_function
from shoal.rpc_agent.profiled_result import ProfiledResult
from shoal.rpc_agent.serialization import deserialize, serialize_exception
from shoal.rpc_agent.transport.data_channel import DataChannels
from shoal.rpc_agent.types import RpcError, WorkerInfo
from shoal.rpc_agent.workers import WorkerTable

logger = logging.getLogger(__name__)


class CallServer:
    """Serves the calls that reach worker `me`; `encode` is the agent's FrameEncoder.encode,
    `data` its data channels (large results leave there) and `workers` its worker table."""

    def __init__(self, me: WorkerInfo, encode: Callable[..., tuple[bytes, list]],
                 data: DataChannels, workers: WorkerTable):
        self._me = me
        self._encode = encode
        self._data = data
        self._workers = workers

    def serve(self, stream, frame, payload, buffers, error: Optional[str], record) -> None:
        """Run one incoming call on a pool thread and reply."""
        rid, fname = frame.request_id, frame.function
        if buffers is None:
            buffers = [bytearray(d.inline_data) for d in frame.buffers]
        cid = frame.context_id if frame.HasField("context_id") else None
        try:
            if error is not None:
                raise RpcError(f"The arguments of {fname} did not arrive whole: {error}.")
            if cid is not None:
                autograd_contexts.touch(cid, stream.peer_id)
            try:
                func, args, kwargs = deserialize(payload, buffers, stream.peer_id, cid)
            except (AttributeError, ImportError) as exc:
                # the function may be missing here: say so as torch does, naming it
                missing = explain_missing_function(fname, exc, self._me)
                if missing is None:
                    raise
                raise missing from exc
            if cid is not None:
                with _context_id(cid):
                    result = func(*args, **kwargs) if kwargs else func(*args)
            else:
                result = func(*args, **kwargs) if kwargs else func(*args)
            if is_async_execution(func):
                if not isinstance(result, AnyFuture):
                    raise RpcError(
                        f"{fname} is marked @async_execution but returned "
                        f"{type(result).__name__}, not a Future."
                    )
                result.add_done_callback(
                    lambda f: self._reply_outcome(stream, rid, fname, f, record, cid)
                )
                return
        except BaseException as exc:  # noqa: BLE001  (travels back to the caller)
            self._reply(stream, rid, fname, None, exc, record)
            return
        self._reply(stream, rid, fname, result, None, record, cid)

    def _reply_outcome(self, stream, rid: int, fname: str, fut: AnyFuture, record,
                       cid: Optional[int]) -> None:
        if fut.exception() is not None:
            self._reply(stream, rid, fname, None, fut.exception(), record)
        else:
            self._reply(stream, rid, fname, fut.value(), None, record, cid)

    def _reply(self, stream, rid: int, fname: str, value: Any,
               exc: Optional[BaseException], record, cid: Optional[int] = None) -> None:
        if record is None:
            self._send_reply(stream, rid, fname, value, exc, cid)
            return
        # A remote(): the owner keeps the value; the caller only learns that it is set (and,
        # when it profiles, gets the callee's events).
        shipped = None
        if exc is None and type(value) is ProfiledResult:
            value, shipped = value.value, value.without_value()
        future = record.future
        if not future.has_callbacks():
            # (a record may have failed already: a remote() to this worker that timed out)
            future.try_complete(value, exc)
            self._send_reply(stream, rid, fname, shipped, exc, cid)
            return
        # Something waits on the value, most often the caller's to_here() (whose fetch ran
        # first, rref.TABLE_CALLS): this reply waits for the fetch's, which completing the
        # value sends from this thread, and both leave in one message (Stream.send).
        self._send_reply(stream, rid, fname, shipped, exc, cid, more_coming=True)
        future.try_complete(value, exc)

    def _send_reply(self, stream, rid: int, fname: str, value: Any,
                    exc: Optional[BaseException], cid: Optional[int],
                    more_coming: bool = False) -> None:
        big = []
        if exc is None:
            try:
                frame, big = self._encode(RESPONSE, rid, fname, value, stream.peer_id, cid=cid)
            except Exception as pickle_exc:  # noqa: BLE001  (any pickling failure is replied)
                exc = RpcError(
                    f"The result of {fname} on worker {self._me.name!r} cannot be pickled: "
                    f"{pickle_exc}"
                )
                exc.__cause__ = pickle_exc
        if exc is not None:
            frame = rpc_pb2.Frame(
                kind=ERROR, request_id=rid, function=fname,
                payload=serialize_exception(exc, self._me.name),
            ).SerializeToString()
        try:
            stream.send(frame, more_coming)
            if big:
                self._data.send(stream.peer_id, self._workers.data_addresses[stream.peer_id],
                                big, self._log_lost_result(fname))
        except RpcError as send_exc:
            # The caller's side sees the same dead stream and fails the call itself.
            logger.info("Worker %r could not reply to %s for %s: %s",
                        self._me.name, stream.describe(), fname, send_exc)

    def _log_lost_result(self, fname: str) -> Callable[[BaseException], None]:
        def log(exc: BaseException) -> None:
            logger.info("Worker %r could not send the result of %s: %s", self._me.name, fname,
                        exc)
        return log
