"""The RPC stream's handshake: the client's signed hello (gRPC metadata), the server's answer
(its first message), and the keys both ends derive from them.

The hello names the receiving worker and its incarnation (32 random bytes the worker draws when
it starts and publishes beside its address), so a hello captured off the wire opens nothing once
that worker restarted; the server remembers the client nonces it saw (transport/grpc.py) so none
opens a second stream meanwhile. The answer carries a fresh stream nonce and the server's proof
over all three nonces; the stream's keys (`core.channel.pair`) come from the secret and them, so
a relay that forwarded an honest hello cannot speak on the stream afterwards.
"""

from __future__ import annotations

import secrets
import struct
import time

from shoal.core import auth
from shoal.core.channel import Link, pair
from shoal.rpc_agent._generated import rpc_pb2
from shoal.rpc_agent.types import RpcError

HELLO_METADATA = "shoal-hello-bin"
PURPOSE_CLIENT = "rpc-stream"
PURPOSE_SERVER = "rpc-stream-server"
NONCE_BYTES = 32


def hello_signing_bytes(hello: rpc_pb2.Hello) -> bytes:
    """What a hello's proof signs."""
    # A fixed layout rather than the protobuf encoding, which is not guaranteed canonical.
    return (
        hello.name.encode() + b"\0"
        + struct.pack("!iid?", hello.id, hello.to_id, hello.timestamp, hello.encrypt)
        + hello.nonce + b"\0" + hello.server_nonce
    )


def client_hello(token: bytes, name: str, worker_id: int, to_id: int, incarnation: bytes,
                 encrypt: bool) -> rpc_pb2.Hello:
    """The signed hello with which worker `worker_id` opens a stream to `to_id`, whose
    published incarnation is `incarnation`."""
    hello = rpc_pb2.Hello(name=name, id=worker_id, to_id=to_id, timestamp=time.time(),
                          nonce=secrets.token_bytes(NONCE_BYTES), server_nonce=incarnation,
                          encrypt=encrypt)
    hello.proof = auth.sign(token, PURPOSE_CLIENT, hello_signing_bytes(hello))
    return hello


def _server_proof(token: bytes, server_id: int, hello: rpc_pb2.Hello, stream_nonce: bytes) -> bytes:
    return auth.sign(token, PURPOSE_SERVER, struct.pack("!i?", server_id, hello.encrypt)
                     + hello.nonce + hello.server_nonce + stream_nonce)


def stream_link(token: bytes, hello: rpc_pb2.Hello, stream_nonce: bytes, *, server: bool,
                peer: str) -> Link:
    """One end's keys for the stream opened by `hello` and answered with `stream_nonce`."""
    return pair(token, PURPOSE_CLIENT, hello.server_nonce + stream_nonce, hello.nonce,
                        server=server, encrypt=hello.encrypt, peer=peer)


def server_answer(token: bytes, server_id: int, hello: rpc_pb2.Hello) -> tuple[bytes, bytes]:
    """The payload of a server's first (HELLO) frame for `hello`, and its stream nonce."""
    stream_nonce = secrets.token_bytes(NONCE_BYTES)
    return stream_nonce + _server_proof(token, server_id, hello, stream_nonce), stream_nonce


def check_server_answer(token: bytes, hello: rpc_pb2.Hello, first: bytes, peer: str
                        ) -> Link:
    """The client's keys, once the server's first message `first` proves the secret.

    Raises:
        RpcError: it is not a valid proof of this job's secret for `hello`.
    """
    batch = rpc_pb2.Batch.FromString(first)
    payload = bytes(batch.frames[0].payload) if len(batch.frames) == 1 else b""
    if (len(batch.frames) != 1 or batch.frames[0].kind != rpc_pb2.HELLO
            or len(payload) != 2 * NONCE_BYTES):
        raise RpcError("its first frame is not a valid proof of this job's secret")
    stream_nonce, proof = payload[:NONCE_BYTES], payload[NONCE_BYTES:]
    if not auth.verify(token, PURPOSE_SERVER, struct.pack("!i?", hello.to_id, hello.encrypt)
                       + hello.nonce + hello.server_nonce + stream_nonce, proof):
        raise RpcError("its first frame is not a valid proof of this job's secret")
    return stream_link(token, hello, stream_nonce, server=False, peer=peer)
