"""core.linalg beyond the op table: torch's errors for singular and non-definite input (type
and message, batch element included), QR modes, decompositions reconstructing their input,
gradients against finite differences, vmap and batched input, and double differentiation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal import core
from shoal.core import func, linalg

# torch.func's first transform call sets itself up (about a second); done at import so that the
# first test's time is its own.
torch.func.hessian(torch.sin)(torch.tensor(0.0))


def _pair(*shape: int, seed: int = 0) -> tuple:
    arr = np.random.default_rng(seed).standard_normal(shape)
    return core.tensor(arr), torch.tensor(arr)


def _message(fn, *args, **kwargs) -> str:
    with pytest.raises(RuntimeError) as info:
        fn(*args, **kwargs)
    return str(info.value)


def test_linalg_error_is_torch_s_runtime_error_subclass() -> None:
    assert issubclass(linalg.LinAlgError, RuntimeError)
    assert issubclass(linalg.LinAlgError, core.ShoalError)


@pytest.mark.parametrize("name", ["inv", "solve", "cholesky"])
def test_singular_input_raises_torch_s_message(name: str) -> None:
    single = np.zeros((3, 3))
    batch = np.stack([np.eye(3), np.diag([1.0, -1.0, 1.0]) if name == "cholesky" else single])
    for arr in (single if name != "cholesky" else -np.eye(3), batch):
        args = (arr,) if name != "solve" else (arr, np.ones(arr.shape[:-1]))
        theirs = _message(getattr(torch.linalg, name), *map(torch.tensor, args))
        with pytest.raises(linalg.LinAlgError) as info:
            getattr(linalg, name)(*map(core.tensor, args))
        ours = str(info.value)
        # torch's own text, minus its "torch." prefix differences (none for these three)
        assert ours == theirs


def test_matrix_power_of_a_singular_matrix_names_inv() -> None:
    theirs = _message(torch.linalg.matrix_power, torch.zeros(3, 3), -1)
    with pytest.raises(linalg.LinAlgError, match="linalg.inv: The diagonal element 1 is zero"):
        linalg.matrix_power(core.zeros(3, 3), -1)
    assert "linalg.inv: The diagonal element 1 is zero" in theirs


@pytest.mark.parametrize("call", [
    lambda lib, x: lib.linalg.inv(x[:2]),
    lambda lib, x: lib.linalg.det(x[0]),
    lambda lib, x: lib.linalg.inv(x.long()),
    lambda lib, x: lib.linalg.inv(x.half()),
    lambda lib, x: lib.linalg.eigh(x, UPLO="X"),
    lambda lib, x: lib.linalg.qr(x, mode="thin"),
    lambda lib, x: lib.linalg.matrix_norm(x, ord=3),
    lambda lib, x: lib.linalg.norm(x[None], ord=2),
    lambda lib, x: lib.linalg.cross(x[:, :2], x[:, :2]),
    lambda lib, x: lib.linalg.vector_norm(x.long()),
])
def test_bad_arguments_raise_what_torch_raises(call) -> None:
    x, tx = _pair(3, 3)
    theirs = _message(call, torch, tx)
    assert _message(call, core, x) == theirs


def test_qr_modes_and_their_gradients() -> None:
    a, ta = _pair(5, 3)
    for mode in ("reduced", "complete", "r"):
        q, r = linalg.qr(a, mode=mode)
        tq, tr = torch.linalg.qr(ta, mode=mode)
        assert tuple(q.shape) == tuple(tq.shape) and tuple(r.shape) == tuple(tr.shape)
        np.testing.assert_allclose(np.abs(r.numpy()), np.abs(tr.numpy()), atol=1e-12)
    for mode, text in (("complete", "not differentiable when mode='complete'"),
                       ("r", "depends on Q, which is not computed")):
        x = a.clone().requires_grad_()
        tx = ta.clone().requires_grad_()
        with pytest.raises(RuntimeError, match=text):
            torch.linalg.qr(tx, mode=mode)[1].sum().backward()
        with pytest.raises(RuntimeError, match=text):
            linalg.qr(x, mode=mode)[1].sum().backward()


def test_decompositions_reconstruct_batched_input() -> None:
    a, _ = _pair(4, 5, 3, seed=1)
    u, s, vh = linalg.svd(a, full_matrices=False)
    np.testing.assert_allclose((u.numpy() * s.numpy()[:, None, :]) @ vh.numpy(), a.numpy(),
                               atol=1e-12)  # float64 LAPACK: ~10 ulp of |A| ~ 3
    sym = a @ a.mT
    w, v = linalg.eigh(sym)
    np.testing.assert_allclose((v.numpy() * w.numpy()[:, None, :]) @ v.mT.numpy(), sym.numpy(),
                               atol=1e-12)
    chol = linalg.cholesky(sym + 3 * core.eye(5, dtype=core.float64))
    np.testing.assert_allclose(chol.numpy() @ chol.mT.numpy(),
                               sym.numpy() + 3 * np.eye(5), atol=1e-12)
    q, r = linalg.qr(a)
    np.testing.assert_allclose(q.numpy() @ r.numpy(), a.numpy(), atol=1e-12)


def _finite_difference(fn, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central differences of a scalar function: error ~eps**2 |f'''| plus 1e-16/eps rounding,
    about 1e-10 here."""
    grad = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        e = np.zeros_like(x)
        e[idx] = eps
        grad[idx] = (fn(x + e) - fn(x - e)) / (2 * eps)
    return grad


