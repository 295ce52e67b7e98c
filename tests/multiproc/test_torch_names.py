"""torch.distributed's names, side by side with torch: each spawned rank joins a torch gloo group
and a shoal group, runs the same call on both with the same inputs, and the two must agree
(values, which rank gets what, and which calls refuse); that test is skipped where torch is not
installed. The process group and RPC sharing one MASTER_ADDR:PORT needs no torch and always runs.

Covers the groups' names (group.WORLD, get_backend's "gloo", get_group_rank/get_global_rank,
new_subgroups, new_subgroups_by_enumeration), the bitwise ReduceOps, PREMUL_SUM (shoal runs it
where gloo refuses: compared with torch's SUM of the scaled inputs), all_to_all_single (even and
uneven splits),
reduce_scatter_tensor, all_gather_into_tensor, gather_object, scatter_object_list,
batch_isend_irecv with P2POp, the coalesced calls, the ProcessGroup methods
(allreduce_coalesced, _allgather_base, _reduce_scatter_base, alltoall, alltoall_base) and their
futures, Work.get_future() and _source_rank().
"""

from __future__ import annotations

import socket

import numpy as np
import pytest

from tests.support.ranks import agent_store, run_ranks

pytestmark = pytest.mark.timeout(180)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _both(fn_torch, fn_shoal):
    """(torch's outcome, shoal's): a value, or ('raises', exception class name)."""
    out = []
    for fn in (fn_torch, fn_shoal):
        try:
            out.append(fn())
        except Exception as exc:  # noqa: BLE001  (compared by the caller)
            out.append(("raises", type(exc).__name__))
    return out


