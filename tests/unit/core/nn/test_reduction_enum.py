"""core.nn._reduction answers as torch.nn._reduction does (old models and PyTorch's own test
lists call it), checked against torch's module for every input."""

from __future__ import annotations

import warnings

import pytest
import torch.nn._reduction as theirs

from shoal.core.nn import _reduction as ours


@pytest.mark.parametrize("name", ["none", "mean", "sum", "elementwise_mean", "average"])
def test_get_enum(name) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            expected = theirs.get_enum(name)
        except ValueError as exc:
            with pytest.raises(ValueError, match=str(exc)):
                ours.get_enum(name)
            return
        assert ours.get_enum(name) == expected


@pytest.mark.parametrize("size_average", [None, True, False])
@pytest.mark.parametrize("reduce", [None, True, False])
def test_legacy_pair(size_average, reduce) -> None:
    expected = theirs.legacy_get_string(size_average, reduce, emit_warning=False)
    assert ours.legacy_get_string(size_average, reduce, emit_warning=False) == expected
    assert ours.legacy_get_enum(size_average, reduce, emit_warning=False) == theirs.get_enum(
        expected)