@pytest.mark.parametrize("name,loss", [
    ("eigh vectors", lambda a: (linalg.eigh(a[:3] + a[:3].mT)[1] ** 4).sum()),
    ("svd, all three", lambda a: (linalg.svd(a, full_matrices=False)[0] ** 4).sum()
     + linalg.svd(a, full_matrices=False)[1].sum() + (linalg.svd(a)[2] ** 4).sum()),
    ("pinv", lambda a: (linalg.pinv(a) ** 2).sum()),
    ("lstsq", lambda a: linalg.lstsq(a, a[:, :1] * 2 + 1).solution.sum()),
    ("slogdet", lambda a: linalg.slogdet(a[:3])[1]),
    ("matrix_norm nuc", lambda a: linalg.matrix_norm(a, "nuc")),
])
def test_gradients_match_finite_differences(name: str, loss) -> None:
    a = np.random.default_rng(7).standard_normal((4, 3))
    x = core.tensor(a, requires_grad=True)
    loss(x).backward()
    fd = _finite_difference(lambda v: loss(core.tensor(v)).item(), a)
    np.testing.assert_allclose(x.grad.numpy(), fd, rtol=1e-6, atol=1e-7, err_msg=name)


def test_wide_svd_gradient_matches_torch() -> None:
    a, ta = _pair(3, 5, seed=3)
    x, tx = a.clone().requires_grad_(), ta.clone().requires_grad_()
    u, s, vh = linalg.svd(x, full_matrices=False)
    tu, ts, tvh = torch.linalg.svd(tx, full_matrices=False)
    ((u ** 4).sum() + (vh ** 4).sum() + s.sum()).backward()
    ((tu ** 4).sum() + (tvh ** 4).sum() + ts.sum()).backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), atol=1e-10)


def test_vmap_over_linalg_matches_the_batched_call() -> None:
    a, ta = _pair(6, 3, 3, seed=4)
    b, tb = _pair(3, seed=5)
    np.testing.assert_allclose(func.vmap(linalg.inv)(a).numpy(), torch.linalg.inv(ta).numpy(),
                               rtol=1e-10)
    np.testing.assert_allclose(func.vmap(linalg.solve, in_dims=(0, None))(a, b).numpy(),
                               torch.linalg.solve(ta, tb).numpy(), rtol=1e-10)
    np.testing.assert_allclose(func.vmap(linalg.norm)(a).numpy(),
                               torch.linalg.norm(ta, dim=(1, 2)).numpy(), rtol=1e-12)
    per_sample = func.vmap(func.grad(lambda m: linalg.slogdet(m)[1]))(a)
    np.testing.assert_allclose(per_sample.numpy(), torch.linalg.inv(ta).mT.numpy(), rtol=1e-10)


@pytest.mark.parametrize("name", ["inv", "det", "solve", "vector_norm"])
def test_hessians_through_linalg_match_torch(name: str) -> None:
    a, ta = _pair(3, 3, seed=6)
    b, tb = _pair(3, seed=8)
    fns = {
        "inv": (lambda m: linalg.inv(m).sum(), lambda m: torch.linalg.inv(m).sum()),
        "det": (linalg.det, torch.linalg.det),
        "solve": (lambda m: linalg.solve(m, b).sum(), lambda m: torch.linalg.solve(m, tb).sum()),
        "vector_norm": (lambda m: linalg.vector_norm(m, 3), lambda m: torch.linalg.vector_norm(m, 3)),
    }
    ours, theirs = fns[name]
    # float64 second derivatives of functions of inv(A): cond(A) ~ 10 costs a few digits
    np.testing.assert_allclose(func.hessian(ours)(a).numpy(),
                               torch.func.hessian(theirs)(ta).numpy(), rtol=1e-9, atol=1e-9)