def _session(rank: int, world: int, torch_port: int) -> dict:
    import torch
    import torch.distributed as td

    import shoal.collectives as sd

    td.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank,
                          world_size=world)
    sd.init_process_group("gloo", init_method="env://", timeout=60)
    T = lambda a: torch.from_numpy(np.array(a))  # noqa: E731
    seen: dict = {}

    # -- groups
    seen["backend"] = (td.get_backend(), sd.get_backend())
    seen["world is default"] = (td.group.WORLD is td.distributed_c10d._get_default_group(),
                                sd.group.WORLD is sd.get_default_group(),
                                sd.GroupMember.WORLD is sd.get_default_group())
    t_sub, s_sub = td.new_group([1]), sd.new_group([1])
    if rank == 1:
        seen["group rank"] = (td.get_group_rank(t_sub, 1), sd.get_group_rank(s_sub, 1))
        seen["global rank"] = (td.get_global_rank(t_sub, 0), sd.get_global_rank(s_sub, 0))
        seen["sub backend"] = (td.get_backend(t_sub), sd.get_backend(s_sub))
    t_mine, t_all = td.new_subgroups(group_size=1)
    s_mine, s_all = sd.new_subgroups(group_size=1)
    seen["subgroups"] = ((td.get_process_group_ranks(t_mine), len(t_all)),
                         (sd.get_process_group_ranks(s_mine), len(s_all)))

    # -- new_subgroups_by_enumeration: (my group or None, every group), used for all_reduce
    for label, lists in (("pair", [[0, 1]]), ("each alone", [[0], [1]]), ("only 1", [[1]])):
        outcome = []
        for mod in (td, sd):
            mine, every = mod.new_subgroups_by_enumeration(lists)
            total = None
            if mine is not None:
                x = T(np.full(2, rank + 1.0)) if mod is td else np.full(2, rank + 1.0)
                mod.all_reduce(x, group=mine)
                total = np.asarray(x).tolist()
            outcome.append((None if mine is None else mod.get_process_group_ranks(mine),
                            [g is mod.GroupMember.NON_GROUP_MEMBER for g in every], total))
        seen[f"by enumeration {label}"] = tuple(outcome)
    for label, lists in (("overlap", [[0, 1], [1]]), ("empty", [])):
        seen[f"by enumeration {label} refused"] = _both(
            lambda: td.new_subgroups_by_enumeration(lists),
            lambda: sd.new_subgroups_by_enumeration(lists))

    ints = np.array([0b1100 + rank, 0b1010 * (rank + 1), 7 - rank], dtype=np.int32)
    bools = np.array([True, rank == 0, False, True])
    for name in ("BAND", "BOR", "BXOR"):
        for label, data in (("int32", ints), ("bool", bools)):
            if label == "bool" and name == "BXOR":
                continue  # gloo has no xor for bool
            t, s = T(data), data.copy()
            td.all_reduce(t, op=getattr(td.ReduceOp, name))
            sd.all_reduce(s, op=getattr(sd.ReduceOp, name))
            seen[f"{name} {label}"] = (t.numpy().tolist(), s.tolist())
        seen[f"{name} float"] = _both(
            lambda: td.all_reduce(torch.ones(2), op=getattr(td.ReduceOp, name)),
            lambda: sd.all_reduce(np.ones(2), op=getattr(sd.ReduceOp, name)))

    # -- PREMUL_SUM: torch's SUM of the scaled inputs is the reference
    x = np.arange(4.0) + rank
    t = T(x * 0.5)
    td.all_reduce(t)
    s = x.copy()
    sd.all_reduce(s, op=sd._make_nccl_premul_sum(0.5))
    seen["premul"] = (t.numpy().tolist(), s.tolist())

    # -- all_to_all_single, even and uneven
    inp = np.arange(4 * 3, dtype=np.float32).reshape(4, 3) + 100 * rank
    t_out, s_out = torch.empty(4, 3), np.empty((4, 3), np.float32)
    td.all_to_all_single(t_out, T(inp))
    sd.all_to_all_single(s_out, inp)
    seen["a2a even"] = (t_out.numpy().tolist(), s_out.tolist())
    in_splits = [1, 3] if rank == 0 else [2, 2]  # rank r sends in_splits[j] rows to j
    out_splits = [[1, 2], [3, 2]][rank]
    t_out, s_out = torch.empty(sum(out_splits), 3), np.empty((sum(out_splits), 3), np.float32)
    td.all_to_all_single(t_out, T(inp), out_splits, in_splits)
    sd.all_to_all_single(s_out, inp, out_splits, in_splits)
    seen["a2a uneven"] = (t_out.numpy().tolist(), s_out.tolist())

    # -- reduce_scatter_tensor and all_gather_into_tensor
    big = np.arange(world * 3, dtype=np.float32) * (rank + 1)
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        t_out, s_out = torch.empty(3), np.empty(3, np.float32)
        seen[name] = _both(
            lambda: getattr(td, name)(t_out, T(big)) or t_out.numpy().tolist(),
            lambda: getattr(sd, name)(s_out, big) or s_out.tolist())
    for name in ("all_gather_into_tensor", "all_gather_single"):
        t_out, s_out = torch.empty(world * 3), np.empty(world * 3, np.float32)
        getattr(td, name)(t_out, T(big[:3]))
        getattr(sd, name)(s_out, big[:3])
        seen[name] = (t_out.numpy().tolist(), s_out.tolist())

    # -- object collectives
    obj = {"rank": rank, "items": list(range(rank + 2))}
    t_list = [None] * world if rank == 1 else None
    s_list = [None] * world if rank == 1 else None
    td.gather_object(obj, t_list, dst=1)
    sd.gather_object(obj, s_list, dst=1)
    seen["gather_object"] = (t_list, s_list)
    inputs = [{"to": j, "blob": "x" * (10 * j + 1)} for j in range(world)] if rank == 0 else None
    t_o, s_o = [None], [None]
    td.scatter_object_list(t_o, inputs, src=0)
    sd.scatter_object_list(s_o, inputs, src=0)
    seen["scatter_object_list"] = (t_o, s_o)

    # -- batch_isend_irecv: a ring exchange
    right, left = (rank + 1) % world, (rank - 1) % world
    send = np.full(3, float(rank), np.float32)
    t_recv, s_recv = torch.empty(3), np.empty(3, np.float32)
    for w in td.batch_isend_irecv([td.P2POp(td.isend, T(send), right),
                                   td.P2POp(td.irecv, t_recv, left)]):
        w.wait()
    for w in sd.batch_isend_irecv([sd.P2POp(sd.isend, send, right),
                                   sd.P2POp(sd.irecv, s_recv, left)]):
        w.wait()
    seen["batch_isend_irecv"] = (t_recv.numpy().tolist(), s_recv.tolist())
    seen["P2POp refuses"] = _both(lambda: td.P2POp(td.all_reduce, T(send), right),
                                  lambda: sd.P2POp(sd.all_reduce, send, right))

    # -- coalesced
    parts = [np.arange(3.0) + rank, np.ones((2, 2)) * (rank + 2)]  # float64: torch.empty's is float32
    t_parts, s_parts = [T(p) for p in parts], [p.copy() for p in parts]
    td.all_reduce_coalesced(t_parts)
    sd.all_reduce_coalesced(s_parts)
    seen["all_reduce_coalesced"] = ([p.numpy().tolist() for p in t_parts], [p.tolist() for p in s_parts])
    t_outs = [[torch.empty(3, dtype=torch.float64), torch.empty(2, 2, dtype=torch.float64)]
              for _ in range(world)]
    s_outs = [[np.empty(3), np.empty((2, 2))] for _ in range(world)]
    td.all_gather_coalesced(t_outs, [T(p) for p in parts])
    sd.all_gather_coalesced(s_outs, parts)
    seen["all_gather_coalesced"] = ([[p.numpy().tolist() for p in row] for row in t_outs],
                                    [[p.tolist() for p in row] for row in s_outs])

    # -- torch's ProcessGroup methods on the default groups, each through Work.get_future()
    t_pg, s_pg = td.distributed_c10d._get_default_group(), sd.get_default_group()

    def flat(value):  # a future's tensors end to end (gloo's _allgather_base gives blocks)
        return np.concatenate([np.asarray(v.numpy() if hasattr(v, "numpy") else v).reshape(-1)
                               for v in value]).tolist()

    parts = [np.arange(3.0) + rank, np.ones((2, 2)) * (rank + 2)]
    t_parts, s_parts = [T(p) for p in parts], [p.copy() for p in parts]
    t_val = t_pg.allreduce_coalesced(t_parts, td.AllreduceCoalescedOptions()).get_future().wait()
    s_val = s_pg.allreduce_coalesced(s_parts, sd.AllreduceCoalescedOptions()).get_future().wait()
    seen["pg.allreduce_coalesced"] = (([p.numpy().tolist() for p in t_parts], flat(t_val)),
                                      ([p.tolist() for p in s_parts], flat(s_val)))
    mine = np.arange(3.0) + 10 * rank
    t_out, s_out = torch.empty(world * 3, dtype=torch.float64), np.empty(world * 3)
    t_val = t_pg._allgather_base(t_out, T(mine)).get_future().wait()
    s_val = s_pg._allgather_base(s_out, mine).get_future().wait()
    seen["pg._allgather_base"] = ((t_out.numpy().tolist(), flat(t_val)),
                                  (s_out.tolist(), flat(s_val)))
    big = np.arange(world * 2.0) * (rank + 1)
    t_out, s_out = torch.empty(2, dtype=torch.float64), np.empty(2)
    t_pg._reduce_scatter_base(t_out, T(big)).wait()  # gloo's Work has no future here
    s_val = s_pg._reduce_scatter_base(s_out, big).get_future().wait()
    seen["pg._reduce_scatter_base"] = ((t_out.numpy().tolist(), t_out.numpy().tolist()),
                                       (s_out.tolist(), flat(s_val)))
    ins = [np.full(2, 10.0 * rank + j) for j in range(world)]
    t_outs, s_outs = [torch.empty(2, dtype=torch.float64) for _ in range(world)], \
        [np.empty(2) for _ in range(world)]
    t_val = t_pg.alltoall(t_outs, [T(x) for x in ins], td.AllToAllOptions()).get_future().wait()
    s_val = s_pg.alltoall(s_outs, ins, sd.AllToAllOptions()).get_future().wait()
    seen["pg.alltoall"] = (([o.numpy().tolist() for o in t_outs], flat(t_val)),
                           ([o.tolist() for o in s_outs], flat(s_val)))
    in_splits = [1, 2] if rank == 0 else [2, 3]  # rank r sends in_splits[j] rows to rank j
    out_splits = [[1, 2], [2, 3]][rank]
    inp = np.arange(float(sum(in_splits))) + 100 * rank
    t_out, s_out = torch.empty(sum(out_splits), dtype=torch.float64), np.empty(sum(out_splits))
    t_val = t_pg.alltoall_base(t_out, T(inp), out_splits, in_splits,
                               td.AllToAllOptions()).get_future().wait()
    s_val = s_pg.alltoall_base(s_out, inp, out_splits, in_splits,
                               sd.AllToAllOptions()).get_future().wait()
    seen["pg.alltoall_base"] = ((t_out.numpy().tolist(), flat(t_val), len(t_val)),
                                (s_out.tolist(), flat(s_val), len(s_val)))

    # -- Work.get_future() and _source_rank()
    t, s = T(np.arange(3.0) + rank), np.arange(3.0) + rank
    t_val = td.all_reduce(t, async_op=True).get_future().wait()
    s_val = sd.all_reduce(s, async_op=True).get_future().wait()
    seen["get_future"] = ([v.numpy().tolist() for v in t_val], [np.asarray(v).tolist() for v in s_val])
    if rank == 0:
        t_buf, s_buf = torch.empty(1), np.empty(1)
        t_w, s_w = td.irecv(t_buf), sd.irecv(s_buf)
        t_w.wait()
        s_w.wait()
        seen["source rank"] = ((t_w._source_rank(), t_buf.item()), (s_w._source_rank(), s_buf.item()))
    else:
        td.send(torch.tensor([5.0]), dst=0)
        sd.send(np.array([5.0]), dst=0)

    # -- torch's group_src / group_dst (ranks of the group, not of the world)
    t, s = T(np.full(2, float(rank))), np.full(2, float(rank))
    td.broadcast(t, group_src=1)
    sd.broadcast(s, group_src=1)
    seen["group_src"] = (t.numpy().tolist(), s.tolist())
    if rank == 1:  # the subgroup [1]: its rank 0 is world rank 1
        t, s = T(np.ones(2)), np.ones(2)
        td.reduce(t, group=t_sub, group_dst=0)
        sd.reduce(s, group=s_sub, group_dst=0)
        seen["group_dst in a subgroup"] = (t.numpy().tolist(), s.tolist())
        seen["src and group_src"] = _both(lambda: td.broadcast(t, src=1, group_src=0),
                                          lambda: sd.broadcast(s, src=1, group_src=0))
        td.send(T(np.array([7.0])), group_dst=0)
        sd.send(np.array([7.0]), group_dst=0)
    else:
        t, s = T(np.zeros(1)), np.zeros(1)
        seen["recv group_src"] = ((td.recv(t, group_src=1), t.item()),
                                  (sd.recv(s, group_src=1), float(s[0])))

    # -- send_object_list / recv_object_list, from any source
    if rank == 1:
        for mod in (td, sd):
            mod.send_object_list([{"a": 1}, "two", [3] * 40], dst=0)
    else:
        t_objs, s_objs = [None] * 3, [None] * 3
        t_src = td.recv_object_list(t_objs, src=1)
        s_src = sd.recv_object_list(s_objs)
        seen["object lists"] = ((t_src, t_objs), (s_src, s_objs))

    td.barrier()
    sd.barrier()
    td.destroy_process_group()
    sd.destroy_process_group()
    return seen


