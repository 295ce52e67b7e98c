"""torch.autograd.profiler's legacy profile and torch.profiler's smaller names, against torch:
supported_activities, kineto_available, add_metadata(_json), schedule(skip_first_wait=),
table(time_unit=)."""

from __future__ import annotations

import inspect
import json
import re

import pytest
import torch
import torch.autograd.profiler as tap
import torch.profiler as tp

from shoal import core
from shoal.core import autograd_profiler as AP
from shoal.core import profiler as P


def _work() -> None:
    x = core.ones(2, 2, requires_grad=True)
    ((x + x) * 3).sum().backward()


def test_legacy_profile_has_torchs_signature_and_events_after_exit(tmp_path) -> None:
    theirs = inspect.signature(tap.profile.__init__).parameters
    ours = inspect.signature(AP.profile.__init__).parameters
    common = [n for n in theirs if n in ours]
    assert common == [n for n in theirs if n not in ("post_processing_timeout_s",
                                                     "activity_filters")]
    assert all(ours[n].default == theirs[n].default for n in common)
    with AP.profile(use_kineto=True, record_shapes=True) as prof:
        assert len(prof.function_events) == 0  # as torch's: filled on exit
        _work()
    names = [fe.name for fe in prof.function_events]
    assert names.count("add") == 1 and names.count("mul") == 1 and names.count("sum") == 1
    assert not any(n.startswith("ProfilerStep") for n in names)  # torch's marks none either
    add = next(fe for fe in prof.function_events if fe.name == "add")
    assert add.input_shapes == [[2, 2], [2, 2]] and add.count == 1
    assert add.self_cpu_time_total <= add.cpu_time_total
    avg = {a.key: a for a in prof.key_averages()}
    assert avg["add"].count == 1
    total = prof.total_average()
    assert total.key == "Total" and total.count == len(prof.function_events)
    assert prof.self_cpu_time_total == pytest.approx(total.self_cpu_time_total)
    assert "Self CPU time total" in prof.table(sort_by="self_cpu_time_total", row_limit=5)
    path = tmp_path / "legacy.json"
    prof.export_chrome_trace(str(path))
    assert any(e.get("name") == "add" for e in json.loads(path.read_text())["traceEvents"])


def test_legacy_profile_disabled_records_nothing_and_binds_none_as_torchs() -> None:
    ours = AP.profile(enabled=False)
    with ours as bound:
        _work()
    assert bound is None and len(ours.function_events) == 0
    with tap.profile(enabled=False) as theirs:
        torch.ones(1)
    assert theirs is None


def test_supported_activities_and_kineto_available_answer_as_torchs_do() -> None:
    acts = P.supported_activities()
    assert isinstance(acts, set) and isinstance(tp.supported_activities(), set)
    assert P.ProfilerActivity.CPU in acts and tp.ProfilerActivity.CPU in tp.supported_activities()
    assert isinstance(tp.kineto_available(), bool)
    assert P.kineto_available() is False  # shoal's own recorder, not Kineto
    assert AP.kineto_available is P.kineto_available


def test_add_metadata_lands_at_the_trace_files_top_level_as_torchs(tmp_path) -> None:
    docs = []
    for mod, ones in ((tp, torch.ones), (P, core.ones)):
        with mod.profile() as prof:
            prof.add_metadata("run", "my run")
            prof.add_metadata_json("cfg", '{"lr": 0.1, "layers": [1, 2]}')
            ones(1)
        path = tmp_path / f"{mod.__name__}.json"
        prof.export_chrome_trace(str(path))
        docs.append(json.loads(path.read_text()))
    for doc in docs:
        assert doc["run"] == "my run"
        assert doc["cfg"] == {"lr": 0.1, "layers": [1, 2]}


@pytest.mark.parametrize("skip_first,wait,warmup,active,repeat", [
    (2, 3, 1, 2, 0), (0, 2, 0, 1, 2), (5, 1, 1, 1, 3), (1, 0, 1, 2, 1)])
@pytest.mark.filterwarnings("ignore:Profiler won't be using warmup")
def test_schedule_skip_first_wait_matches_torch(skip_first, wait, warmup, active, repeat):
    kw = dict(skip_first=skip_first, wait=wait, warmup=warmup, active=active, repeat=repeat,
              skip_first_wait=1)
    ours, theirs = P.schedule(**kw), tp.schedule(**kw)
    assert [ours(s).name for s in range(30)] == [theirs(s).name for s in range(30)]
    with pytest.raises(P.ProfilerError, match=r"skip_first_wait=-1 is not allowed"):
        P.schedule(wait=1, warmup=0, active=1, skip_first_wait=-1)


@pytest.mark.parametrize("unit", ["s", "ms", "us"])
def test_table_time_unit_writes_every_time_in_that_unit_as_torchs(unit) -> None:
    with tp.profile() as theirs:
        torch.ones(2) + 1
    with P.profile() as ours:
        core.ones(2) + 1
    pattern = re.compile(r"\d+\.\d{3}(s|ms|us)\b")
    for table in (theirs.key_averages().table(time_unit=unit),
                  ours.key_averages().table(time_unit=unit)):
        units = {m.group(1) for m in pattern.finditer(table)}
        assert units == {unit}, table
    table = ours.key_averages().table(time_unit="ns", header="my header")
    assert table.splitlines()[1] == "my header"
    assert re.search(r"Self CPU time total: \d+\.\d{3}(s|ms|us)\n", table)


def test_table_has_torchs_keyword_arguments() -> None:
    # key_averages() of torch's is an EventList: its table is EventList.table
    theirs = dict(inspect.signature(tap.EventList.table).parameters)
    del theirs["self"]
    with P.profile() as prof:
        core.ones(1)
    ours = inspect.signature(prof.key_averages().table).parameters
    assert list(ours) == list(theirs)
    assert all(ours[n].default == theirs[n].default for n in theirs)


def test_legacy_profiler_is_reachable_as_core_autograd_profiler() -> None:
    import importlib

    assert core.autograd.profiler is AP
    assert importlib.import_module("shoal.core.autograd.profiler") is AP
