"""core.nn: registration, traversal, state_dict, hooks, modes, layers (against torch.nn)."""

from __future__ import annotations

import copy
import math
import pickle

import numpy as np
import pytest

from shoal import core
from shoal.core import nn
from shoal.core.nn import StateDictError

torch = pytest.importorskip("torch")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.scale = nn.Parameter(core.ones(3))
        self.register_buffer("running", core.zeros(3))
        self.register_buffer("cache", core.zeros(2), persistent=False)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(self.fc(x)) * self.scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = Block()
        self.layers = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 2)])
        self.norm = nn.LayerNorm(2)

    def forward(self, x):
        x = self.first(x)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def test_registration_order_names_and_traversal():
    net = Net()
    assert [n for n, _ in net.named_parameters()] == [
        "first.scale", "first.fc.weight", "first.fc.bias", "layers.0.weight", "layers.0.bias",
        "layers.1.weight", "layers.1.bias", "norm.weight", "norm.bias",
    ]
    assert all(isinstance(p, nn.Parameter) and p.requires_grad and p.is_leaf
               for p in net.parameters())
    assert [n for n, _ in net.named_buffers()] == ["first.running", "first.cache"]
    assert [n for n, _ in net.named_children()] == ["first", "layers", "norm"]
    assert [n for n, _ in net.named_modules()] == [
        "", "first", "first.fc", "first.act", "layers", "layers.0", "layers.1", "norm"]
    assert list(net.state_dict()) == [
        "first.scale", "first.running", "first.fc.weight", "first.fc.bias", "layers.0.weight",
        "layers.0.bias", "layers.1.weight", "layers.1.bias", "norm.weight", "norm.bias"]
    assert net.get_submodule("layers.1") is net.layers[1]
    assert [n for n, _ in net.first.named_parameters(recurse=False)] == ["scale"]


def test_shared_parameters_appear_once_and_reassignment_replaces():
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    net[1].weight = net[0].weight
    assert len(list(net.parameters())) == 3
    block = Block()
    block.scale = None
    assert "scale" not in dict(block.named_parameters())
    with pytest.raises(TypeError, match="cannot assign int as parameter 'scale'"):
        block.scale = 3
    with pytest.raises(TypeError, match="cannot assign str as child module 'fc'"):
        block.fc = "x"
    with pytest.raises(AttributeError, match="'Block' object has no attribute 'nothing'"):
        block.nothing  # noqa: B018


def test_state_dict_keys_match_torch_for_the_same_architecture():
    ours = nn.Sequential(nn.Embedding(10, 4), nn.LayerNorm(4), nn.Linear(4, 3), nn.GELU(),
                         nn.Dropout(0.1), nn.Linear(3, 2, bias=False))
    theirs = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.LayerNorm(4),
                                 torch.nn.Linear(4, 3), torch.nn.GELU(), torch.nn.Dropout(0.1),
                                 torch.nn.Linear(3, 2, bias=False))
    assert list(ours.state_dict()) == list(theirs.state_dict())
    for (k, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert a.shape == tuple(b.shape), k


def test_loading_torch_weights_gives_torch_outputs():
    theirs = torch.nn.Sequential(torch.nn.Embedding(10, 6, padding_idx=0), torch.nn.LayerNorm(6),
                                 torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 3),
                                 torch.nn.ReLU()).double()
    ours = nn.Sequential(nn.Embedding(10, 6, padding_idx=0), nn.LayerNorm(6), nn.Linear(6, 5),
                         nn.GELU(), nn.Linear(5, 3), nn.ReLU()).double()
    result = ours.load_state_dict({k: v.detach().numpy() for k, v in theirs.state_dict().items()})
    assert result.missing_keys == [] and result.unexpected_keys == []
    idx = np.array([[1, 2, 0], [9, 3, 3]])
    expected = theirs(torch.tensor(idx)).detach().numpy()
    np.testing.assert_allclose(ours(core.tensor(idx)).array, expected, rtol=1e-12, atol=1e-14)


