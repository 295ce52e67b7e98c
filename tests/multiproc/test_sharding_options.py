"""fully_shard's options, the FullyShardedDataParallel wrapper, hybrid sharding and the ZeRO
state dict, with ranks as threads of one process over real tcp groups (sockets and shared
memory; no process start-up, so each case runs in well under a second).

Models are built before the threads start: core's global RNG is not thread-safe, and every rank
must start from the same weights, as ranks seeded alike do.
"""

from __future__ import annotations

import numpy as np
import pytest

from shoal import core
from shoal.collectives.backends.tcp.group import ProcessGroupTCP
from shoal.collectives.fsdp import (
    CPUOffloadPolicy,
    FullyShardedDataParallel,
    MixedPrecisionPolicy,
    ShardingStrategy,
)
from shoal.collectives.optim import ZeroRedundancyOptimizer
from shoal.collectives.store.hash import HashStore
from shoal.collectives.store.prefix import PrefixStore
from tests.multiproc.test_sharding import (
    LR,
    STEPS,
    batch,
    full_state,
    make_model,
    mse,
    reference,
    sharded,
)
from tests.support.threaded_ranks import form_groups, run_all

RTOL, ATOL = 1e-9, 1e-10  # float64, sums in another order only (see test_sharding.py)


def _groups(world, prefix="g"):
    store = PrefixStore(prefix, HashStore())
    return form_groups(world, lambda r: ProcessGroupTCP(store, r, world, timeout=10))


def _train(model, rank, steps=STEPS, opt=None, micro=1):
    opt = opt or core.optim.Adam(model.parameters(), lr=LR)
    for step in range(steps):
        opt.zero_grad()
        for m in range(micro):
            x, y = batch(step * micro + m, rank)
            if micro > 1:
                model.set_requires_gradient_sync(m == micro - 1)
            mse(model(x), y, 1.0 / micro).backward()
        opt.step()
    return opt


def _check(results, want, rtol=RTOL, atol=ATOL):
    for rank, got in enumerate(results):
        assert not isinstance(got, BaseException), got
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=rtol, atol=atol,
                                       err_msg=f"rank {rank} {name}")


def test_offload_policy_and_the_wrapper_match_one_process():
    pgs = _groups(2)
    models = [make_model() for _ in range(4)]

    def body(pg, rank):
        a = sharded(models[rank], pg, offload_policy=CPUOffloadPolicy())
        _train(a, rank)
        b = FullyShardedDataParallel(models[2 + rank], process_group=pg,
                                     auto_wrap_policy={core.nn.Linear},
                                     sharding_strategy=ShardingStrategy.SHARD_GRAD_OP)
        _train(b, rank)
        return {"offload": full_state(a), "wrapper": full_state(b.module)}

    results = run_all(pgs, body)
    want = reference(2)
    _check([r["offload"] for r in results], want)
    _check([{k.removeprefix("module."): v for k, v in r["wrapper"].items()} for r in results],
           want)


