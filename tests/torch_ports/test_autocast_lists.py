"""PyTorch's own CPU autocast test lists run against shoal: torch's
torch/testing/_internal/autocast_test_lists.py, loaded from the torch wheel through the
import-renaming shim (torch -> shoal.core), builds its ops and arguments with shoal's tensors,
and its own checker (`TestAutocast._run_autocast_outofplace`) runs each op inside
core.autocast and compares it bitwise with the op run outside autocast on inputs cast by hand,
as torch's test/test_autocast.py does for the CPU.

One adaptation: torch runs the nn lists through its private binding module `torch._C._nn`;
shoal has no such module, so they run through `core.nn.functional`, the public home of the same
functions. Each expected failure is named with its reason in EXPECTED_FAILURES; the pass count
is asserted exactly, so a fix or a regression both show here.
"""

from __future__ import annotations

import pytest

from shoal import core
from tests.torch_ports.ported import autocast_test_lists as _lists

_PRIVATE = "a private aten binding (torch.{0}) that torch.nn.functional does not expose"
_MISSING = "shoal lacks {0} (listed by tests/unit/core/test_torch_gap.py)"
EXPECTED_FAILURES = {
    "nn_fp32/avg_pool3d": _MISSING.format("avg_pool3d"),
    "torch_16/conv_tbc": _PRIVATE.format("conv_tbc"),
    "torch_16/_addmm_activation": _PRIVATE.format("_addmm_activation"),
    "torch_16/_native_multi_head_attention": _PRIVATE.format("_native_multi_head_attention"),
    "nn_fp32/reflection_pad1d": _PRIVATE.format("_C._nn.reflection_pad1d"),
    "nn_fp32/nll_loss2d": _PRIVATE.format("_C._nn.nll_loss2d"),
}
_AMP = {"bf16": core.bfloat16, "fp16": core.float16}


def _cases() -> list[tuple]:
    """(id, list name, op, args, kwargs, run_as, out_type, module) per entry and amp dtype."""
    lists = _lists.AutocastCPUTestLists("cpu")
    torch_module, nn_module = _lists.torch, core.nn.functional
    cases = []
    for amp_name, amp in _AMP.items():
        def add(list_name, op, args, kw, run_as, out_type=None, module=torch_module):
            cases.append((f"{list_name}/{op}/{amp_name}", f"{list_name}/{op}", op, args, kw,
                          run_as, out_type, module, amp))

        for list_name, module in (("torch_expect_builtin_promote", torch_module),
                                  ("methods_expect_builtin_promote", None)):
            for op, bf16_args, fp16_args, out_type in getattr(lists, list_name):
                add(list_name, op, bf16_args if amp_name == "bf16" else fp16_args, {},
                    core.float32, out_type, module)
        for list_name, run_as, module in (("torch_16", amp, torch_module),
                                          ("nn_16", amp, nn_module),
                                          ("torch_fp32", core.float32, torch_module),
                                          ("nn_fp32", core.float32, nn_module)):
            for entry in getattr(lists, list_name):
                op, args, kw = (tuple(entry) + ({},))[:3]
                add(list_name, op, args, kw, run_as, module=module)
        for op, bf16_args, fp16_args in lists.torch_need_autocast_promote:
            add("torch_need_autocast_promote", op,
                bf16_args if amp_name == "bf16" else fp16_args, {}, core.float32)
    return cases


_CASES = _cases()


@pytest.mark.parametrize("case", _CASES, ids=[c[0] for c in _CASES])
def test_torchs_cpu_autocast_list_entry(case) -> None:
    _, key, op, args, kwargs, run_as, out_type, module, amp = case
    checker = _lists.TestAutocast()
    run = lambda: checker._run_autocast_outofplace(  # noqa: E731 - one call, two uses below
        op, args, run_as, "cpu", out_type=out_type, module=module, add_kwargs=kwargs,
        amp_dtype=amp)
    if key in EXPECTED_FAILURES:
        with pytest.raises((AssertionError, NotImplementedError)):
            run()
        pytest.xfail(EXPECTED_FAILURES[key])
    run()


def test_the_pass_count_is_tracked() -> None:
    # 110 checks (55 entries x bfloat16 and float16); 12 are expected failures, 98 pass
    assert len(_CASES) == 110
    expected = sum(1 for c in _CASES if c[1] in EXPECTED_FAILURES)
    assert (len(_CASES) - expected, expected) == (98, 12)
