"""PyTorch's nn test cases (common_nn.py from the torch wheel) on shoal against torch: see
tests/torch_ports/nn_cases.py for how each case is built and compared. Every case either passes
or is an expected failure named with its reason in nn_expected.py; an expected failure that
starts passing fails here, so the table stays true."""

from __future__ import annotations

import warnings

import pytest

from tests.torch_ports import nn_cases, nn_expected

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torch's deprecation warnings while the lists are built
    _CASES = nn_cases.cases()


@pytest.mark.parametrize("case", _CASES, ids=[c.name for c in _CASES])
@pytest.mark.filterwarnings("ignore")
def test_torchs_nn_case(case) -> None:
    reason = nn_expected.EXPECTED_FAILURES.get(case.name)
    if reason is None:
        nn_cases.run_case(case)
        return
    with pytest.raises(Exception):  # any failure is the expected one
        nn_cases.run_case(case)
    pytest.xfail(reason)


def test_the_pass_count_is_tracked() -> None:
    assert len(_CASES) == nn_expected.CASES
    assert len(_CASES) - len(nn_expected.EXPECTED_FAILURES) == nn_expected.PASSING
    assert set(nn_expected.EXPECTED_FAILURES) <= {c.name for c in _CASES}
