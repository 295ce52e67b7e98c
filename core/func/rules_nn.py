"""Batching rules for matmul, linear, losses, convolutions, dropout and random numbers.

The per-sample linear (`_per_sample_linear`) is what makes per-sample gradients cheap: under
core.func.grad inside vmap a shared weight becomes a broadcast view (one copy in memory, stride
0 along the batch), so the forward runs one GEMM on the shared copy and the backward forms the
per-sample weight gradients as one batched outer product, as torch.func's rules do.
"""

from __future__ import annotations

from typing import Any, Callable


from shoal.core.func._rulekit import at_level, batch_size, moved_to_front, value, wrap_out
from shoal.core.func.batched import STATE, rewrap
from shoal.core.func.dispatch import register, register_unbatched_hook, wrapper_for
from shoal.core.func.rules import transparent
from shoal.core.ops import arith, attention, conv, creation, derived, linalg, nn, norm, pooling
from shoal.core.ops import reduce
from shoal.core.ops import shape
from shoal.core.ops._util import result
from shoal.core.tensor import Tensor


def _matmul(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    """torch's matmul on logical shapes: 1-D operands become matrices, batch dims broadcast."""
    x, y = args[0], args[1]
    xs, ys = tuple(x.shape), tuple(y.shape)
    a2 = xs if len(xs) >= 2 else (1, *xs)
    b2 = ys if len(ys) >= 2 else (*ys, 1)
    nb = max(len(a2), len(b2)) - 2
    size = batch_size(level, args, kwargs)
    reshape = wrapper_for(shape.reshape)

    def form(t: Any, shp: tuple) -> Any:
        if at_level(t, level):
            return reshape(value(t), (size, *([1] * (nb + 2 - len(shp))), *shp))
        return reshape(t, shp) if len(shp) != t.ndim else t

    out = wrapper_for(linalg.matmul)(form(x, a2), form(y, b2))
    final = (*out.shape[1:-2], *((out.shape[-2],) if len(xs) >= 2 else ()),
             *((out.shape[-1],) if len(ys) >= 2 else ()))
    return wrap_out(reshape(out, (size, *final)), level)


def _multi_dot(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    tensors = list(args[0])
    out = tensors[0]
    for t in tensors[1:]:
        out = wrapper_for(linalg.matmul)(out, t)
    return out


def _is_shared(v: Any) -> bool:
    """A plain tensor that is one array broadcast along its batch dim (stride 0)."""
    return (v.__class__ is Tensor and v.array.ndim >= 1 and v.array.strides[0] == 0
            and v.array.shape[0] > 1)


def _linear(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    weight = args[1] if len(args) > 1 else kwargs["weight"]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    w_b, b_b = at_level(weight, level), bias is not None and at_level(bias, level)
    if not w_b and not b_b:
        return transparent(call, level, (x, weight, bias), {})
    if (STATE.first_order and at_level(x, level) and w_b and value(x).__class__ is Tensor
            and _is_shared(value(weight))
            and (bias is None or (b_b and _is_shared(value(bias))))):
        return wrap_out(_per_sample_linear(value(x), value(weight),
                                           None if bias is None else value(bias)), level)
    out = wrapper_for(linalg.matmul)(x, wrapper_for(shape.transpose)(weight, -2, -1))
    return out if bias is None else wrapper_for(arith.add)(out, bias)


def _per_sample_linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """x (B, ..., in) by a weight shared across the batch, (B, out, in) with stride 0: one GEMM
    forward; the backward gives each sample its own weight gradient. First order only (the
    caller checks), since its backward is written on arrays."""
    xd, w0 = x.array, w.array[0]
    b0 = None if b is None else b.array[0]
    bsz = xd.shape[0]
    x2 = xd.reshape(-1, xd.shape[-1])
    out2 = x2 @ w0.T
    if b0 is not None:
        out2 += b0
    out = out2.reshape(*xd.shape[:-1], w0.shape[0])

    def backward(g: Any) -> tuple:
        g3 = g.reshape(bsz, -1, g.shape[-1])
        gx = (g.reshape(-1, g.shape[-1]) @ w0).reshape(xd.shape) if x.requires_grad else None
        gw = None
        if w.requires_grad:
            x3 = xd.reshape(bsz, -1, xd.shape[-1])
            gw = g3.swapaxes(1, 2) @ x3 if g3.shape[1] > 1 else g3[:, 0, :, None] * x3[:, 0, None]
        gb = g3.sum(axis=1) if b is not None and b.requires_grad else None
        return gx, gw, gb

    return result(out, "PerSampleLinearBackward", backward, (x, w, b))


def _fold_samples(call: Callable, level: int, args: tuple, kwargs: dict, sample_dims: int) -> Any:
    """conv/pool: a sample of `sample_dims` dims goes in as a batch of one per sample; a
    mini-batch per sample is folded into the op's batch dim and unfolded after."""
    x = args[0]
    if not at_level(x, level) or any(at_level(a, level) for a in (*args[1:], *kwargs.values())):
        raise NotImplementedError(f"vmap: {call.__name__} supports a batched input only (its "
                                  "weights must be the same for every sample).")
    v = value(x)
    if x.ndim == sample_dims:
        return wrap_out(call(v, *args[1:], **kwargs), level)
    reshape = wrapper_for(shape.reshape)
    folded = reshape(v, (v.shape[0] * v.shape[1], *v.shape[2:]))
    out = call(folded, *args[1:], **kwargs)
    return wrap_out(reshape(out, (v.shape[0], v.shape[1], *out.shape[1:])), level)


def _image_op(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    return _fold_samples(call, level, args, kwargs, 3)


def _signal_op(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    return _fold_samples(call, level, args, kwargs, 2)


def _batch_norm(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    """Eval-mode batch norm is per element (running statistics): the samples' mini-batches fold
    into one. In training its statistics would mix the samples, so it is refused, as torch.func
    refuses it (use eval mode, or GroupNorm/LayerNorm, for per-sample gradients)."""
    names = ("input", "running_mean", "running_var", "weight", "bias", "training")
    bound = {**dict(zip(names, args)), **kwargs}
    if bound.get("training", False):
        raise NotImplementedError(
            "vmap: batch_norm in training mode computes statistics over the batch, which would "
            "mix the samples; put the module in eval mode or use GroupNorm/LayerNorm.")
    x = bound.pop("input")
    rest = {k: v for k, v in bound.items()}
    if any(at_level(v, level) for v in rest.values()):
        raise NotImplementedError("vmap: batch_norm with batched statistics or affine "
                                  "parameters is not supported.")
    v = value(x)
    reshape = wrapper_for(shape.reshape)
    folded = reshape(v, (v.shape[0] * v.shape[1], *v.shape[2:]))
    out = call(folded, **rest)
    return wrap_out(reshape(out, tuple(v.shape)), level)


def _all_in_front(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    """Ops over leading batch dims that must agree: every tensor gets the batch dim."""
    size = batch_size(level, args, kwargs)

    def lift(a: Any) -> Any:
        return moved_to_front(a, level, size) if isinstance(a, Tensor) else a

    return wrap_out(call(*[lift(a) for a in args], **{k: lift(v) for k, v in kwargs.items()}),
                    level)


def _mse_loss(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    inp, target = args[0], args[1]
    reduction = args[2] if len(args) > 2 else kwargs.get("reduction", "mean")
    diff = wrapper_for(arith.sub)(inp, target)
    sq = wrapper_for(arith.mul)(diff, diff)
    if reduction == "none":
        return sq
    return wrapper_for(reduce.mean if reduction == "mean" else reduce.sum)(sq)


def _class_loss(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    """cross_entropy / nll_loss: one call with reduction='none' on the folded batch, then each
    sample's own reduction (the mean over its non-ignored targets, as torch's)."""
    names = ("input", "target", "weight", "ignore_index", "reduction", "label_smoothing")
    bound = {**dict(zip(names, args)), **kwargs}
    inp, target = bound["input"], bound["target"]
    weight = bound.get("weight")
    reduction = bound.get("reduction", "mean")
    ignore = bound.get("ignore_index", -100)
    if weight is not None and (at_level(weight, level) or reduction == "mean"):
        raise NotImplementedError(f"vmap: {call.__name__} with class weights and reduction "
                                  f"{reduction!r} is not supported; use reduction='none'.")
    size = batch_size(level, args, kwargs)
    x = moved_to_front(inp, level, size)
    t = moved_to_front(target, level, size) if isinstance(target, Tensor) else target
    reshape = wrapper_for(shape.reshape)
    extra = {k: v for k, v in bound.items() if k in ("weight", "ignore_index", "label_smoothing")}
    if inp.ndim >= 2:
        x = reshape(x, (size * x.shape[1], *x.shape[2:]))
        t = reshape(t, (size * t.shape[1], *t.shape[2:]))
    losses = call(x, t, reduction="none", **extra)
    if inp.ndim >= 2:
        losses = reshape(losses, (size, inp.shape[0], *losses.shape[1:]))
    per_sample = wrap_out(losses, level)
    if reduction == "none":
        return per_sample
    total = wrapper_for(reduce.sum)(per_sample)
    if reduction == "sum":
        return total
    if target.dtype.is_floating_point:
        return wrapper_for(reduce.mean)(per_sample)
    kept = wrapper_for(arith.ne)(target, ignore)
    count = wrapper_for(reduce.sum)(kept, dtype=total.dtype)
    return wrapper_for(arith.div)(total, count)


def _randomness(level: int) -> str:
    for lvl, _, mode in STATE.levels:
        if lvl == level:
            return mode
    return "error"


RANDOM_ERROR = ("vmap: called random operation while in randomness error mode. Please either "
                "use the 'same' or 'different' randomness flags on vmap or perform the "
                "randomness operation out of vmap")


def _dropout(call: Callable, level: int, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    training = args[2] if len(args) > 2 else kwargs.get("training", True)
    if not training or p == 0.0:
        return x
    mode = _randomness(level)
    if mode == "error":
        raise RuntimeError(RANDOM_ERROR)
    if mode == "different":
        return transparent(call, level, (x, p, training), {})
    mask = call(creation.ones(*x.shape, dtype=x.dtype, device=x.device), p, training)
    return wrapper_for(arith.mul)(x, mask)


def _random_creation(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """randn/rand/randint under vmap: refused, the same for every sample, or one per sample."""
    different = []
    for lvl, size, mode in STATE.levels:
        if mode == "error":
            raise RuntimeError(RANDOM_ERROR)
        if mode == "different":
            different.append((lvl, size))
    if not different:
        return fn(*args, **kwargs)
    sizes = tuple(s for _, s in different)
    if fn.__name__ == "randint":  # fn runs the op's own code (dispatch's copy)
        low, high, shp = (args + (None, ()))[:3] if len(args) >= 2 else (0, args[0], ())
        shp = kwargs.pop("size", shp)
        out = fn(low, high, (*sizes, *tuple(shp)), **kwargs)
    else:
        out = fn(*sizes, *shape._shape_args(args), **kwargs)  # noqa: SLF001 - its own parser
    return rewrap(out, [lvl for lvl, _ in different])


def _register_all() -> None:
    register([linalg.matmul, derived.mm, derived.bmm], _matmul)
    register(derived.multi_dot, _multi_dot)
    register(nn.linear, _linear)
    register(nn.mse_loss, _mse_loss)
    register([nn.cross_entropy, nn.nll_loss], _class_loss)
    register(nn.dropout, _dropout)
    register([nn.layer_norm, nn.embedding, nn.one_hot], transparent)
    register([conv.conv2d, pooling.max_pool2d, pooling.avg_pool2d,
              pooling.adaptive_avg_pool2d], _image_op)
    register(conv.conv1d, _signal_op)
    register(attention.scaled_dot_product_attention, _all_in_front)
    register(norm.batch_norm, _batch_norm)
    register_unbatched_hook([creation.randn, creation.rand, creation.randint], _random_creation)


_register_all()