def test_torch_names_agree_with_torch():
    pytest.importorskip("torch.distributed")  # this test only: the shared-port one needs no torch
    store, env = agent_store()
    try:
        results = run_ranks(_session, 2, args=(_free_port(),), timeout=150, env=env)
    finally:
        store.close()
    for rank, seen in enumerate(results):
        for key, pair in seen.items():
            if key == "world is default":
                assert all(pair), (rank, key, pair)
            elif key == "backend":
                assert pair == ("gloo", "gloo"), (rank, pair)
            elif key.endswith((" float", " refused")) or key in ("P2POp refuses",
                                                                  "src and group_src"):
                assert pair[0][0] == "raises" and pair[1][0] == "raises", (rank, key, pair)
                if key.endswith(" refused"):
                    assert pair[0] == pair[1] == ("raises", "ValueError"), (rank, key, pair)
            elif key.startswith("reduce_scatter_") and pair[0][0] == "raises":
                # this gloo has no reduce_scatter_tensor: numpy's block sum is the reference
                big = [np.arange(6, dtype=np.float32) * (r + 1) for r in range(2)]
                assert pair[1] == (big[0] + big[1])[3 * rank:3 * rank + 3].tolist(), (rank, pair)
            else:
                assert pair[0] == pair[1], (rank, key, pair)