def _complex(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((3, 3)) + 1j * rng.standard_normal((3, 3))


@pytest.mark.parametrize("name", ["inv", "det", "solve", "cholesky", "eigvalsh", "svdvals",
                                  "pinv", "vector_norm", "matrix_norm", "solve_triangular",
                                  "matrix_exp", "lstsq", "matrix_power", "cross", "cond",
                                  "vecdot", "multi_dot"])
def test_complex_gradients_match_torch(name: str) -> None:
    """torch's convention (the conjugate Wirtinger derivative) for a real loss of complex A."""
    def spd(lib, x):
        return x @ x.conj().mT + 3 * lib.eye(3)

    losses = {
        "inv": lambda lib, x: (lib.linalg.inv(x).abs() ** 2).sum(),
        "det": lambda lib, x: lib.linalg.det(x).abs(),
        "solve": lambda lib, x: (lib.linalg.solve(x, x[:, 0]).abs() ** 2).sum(),
        "cholesky": lambda lib, x: (lib.linalg.cholesky(spd(lib, x)).abs() ** 2).sum(),
        "eigvalsh": lambda lib, x: (lib.linalg.eigvalsh(spd(lib, x)) ** 2).sum(),
        "svdvals": lambda lib, x: lib.linalg.svdvals(x).sum(),
        "pinv": lambda lib, x: (lib.linalg.pinv(x).abs() ** 2).sum(),
        "vector_norm": lambda lib, x: lib.linalg.vector_norm(x, 3),
        "matrix_norm": lambda lib, x: lib.linalg.matrix_norm(x, "nuc"),
        "solve_triangular": lambda lib, x: (lib.linalg.solve_triangular(
            x, x[:2], upper=False, left=False).abs() ** 2).sum(),
        "matrix_exp": lambda lib, x: (lib.linalg.matrix_exp(x * 0.5).abs() ** 2).sum(),
        "lstsq": lambda lib, x: (lib.linalg.lstsq(x, x[:, :1]).solution.abs() ** 2).sum(),
        "matrix_power": lambda lib, x: (lib.linalg.matrix_power(x, -2).abs() ** 2).sum(),
        "cross": lambda lib, x: (lib.linalg.cross(x, x.conj()).abs() ** 2).sum(),
        "cond": lambda lib, x: lib.linalg.cond(x),
        "vecdot": lambda lib, x: (lib.linalg.vecdot(x, x * 2).abs() ** 2).sum(),
        "multi_dot": lambda lib, x: (lib.linalg.multi_dot([x, x, x]).abs() ** 2).sum(),
    }
    a = _complex()
    x, tx = core.tensor(a, requires_grad=True), torch.tensor(a, requires_grad=True)
    losses[name](core, x).backward()
    losses[name](torch, tx).backward()
    # complex128, the same formulas: ~1e-13 after an inverse of a matrix with cond ~10
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["eigh", "qr", "svd", "slogdet"])
def test_complex_gradients_of_the_decompositions_match_torch(name: str) -> None:
    """Losses that do not depend on the vectors' phases (which are arbitrary), through every
    output of each decomposition."""
    def spd(lib, x):
        return x @ x.conj().mT + 3 * lib.eye(3)

    weights = np.array([0.3 - 1.2j, 0.7 + 0.4j])
    losses = {
        "eigh": lambda lib, x: ((lib.linalg.eigh(spd(lib, x))[1].abs() ** 4).sum()
                                + (lib.linalg.eigh(spd(lib, x))[0] ** 2).sum()),
        "qr": lambda lib, x: ((lib.linalg.qr(x)[1].abs() ** 2).sum()
                              + (lib.linalg.qr(x)[0].real ** 2).sum()),
        "svd": lambda lib, x: (lib.linalg.svd(x, full_matrices=False)[0].abs() ** 4).sum()
        + lib.linalg.svd(x)[1].sum() + (lib.linalg.svd(x)[2].abs() ** 4).sum(),
        "slogdet": lambda lib, x: lib.linalg.slogdet(lib.stack([x, x.mT]))[1].sum()
        + (lib.linalg.slogdet(lib.stack([x, x.mT]))[0] * lib.tensor(weights)).real.sum(),
    }
    a = _complex()
    x, tx = core.tensor(a, requires_grad=True), torch.tensor(a, requires_grad=True)
    losses[name](core, x).backward()
    losses[name](torch, tx).backward()
    # complex128, torch's formulas on the same LAPACK factors: ~1e-15; cond(A) ~ 10
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("p", [1, -1, float("inf"), "fro", "nuc"])
def test_cond_values_for_the_norms_torch_cannot_differentiate(p) -> None:
    a, ta = _pair(2, 3, 3, seed=11)
    np.testing.assert_allclose(linalg.cond(a, p).numpy(), torch.linalg.cond(ta, p).numpy(),
                               rtol=1e-10)  # float64 norms of A and inv(A), cond ~10


