"""examples/train_ddp.py with one fault injected at a precise placement (the fault matrix).

    fault_at.py --fault PLACEMENT --fault-step S --fault-rank R [--fault-fraction F]
                [--hidden H] TRAIN_DDP_ARGS...

Only rank R on the first attempt (SHOAL_RESTART_COUNT=0) is hurt, during step S (1-based, the
step train_ddp prints as `step S` once it is done), and it says so on one line first:

- `none`: no fault (the uninterrupted reference runs through the same wrapper).
- `sockets`: SIGKILL in the middle of the gradient bucket's all_reduce over sockets. Every byte
  this rank's all_reduce thread sends is counted (socket.socket.send/sendall/sendmsg); once
  F times the bucket's size has gone out, it sends the part of the current call that fits and
  dies. Small buckets go through the direct exchange, large ones through the ring.
- `shm`: SIGKILL inside the shared-memory all_reduce, after the rank published its chunk into
  its shared region and before the barrier that tells the peers it did.
- `backward`: SIGKILL inside core's autograd engine, just before the backward closure of the
  middle node of the step's graph runs (some gradients are accumulated, others not).
- `stop`: SIGSTOP at the start of step S; the peers' collectives must time out.

--say-path prints `[rank R] all_reduce path hierarchical|shared memory|sockets` once the
default group is made.

--hidden H widens the model (train_ddp.D_HIDDEN) so that the gradient bucket passes the 64 KiB
small-message size: the shared-memory and ring paths only carry larger arrays.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading

from shoal.examples import train_ddp

PLACEMENTS = ("none", "sockets", "shm", "backward", "stop")
# A gradient bucket has at least this many elements; DDP's control all_reduces are far smaller.
BUCKET_MIN_ELEMENTS = 1000

_current = {"step": 0}  # the step being computed (1-based), set before its forward
_armed = threading.local()


def say(message: str) -> None:
    print(message, flush=True)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _install_step_counter() -> None:
    real = train_ddp.make_batch

    def make_batch(seed, step, rank, batch_size, target_fn):
        _current["step"] = step + 1
        return real(seed, step, rank, batch_size, target_fn)

    train_ddp.make_batch = make_batch


def _wrap_bucket_all_reduce(step: int, on_bucket) -> None:
    """Call on_bucket(flat, run) instead of the tcp backend's flat all_reduce for the first
    gradient bucket of `step`; `run()` runs the real one."""
    from shoal.collectives.backends.tcp import collectives

    real = collectives.allreduce_flat
    done = []

    def allreduce_flat(links, flat, op, seq, fp):
        run = lambda: real(links, flat, op, seq, fp)  # noqa: E731
        if done or _current["step"] != step or flat.size < BUCKET_MIN_ELEMENTS:
            return run()
        done.append(True)
        return on_bucket(flat, run)

    collectives.allreduce_flat = allreduce_flat


def _install_sockets(rank: int, step: int, fraction: float) -> None:
    real_send = socket.socket.send
    real_sendall = socket.socket.sendall
    real_sendmsg = socket.socket.sendmsg
    state = {"budget": 0, "sent": 0, "total": 0}

    def spend(nbytes: int) -> int:
        """How many of `nbytes` fit in what is left of the budget."""
        return max(0, min(nbytes, state["budget"] - state["sent"]))

    def kill_after(sock, allowed: int, send_part) -> None:
        if allowed:
            real_sendall(sock, send_part(allowed))
        state["sent"] += allowed
        family = "Unix" if sock.family == socket.AF_UNIX else "TCP"
        say(f"killing rank {rank} in the all_reduce of step {step} over {family} sockets after "
            f"sending {state['sent']} bytes ({fraction:g} times its {state['total']}-byte "
            "gradient bucket)")
        die()

    def send(sock, data, *args):
        if getattr(_armed, "on", False):
            view = memoryview(data).cast("B")
            allowed = spend(len(view))
            if allowed < len(view):
                kill_after(sock, allowed, lambda n: view[:n])
            k = real_send(sock, data, *args)
            state["sent"] += k
            return k
        return real_send(sock, data, *args)

    def sendall(sock, data, *args):
        if getattr(_armed, "on", False):
            view = memoryview(data).cast("B")
            allowed = spend(len(view))
            if allowed < len(view):
                kill_after(sock, allowed, lambda n: view[:n])
            state["sent"] += len(view)
        return real_sendall(sock, data, *args)

    def sendmsg(sock, buffers, *args):
        # Counted unless it carries ancillary data (a shared-memory descriptor); flags such as
        # MSG_DONTWAIT (the pump's tagged frames) are kept.
        if getattr(_armed, "on", False) and not (args and args[0]):
            buffers = list(buffers)
            joined = b"".join(memoryview(b).cast("B") for b in buffers)
            allowed = spend(len(joined))
            if allowed < len(joined):
                kill_after(sock, allowed, lambda n: joined[:n])
            k = real_sendmsg(sock, buffers, *args)
            state["sent"] += k
            return k
        return real_sendmsg(sock, buffers, *args)

    socket.socket.send, socket.socket.sendall, socket.socket.sendmsg = send, sendall, sendmsg

    def on_bucket(flat, run):
        state["total"] = flat.nbytes
        state["budget"] = int(fraction * flat.nbytes)
        _armed.on = True
        try:
            return run()
        finally:  # reached only when the budget outlasted the all_reduce (no kill line then)
            _armed.on = False

    _wrap_bucket_all_reduce(step, on_bucket)


def _install_shm(rank: int, step: int) -> None:
    from shoal.collectives.backends.tcp import shm as _pg_shm

    real = _pg_shm.all_reduce

    def all_reduce(flat, uf, slots, barrier, chunk_bytes):
        if not getattr(_armed, "on", False):
            return real(flat, uf, slots, barrier, chunk_bytes)

        def dying_barrier():
            say(f"killing rank {rank} in the shared-memory all_reduce of step {step}: its chunk "
                "is published, the barrier not reached")
            die()

        return real(flat, uf, slots, dying_barrier, chunk_bytes)

    _pg_shm.all_reduce = all_reduce

    def on_bucket(flat, run):
        _armed.on = True
        try:
            return run()
        finally:
            _armed.on = False

    _wrap_bucket_all_reduce(step, on_bucket)


def _graph_nodes(root) -> list:
    """Every node of `root`'s graph, in the order the engine runs them (newest first)."""
    seen, stack, nodes = set(), [root], []
    while stack:
        t = stack.pop()
        node = t.grad_fn
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        stack.extend(i for i in node.inputs if i is not None and i.requires_grad)
    return sorted(nodes, key=lambda n: -n.seq)