def _pg_and_rpc_on_one_port(rank: int, world: int, rpc_first: bool) -> list:
    import operator

    import shoal.collectives as sd
    from shoal import rpc_agent

    def start_rpc():
        rpc_agent.init_rpc(f"worker{rank}", rank=rank, world_size=world)

    if rpc_first:
        start_rpc()
    sd.init_process_group("gloo", init_method="env://", timeout=60)
    if not rpc_first:
        start_rpc()
    x = np.array([float(rank + 1)])
    sd.all_reduce(x)
    other = rpc_agent.rpc_sync(f"worker{(rank + 1) % world}", operator.add, args=(rank, 10))
    rpc_agent.shutdown()
    sd.destroy_process_group()
    return [float(x[0]), other]


@pytest.mark.parametrize("rpc_first", [False, True], ids=["group-then-rpc", "rpc-then-group"])
def test_a_process_group_and_rpc_share_master_addr_and_port(rpc_first):
    # A script outside `shoal run`: rank 0 hosts the store on MASTER_PORT for both (torch's
    # env:// stores are multi-tenant); before, the second one failed "Address already in use".
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "SHOAL_USE_AGENT_STORE": "0"}
    results = run_ranks(_pg_and_rpc_on_one_port, 2, args=(rpc_first,), timeout=120, env=env)
    assert results == [[3.0, 10], [3.0, 11]]