def test_the_ex_forms_report_failures_in_info_as_torch() -> None:
    singular = np.stack([np.eye(3), np.zeros((3, 3))])
    ours, theirs = linalg.inv_ex(core.tensor(singular)), torch.linalg.inv_ex(torch.tensor(singular))
    np.testing.assert_array_equal(ours.info.numpy(), theirs.info.numpy())
    np.testing.assert_allclose(ours.inverse.numpy()[0], np.eye(3))
    with pytest.raises(linalg.LinAlgError):
        linalg.inv_ex(core.tensor(singular), check_errors=True)
    bad = -np.eye(3)
    assert linalg.cholesky_ex(core.tensor(bad)).info.item() == torch.linalg.cholesky_ex(
        torch.tensor(bad)).info.item() == 1
    assert linalg.solve_ex(core.zeros(3, 3), core.ones(3)).info.item() == 1


def test_eig_decomposes_and_refuses_gradients() -> None:
    a, ta = _pair(4, 4, seed=12)
    w, v = linalg.eig(a)
    np.testing.assert_allclose(a.numpy() @ v.numpy(), v.numpy() * w.numpy(), atol=1e-12)
    np.testing.assert_allclose(w.numpy(), torch.linalg.eigvals(ta).numpy(), rtol=1e-12)
    with pytest.raises(NotImplementedError, match="gradients are not supported yet"):
        linalg.eig(a.clone().requires_grad_())


def test_vmap_over_the_extras() -> None:
    a, ta = _pair(5, 3, 3, seed=13)
    b, tb = _pair(5, 3, 2, seed=14)
    np.testing.assert_allclose(
        func.vmap(lambda m, r: linalg.solve_triangular(m, r, upper=True))(a, b).numpy(),
        torch.linalg.solve_triangular(ta.triu(), tb, upper=True).numpy(), rtol=1e-10)
    np.testing.assert_allclose(func.vmap(linalg.matrix_exp)(a).numpy(),
                               torch.linalg.matrix_exp(ta).numpy(), rtol=1e-10)
    np.testing.assert_allclose(func.vmap(lambda m: linalg.diagonal(m, dim1=1, dim2=0))(a).numpy(),
                               torch.linalg.diagonal(ta, dim1=2, dim2=1).numpy())


def test_lu_errors_and_refused_gradients_as_torch() -> None:
    zeros = np.zeros((2, 3, 3))
    for name in ("lu_factor", "lu_factor_ex"):
        kwargs = {"check_errors": True} if name == "lu_factor_ex" else {}
        theirs = _message(getattr(torch.linalg, name), torch.tensor(zeros), **kwargs)
        assert _message(getattr(linalg, name), core.tensor(zeros), **kwargs) == theirs
    info = linalg.lu_factor_ex(core.tensor(zeros)).info
    np.testing.assert_array_equal(info.numpy(), torch.linalg.lu_factor_ex(
        torch.tensor(zeros)).info.numpy())
    with pytest.raises(NotImplementedError, match="gradients are not supported yet"):
        linalg.lu(core.ones(3, 3, requires_grad=True))
    lu_, piv = linalg.lu_factor(core.eye(3, dtype=core.float64) * 2)
    x = linalg.lu_solve(lu_, piv, core.ones(3, 1, dtype=core.float64))
    np.testing.assert_allclose(x.numpy(), np.full((3, 1), 0.5))
