"""The op table's everyday entries under autocast: each entry's first float32 sample run inside
core.autocast("cpu") and torch.autocast("cpu") (bfloat16) gives torch's dtype and values, so an op
on torch's lower-precision list (addmm, baddbmm, ...) runs in bfloat16 and one on its float32
list (cdist, trace, ...) in float32, and every other op is left as it is."""

from __future__ import annotations

import pytest
import torch

from shoal import core
from tests.unit.core.optable import entries_everyday
from tests.unit.core.optable.table import Lib, assert_like, assert_same, materialise
from tests.unit.core.optable.test_optable import builtin_type

_ENTRIES = [e for e in entries_everyday.ENTRIES if "float32" in e.dtypes]


@pytest.mark.parametrize("entry", _ENTRIES, ids=[e.name for e in _ENTRIES])
def test_an_everyday_op_under_autocast_is_torchs(entry) -> None:
    data = Lib("float32").arrays(entry.samples[0])
    their_args, their_kwargs = materialise(torch, data)
    my_args, my_kwargs = materialise(core, data)
    try:
        with torch.autocast("cpu"):
            theirs = entry.run(torch, their_args, their_kwargs)
    except Exception as exc:  # noqa: BLE001 - core must raise what torch raises
        with pytest.raises(builtin_type(exc)), core.autocast("cpu"):
            entry.run(core, my_args, my_kwargs)
        return
    with core.autocast("cpu"):
        mine = entry.run(core, my_args, my_kwargs)
    # bfloat16 results are compared at bfloat16's tolerance (table.TOLERANCES: one 16-bit step)
    (assert_like if entry.random else assert_same)(mine, theirs, f"{entry.name} under autocast")