def test_gradient_sync_off_accumulates_micro_batches_locally():
    pgs = _groups(2, "acc")
    models = [make_model() for _ in range(2)]
    want_model = make_model()
    opt = core.optim.Adam(want_model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(2):
            for rank in range(2):
                x, y = batch(step * 2 + m, rank)
                mse(want_model(x), y, 0.25).backward()
        opt.step()
    want = {k: v.numpy() for k, v in want_model.state_dict().items()}
    results = run_all(pgs, lambda pg, r: full_state(_sharded_trained(models[r], pg, r)))
    _check(results, want)


def _sharded_trained(model, pg, rank):
    model = sharded(model, pg)
    _train(model, rank, micro=2)
    return model


def test_mixed_precision_gathers_and_reduces_in_float32():
    pgs = _groups(2, "mp")
    models = [make_model() for _ in range(2)]
    policy = MixedPrecisionPolicy(param_dtype=core.float32, reduce_dtype=core.float32)

    def body(pg, rank):
        model = sharded(models[rank], pg, mp_policy=policy)
        seen = []
        model.fc1.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
        _train(model, rank, opt=core.optim.SGD(model.parameters(), lr=0.1))
        shard = model.fc1.weight
        return full_state(model), seen[0], shard.dtype, shard.grad.dtype

    results = run_all(pgs, body)
    for _, gathered, kept, grad in results:
        assert (gathered, kept, grad) == (core.float32, core.float64, core.float64)
    ref = make_model()
    opt = core.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(2):
            x, y = batch(step, rank)
            mse(ref(x), y, 0.5).backward()
        opt.step()
    # float32 compute: weights rounded to 2^-24 relative, activations and gradients through
    # three layers of at most 13-term sums keep a relative error of a few 1e-7; SGD moves each
    # weight by lr * grad (lr 0.1, |grad| < 4 here), so three steps differ by about 1e-7.
    _check([r[0] for r in results], {k: v.numpy() for k, v in ref.state_dict().items()},
           rtol=0, atol=1e-6)


def hybrid_groups(timeout):
    """(shard groups, replicate groups) of four ranks as threads: ranks {0,1} and {2,3} are the
    "hosts" (shard groups); {0,2} and {1,3} replicate."""
    store = HashStore()
    shard = form_groups(4, lambda r: ProcessGroupTCP(
        PrefixStore(f"shard{r // 2}", store), r % 2, 2, timeout=timeout))
    replicate = form_groups(4, lambda r: ProcessGroupTCP(
        PrefixStore(f"rep{r % 2}", store), r // 2, 2, timeout=timeout))
    return shard, replicate


def test_hybrid_sharding_shards_within_pairs_and_replicates_across():
    world = 4
    shard, replicate = hybrid_groups(timeout=10)
    models = [make_model() for _ in range(world)]

    def body(pg, rank):
        mesh = (replicate[rank], shard[rank])
        model = sharded(models[rank], mesh)
        _train(model, rank)
        return full_state(model)

    results = run_all(list(range(world)), lambda _, rank: body(None, rank))
    _check(results, reference(world))
    assert models[0].fc1.weight.numel() == -(-13 * 7 // 2)  # half of fc1, not a quarter


def test_zero_state_dict_loads_back_into_fresh_optimizers():
    pgs = _groups(3, "zero")
    models = [make_model() for _ in range(6)]

    def body(pg, rank):
        model = models[rank]
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=core.optim.Adam,
                                       process_group=pg, lr=LR)
        for step in range(2):
            zero.zero_grad()
            x, y = batch(step, 0)  # every rank the same batch: no DDP needed
            mse(model(x), y).backward()
            zero.step()
        zero.consolidate_state_dict(to=1)
        full = [zero.state_dict() if rank == 1 else None]
        pg.broadcast_object_list(full, 1)
        if rank != 1:
            with pytest.raises(RuntimeError, match="consolidate_state_dict"):
                zero.state_dict()
        fresh = ZeroRedundancyOptimizer(models[3 + rank].parameters(),
                                        optimizer_class=core.optim.Adam, process_group=pg,
                                        lr=0.5)
        fresh.load_state_dict(full[0])
        mine = {id(p): i for i, p in enumerate(models[3 + rank].parameters())}
        return (fresh.param_groups[0]["lr"],
                {mine[id(p)]: s["exp_avg"].numpy().copy() for p, s in fresh.optim.state.items()},
                full[0])

    results = run_all(pgs, body)
    held = {}
    for lr, local, full in results:
        assert lr == LR
        for index, exp_avg in local.items():
            assert index not in held  # each parameter's state on exactly one rank
            held[index] = exp_avg
            assert np.array_equal(exp_avg, full["state"][index]["exp_avg"].numpy())
    assert sorted(held) == list(range(6))


def test_full_state_dicts_gather_and_scatter_whole_tensors():
    from shoal.collectives.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    pgs = _groups(2, "full")
    models = [make_model() for _ in range(2)]
    core.manual_seed(5)
    others = [make_model(hidden=13) for _ in range(2)]
    whole = {k: v.numpy() for k, v in models[0].state_dict().items()}

    def body(pg, rank):
        trained = sharded(models[rank], pg)
        full = get_model_state_dict(trained, options=StateDictOptions(full_state_dict=True))
        fresh = sharded(others[rank], pg)
        set_model_state_dict(fresh, full)
        return ({k: v.numpy() for k, v in full.items()}, full_state(fresh))

    for full, loaded in run_all(pgs, body):
        for name, value in whole.items():
            assert np.array_equal(full[name], value), name
            assert np.array_equal(loaded[name], value), name


def test_clip_grad_norm_uses_the_whole_models_norm():
    pgs = _groups(3, "clip")
    models = [make_model() for _ in range(3)]

    def body(pg, rank):
        model = sharded(models[rank], pg)
        x, y = batch(0, rank)
        mse(model(x), y).backward()
        norm = model.clip_grad_norm_(0.05)
        return float(norm.item()), full_state_grads(model)

    results = run_all(pgs, body)
    ref = make_model()
    for rank in range(3):
        x, y = batch(0, rank)
        mse(ref(x), y, 1.0 / 3).backward()
    want = float(core.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item())
    for norm, grads in results:
        # float64 sums of squares in another order: a few ulps of a norm near 1.
        assert abs(norm - want) < 1e-6 * want
        for name, p in ref.named_parameters():
            np.testing.assert_allclose(grads[name], p.grad.numpy(), rtol=1e-9, atol=1e-12)


def full_state_grads(model):
    """Each parameter's whole gradient, gathered from the shards' gradients."""
    out = {}
    for name, p in model.named_parameters():
        world = p.group.size()
        whole = np.empty(p.array.size * world, dtype=p.grad.array.dtype)
        p.group.all_gather_into_tensor(whole, np.ascontiguousarray(p.grad.array)).wait()
        out[name] = whole[:int(np.prod(p.global_shape))].reshape(p.global_shape)
    return out


def test_explicit_prefetch_and_an_early_unshard_change_nothing_but_timing():
    pgs = _groups(2, "prefetch")
    models = [make_model() for _ in range(2)]

    def body(pg, rank):
        model = sharded(models[rank], pg)
        model.set_modules_to_forward_prefetch([model.fc1, model.fc2])  # the root gathers both
        model.fc2.set_modules_to_backward_prefetch([model.fc1])
        handle = model.fc1.unshard(async_op=True)  # before any forward: waited in forward
        handle.wait()
        _train(model, rank)
        return full_state(model)

    _check(run_all(pgs, body), reference(2))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_activation_checkpointing_inside_sharded_layers_keeps_the_gradients(use_reentrant):
    from shoal.core.utils.checkpoint import checkpoint

    pgs = _groups(2, f"ac{use_reentrant}")
    models = [make_model() for _ in range(2)]

    def forward(model, x):
        # The layers' forwards run again in backward: their weights must be there then.
        h = checkpoint(lambda t: model.fc1(t).tanh(), x, use_reentrant=use_reentrant)
        h = checkpoint(lambda t: model.fc2(t).tanh(), h, use_reentrant=use_reentrant)
        return model.head(h)

    def body(pg, rank):
        model = sharded(models[rank], pg)
        opt = core.optim.Adam(model.parameters(), lr=LR)
        for step in range(STEPS):
            opt.zero_grad()
            x, y = batch(step, rank)
            x.requires_grad = use_reentrant  # the reentrant form needs an input that does
            mse(_root_call(model, forward, x), y).backward()
            opt.step()
        return full_state(model)

    _check(run_all(pgs, body), reference(2))


def _root_call(model, forward, x):
    """forward(model, x) as the root's own forward, so that the root's hooks run around it."""
    model.forward = lambda t: forward(model, t)
    return model(x)


@pytest.mark.parametrize("world", [2, 3])
def test_zero_overlapped_with_ddp_steps_in_the_hook(world):
    from shoal.collectives.ddp.comm_hooks import allreduce_hook
    from shoal.collectives.ddp.ddp import DistributedDataParallel
    from shoal.collectives.optim import hook_with_zero_step

    pgs = _groups(world, f"overlap{world}")
    models = [make_model() for _ in range(world)]

    def body(pg, rank):
        ddp = DistributedDataParallel(models[rank], process_group=pg, bucket_cap_mb=0.0005)
        zero = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=core.optim.Adam,
                                       process_group=pg, overlap_with_ddp=True, lr=LR)
        ddp.register_comm_hook(pg, hook_with_zero_step(allreduce_hook, ddp, zero))
        for step in range(STEPS):
            zero.zero_grad()
            x, y = batch(step, rank)
            mse(ddp(x), y).backward()  # the step and the exchange happen in here
        assert zero.step() is None
        zero.consolidate_state_dict(to=0)  # the buckets' steps kept one state per parameter
        if rank == 0:
            assert sorted(zero.state_dict()["state"]) == list(range(6))
            assert {s["step"] for s in zero.state_dict()["state"].values()} == {STEPS}
        return {k: v.numpy().copy() for k, v in models[rank].state_dict().items()}

    _check(run_all(pgs, body), reference(world))


def test_a_sharded_layer_whose_output_is_unused_is_reduced_and_keeps_no_gradient():
    from shoal.collectives.fsdp import fully_shard

    pgs = _groups(2, "unused")
    models = [make_model() for _ in range(2)]
    extras = [core.nn.Linear(7, 4, dtype=core.float64) for _ in range(2)]

    def body(pg, rank):
        model = models[rank]
        model.extra = extras[rank]
        fully_shard(model.extra, mesh=pg)
        sharded(model, pg)
        plain = type(model).__mro__[2].forward  # Net.forward, under FSDPModule's subclass

        def forward(t):
            model.extra(t)  # runs forward, its output goes nowhere: no gradient reaches it
            return plain(model, t)

        opt = core.optim.Adam(model.parameters(), lr=LR)
        for step in range(STEPS):
            opt.zero_grad()
            x, y = batch(step, rank)
            mse(_root_call(model, lambda m, t: forward(t), x), y).backward()
            opt.step()
        assert model.extra.weight.grad is None  # as in one process: Adam leaves it alone
        return {k: v for k, v in full_state(model).items() if not k.startswith("extra.")}

    _check(run_all(pgs, body), reference(2))


def test_a_grad_scaler_skips_on_every_rank_when_one_rank_s_shard_overflowed():
    pgs = _groups(2, "scaler")
    models = [make_model() for _ in range(2)]

    def body(pg, rank):
        model = sharded(models[rank], pg)
        opt = core.optim.SGD(model.parameters(), lr=0.1)
        scaler = core.amp.GradScaler("cpu", init_scale=4.0)
        x, y = batch(0, rank)
        scaler.scale(mse(model(x), y)).backward()
        if rank == 1:
            model.fc2.weight.grad.array[0] = np.inf  # only rank 1's shard sees it
        before = model.fc1.weight.numpy(force=True).copy()
        scaler.step(opt)
        scaler.update()
        return np.array_equal(model.fc1.weight.numpy(force=True), before), scaler.get_scale()

    # Both ranks skip (fc1 untouched, though its gradients are finite) and halve the scale.
    assert run_all(pgs, body) == [(True, 2.0), (True, 2.0)]