def test_load_state_dict_errors_name_every_problem_and_change_nothing():
    net = Net()
    good = net.state_dict()
    before = {k: v.array.copy() for k, v in good.items()}
    bad = {k: core.tensor(np.full(v.shape, 7.0, dtype=np.float32)) for k, v in good.items()}
    del bad["layers.0.bias"]
    bad["layers.9.weight"] = core.zeros(1)
    bad["norm.weight"] = core.zeros(5)
    with pytest.raises(StateDictError) as info:
        net.load_state_dict(bad)
    message = str(info.value)
    assert "Error(s) in loading state_dict for Net" in message
    assert 'Missing key(s) in state_dict: "layers.0.bias".' in message
    assert 'Unexpected key(s) in state_dict: "layers.9.weight".' in message
    assert ("size mismatch for norm.weight: copying a param with shape (5,) from checkpoint, "
            "the shape in current model is (2,).") in message
    for k, v in net.state_dict().items():
        np.testing.assert_array_equal(v.array, before[k])  # nothing half-loaded

    del bad["norm.weight"]
    result = net.load_state_dict(bad, strict=False)
    assert result.missing_keys == ["layers.0.bias", "norm.weight"]
    assert result.unexpected_keys == ["layers.9.weight"]
    assert (net.first.fc.weight.array == 7).all() and (net.layers[0].bias.array == before["layers.0.bias"]).all()
    with pytest.raises(StateDictError, match="size mismatch for norm.weight"):
        net.load_state_dict({"norm.weight": core.zeros(5)}, strict=False)


def test_load_state_dict_copies_in_place_and_casts():
    lin = nn.Linear(2, 2)
    weight_obj, weight_data = lin.weight, lin.weight.array
    lin.load_state_dict({"weight": np.eye(2), "bias": [1, 2]})
    assert lin.weight is weight_obj and lin.weight.array is weight_data
    assert lin.weight.array.dtype == np.float32
    np.testing.assert_array_equal(lin.bias.array, [1.0, 2.0])


def test_state_dict_values_share_memory_but_are_detached():
    lin = nn.Linear(2, 2)
    sd = lin.state_dict()
    assert not sd["weight"].requires_grad and not isinstance(sd["weight"], nn.Parameter)
    assert np.shares_memory(sd["weight"].array, lin.weight.array)
    assert lin.state_dict(keep_vars=True)["weight"] is lin.weight


def test_forward_hooks_modify_and_remove():
    lin = nn.Linear(3, 3)
    calls = []
    pre = lin.register_forward_pre_hook(lambda m, args: (args[0] * 0,))
    post = lin.register_forward_hook(lambda m, args, out: calls.append(out.shape) or out + 1)
    x = core.randn(2, 3)
    out = lin(x)
    np.testing.assert_allclose(out.array, np.broadcast_to(lin.bias.array + 1, (2, 3)), rtol=1e-6)
    assert calls == [(2, 3)]
    pre.remove()
    post.remove()
    post.remove()
    np.testing.assert_allclose(lin(x).array, (x @ lin.weight.T + lin.bias).array, rtol=1e-6)
    assert calls == [(2, 3)]


def test_train_eval_dropout_and_zero_grad():
    net = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))
    assert net.training and net[1].training
    net.eval()
    assert not net.training and not net[1].training
    x = core.randn(3, 4)
    np.testing.assert_array_equal(net(x).array, net[0](x).array)
    net.train()
    core.manual_seed(0)
    dropped = net(core.ones(200, 4)).array
    assert (dropped == 0).mean() > 0.3
    net(x).sum().backward()
    assert net[0].weight.grad is not None
    net.zero_grad(set_to_none=False)
    assert not net[0].weight.grad.array.any()
    net.zero_grad()
    assert net[0].weight.grad is None


def test_to_dtype_keeps_parameter_objects_and_apply_visits_children_first():
    net = Net()
    params = list(net.parameters())
    net.double()
    assert [p is q for p, q in zip(params, net.parameters())] == [True] * len(params)
    assert all(p.array.dtype == np.float64 for p in net.parameters())
    assert net.first.running.array.dtype == np.float64
    with pytest.raises(TypeError, match="only accepts floating point dtypes"):
        net.to(core.int64)
    order = []
    net.apply(lambda m: order.append(type(m).__name__))
    assert order[-1] == "Net" and order.index("Linear") < order.index("Block")


