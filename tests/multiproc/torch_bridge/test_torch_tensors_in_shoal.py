"""shoal.collectives all_reduces torch tensors in place across real processes (float32 and
bfloat16), through DLPack, without the torch bridge."""

from __future__ import annotations

from tests.support.ranks import agent_store


def _all_reduce_torch(rank, world):
    import torch

    import shoal.collectives as c

    c.init_process_group("tcp", init_method="env://", rank=rank, world_size=world, timeout=20)
    try:
        f32 = torch.full((1000,), rank + 1.0)
        bf16 = torch.full((3, 5), 0.5 * (rank + 1), dtype=torch.bfloat16)
        big = torch.arange(300_000, dtype=torch.float32) * (rank + 1)  # over the ring threshold
        c.all_reduce(f32)
        c.all_reduce(bf16)
        c.all_reduce(big, op=c.ReduceOp.MAX)
        shoal_modules = sorted(m for m in __import__("sys").modules if m.startswith("shoal.torch"))
        return f32.unique().tolist(), bf16.float().unique().tolist(), bf16.dtype == torch.bfloat16, \
            float(big[-1]), shoal_modules
    finally:
        c.destroy_process_group()


def test_torch_tensors_are_all_reduced_in_place_at_w2(run_torch_ranks):
    store, env = agent_store()
    try:
        results = run_torch_ranks(_all_reduce_torch, 2, timeout=60, env=env)
    finally:
        store.close()
    for f32, bf16, still_bf16, last, bridge in results:
        assert f32 == [3.0]
        assert bf16 == [1.5] and still_bf16  # 0.5 + 1.0: exact in bfloat16
        assert last == 299_999 * 2
        assert bridge == []  # the intake needs no torch bridge
