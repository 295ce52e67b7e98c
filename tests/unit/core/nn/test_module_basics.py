"""Module basics torch users rely on: buffers in state_dict, apply order, train/eval, and a
replaced child keeping its place (convert_sync_batchnorm and Sequential depend on it)."""

import pytest

from shoal import core
from shoal.core import nn

torch = pytest.importorskip("torch")


def _pair():
    class Ours(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("stat", core.zeros(2))
            self.register_buffer("scratch", core.zeros(1), persistent=False)
            self.norm = nn.BatchNorm1d(2)

    class Theirs(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)
            self.register_buffer("stat", torch.zeros(2))
            self.register_buffer("scratch", torch.zeros(1), persistent=False)
            self.norm = torch.nn.BatchNorm1d(2)

    return Ours(), Theirs()


def test_state_dict_and_buffer_names_match_torch():
    ours, theirs = _pair()
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in theirs.named_buffers()]


def test_apply_visits_children_first_like_torch():
    ours, theirs = _pair()
    seen, tseen = [], []
    ours.apply(lambda m: seen.append(type(m).__name__))
    theirs.apply(lambda m: tseen.append(type(m).__name__))
    assert seen == ["Linear", "BatchNorm1d", "Ours"] and tseen == ["Linear", "BatchNorm1d", "Theirs"]


def test_train_and_eval_reach_every_descendant():
    ours, _ = _pair()
    assert ours.eval() is ours and not ours.norm.training and not ours.lin.training
    ours.train()
    assert all(m.training for m in ours.modules())


def test_replacing_a_child_keeps_its_position_like_torch():
    seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    tseq = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
    setattr(seq, "0", nn.Linear(2, 3))
    setattr(tseq, "0", torch.nn.Linear(2, 3))
    seq.add_module("2", nn.Linear(3, 1))
    tseq.add_module("2", torch.nn.Linear(3, 1))
    assert list(seq.state_dict()) == list(tseq.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert [n for n, _ in seq.named_children()] == ["0", "1", "2"]