def test_linear_default_init_follows_torch_bounds():
    core.manual_seed(0)
    lin = nn.Linear(400, 300)
    bound = 1 / math.sqrt(400)
    w, b = lin.weight.array, lin.bias.array
    assert w.shape == (300, 400) and w.dtype == np.float32 and b.shape == (300,)
    assert np.abs(w).max() <= bound and np.abs(b).max() <= bound
    # Uniform on [-bound, bound]: variance bound^2 / 3.
    assert w.var() == pytest.approx(bound**2 / 3, rel=0.02)
    assert np.abs(w).max() > 0.99 * bound
    core.manual_seed(0)
    np.testing.assert_array_equal(nn.Linear(400, 300).weight.array, w)  # seeded init repeats


def test_layers_forward_and_backward_match_torch():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 6))
    ours = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.GELU("tanh"), nn.Linear(8, 4),
                         nn.Tanh(), nn.Linear(4, 4), nn.Sigmoid(), nn.Identity()).double()
    theirs = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8),
                                 torch.nn.GELU("tanh"), torch.nn.Linear(8, 4), torch.nn.Tanh(),
                                 torch.nn.Linear(4, 4), torch.nn.Sigmoid(),
                                 torch.nn.Identity()).double()
    ours.load_state_dict({k: v.detach().numpy() for k, v in theirs.state_dict().items()})
    tx = torch.tensor(x, requires_grad=True)
    theirs(tx).pow(2).sum().backward()
    cx = core.tensor(x, requires_grad=True)
    (ours(cx) ** 2).sum().backward()
    np.testing.assert_allclose(cx.grad.array, tx.grad.numpy(), rtol=1e-10, atol=1e-12)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
        np.testing.assert_allclose(p.grad.array, q.grad.numpy(), rtol=1e-10, atol=1e-12,
                                   err_msg=name)


def test_embedding_padding_row_is_zero_and_gets_no_gradient():
    emb = nn.Embedding(5, 3, padding_idx=-1)
    assert emb.padding_idx == 4 and not emb.weight.array[4].any()
    emb(core.tensor(np.array([4, 1, 4]))).sum().backward()
    assert not emb.weight.grad.array[4].any() and (emb.weight.grad.array[1] == 1).all()
    with pytest.raises(ValueError, match="padding_idx=7 must lie within the table of 5 rows"):
        nn.Embedding(5, 3, padding_idx=7)


def test_sequential_and_module_list_indexing():
    seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert len(seq) == 3 and isinstance(seq[-1], nn.Linear) and seq[-1] is seq[2]
    head = seq[:2]
    assert isinstance(head, nn.Sequential) and len(head) == 2 and head[0] is seq[0]
    assert [type(m).__name__ for m in seq] == ["Linear", "ReLU", "Linear"]
    with pytest.raises(IndexError, match="index 3 is out of range for a Sequential of length 3"):
        seq[3]
    seq.append(nn.Sigmoid())
    assert list(dict(seq.named_children())) == ["0", "1", "2", "3"]
    ml = nn.ModuleList([nn.ReLU()])
    ml += [nn.Linear(1, 1)]
    ml.insert(0, nn.Tanh())
    assert [type(m).__name__ for m in ml] == ["Tanh", "ReLU", "Linear"]
    assert [n for n, _ in ml.named_parameters()] == ["2.weight", "2.bias"]
    assert "(0): Linear(in_features=2, out_features=3, bias=True)" in repr(seq)


def test_modules_deepcopy_and_pickle():
    net = Net()
    clone = copy.deepcopy(net)
    for (n, a), b in zip(net.named_parameters(), clone.parameters()):
        assert a is not b and np.array_equal(a.array, b.array) and isinstance(b, nn.Parameter), n
    restored = pickle.loads(pickle.dumps(net))
    x = core.randn(2, 4)
    np.testing.assert_array_equal(restored(x).array, net(x).array)
    assert isinstance(restored.first.fc.weight, nn.Parameter)
    assert restored.first.fc.weight.requires_grad