def _install_backward(rank: int, step: int) -> None:
    from shoal import core

    real = core.Tensor.backward

    def backward(self, *args, **kwargs):
        if _current["step"] == step and self.grad_fn is not None:
            nodes = _graph_nodes(self)
            k = len(nodes) // 2
            node = nodes[k]

            def dying(g, _name=node.name(), _k=k, _n=len(nodes)):
                say(f"killing rank {rank} in the backward of step {step} at node {_k + 1} of "
                    f"{_n} ({_name})")
                die()

            node.backward_fn = dying
        return real(self, *args, **kwargs)

    core.Tensor.backward = backward


def _install_stop(rank: int, step: int) -> None:
    real = train_ddp.make_batch

    def make_batch(seed, s, rank_, batch_size, target_fn):
        if s + 1 == step:
            say(f"stopping rank {rank} at the start of step {step} (pid {os.getpid()})")
            os.kill(os.getpid(), signal.SIGSTOP)
        return real(seed, s, rank_, batch_size, target_fn)

    train_ddp.make_batch = make_batch


def _say_path() -> None:
    """Print which path the default group's large all_reduces take, once it is made."""
    from shoal import collectives

    real = collectives.init_process_group

    def init_process_group(*args, **kwargs):
        group = real(*args, **kwargs)
        pg = collectives.get_default_group()
        path = ("hierarchical" if getattr(pg, "hierarchical", False)
                else "shared memory" if getattr(pg, "uses_shared_memory", False) else "sockets")
        say(f"all_reduce path {path}")
        return group

    collectives.init_process_group = init_process_group


def main() -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--fault", choices=PLACEMENTS, required=True)
    parser.add_argument("--fault-step", type=int, default=12)
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--fault-fraction", type=float, default=0.5)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--say-path", action="store_true")
    ours, rest = parser.parse_known_args(sys.argv[1:])
    if ours.hidden is not None:
        train_ddp.D_HIDDEN = ours.hidden
    _install_step_counter()
    if ours.say_path:
        _say_path()
    rank = int(os.environ.get("RANK", "0"))
    first_attempt = os.environ.get("SHOAL_RESTART_COUNT", "0") == "0"
    if ours.fault != "none" and rank == ours.fault_rank and first_attempt:
        step = ours.fault_step
        if ours.fault == "sockets":
            _install_sockets(rank, step, ours.fault_fraction)
        elif ours.fault == "shm":
            _install_shm(rank, step)
        elif ours.fault == "backward":
            _install_backward(rank, step)
        else:
            _install_stop(rank, step)
    return train_ddp.main(rest)


if __name__ == "__main__":
    sys.exit(main())
