"""Blaming a hung rank from a watchdog dump, and the summary that names it."""

import json

from shoal.elastic.agent.env import summary_text
from shoal.elastic.agent.hang_blame import culprits_from_dump, find_hang


def _dump(progress, seq=12, p2p=False, pid=4242, group="default"):
    return {"group": group, "rank": 0, "global_rank": 0, "pid": pid,
            "reason": "Rank 0 timed out after 3s in all_reduce #12 of group 'default': rank 1 "
                      "never arrived.",
            "failed_op": {"seq": seq, "op": "all_reduce", "p2p": p2p},
            "progress_of_ranks": progress}


def test_ranks_that_never_started_are_blamed_before_those_that_never_finished():
    assert culprits_from_dump(_dump({"1": [11, 11], "2": [12, 11], "3": [12, 12]})) == (1,)
    assert culprits_from_dump(_dump({"1": [12, 11], "2": [12, 12]})) == (1,)
    assert culprits_from_dump(_dump({"1": [12, 12]})) == ()
    assert culprits_from_dump(_dump(None)) == ()  # the store did not answer
    assert culprits_from_dump(_dump({"1": [0, 0]}, p2p=True)) == ()
    assert culprits_from_dump(_dump({"1": "garbage"})) == ()


def test_find_hang_reads_the_dump_of_that_pid_only(tmp_path):
    (tmp_path / "shoal-collectives-default-rank0-pid4242-x-1.json").write_text(
        json.dumps(_dump({"1": [11, 11]})))
    (tmp_path / "shoal-collectives-default-rank0-pid999-x-1.json").write_text("{not json")
    hang = find_hang(4242, str(tmp_path))
    assert hang.culprits == (1,) and hang.detector == 0 and hang.culprit_names() == "rank 1"
    assert find_hang(999, str(tmp_path)) is None
    assert find_hang(4242, None) is None


def test_the_summary_names_the_hung_rank_and_who_noticed():
    record = {"round": 2, "rank": 1, "local_rank": 1, "node": "n0", "pid": 77, "exitcode": 75,
              "exit": "exit code 75", "tail": ["boom"], "log_path": None,
              "hang": "Rank 0 timed out after 3s in all_reduce #12: rank 1 never arrived.",
              "detected_by": 0}
    text = summary_text("job", record, 1, 1)
    assert ("The failing worker: rank 1 (local rank 1 on node n0, pid 77) hung in round 2: "
            "Rank 0 timed out after 3s") in text
    assert "Last lines of the log of rank 0, which noticed:" in text


def test_a_dump_without_its_rank_says_so_instead_of_rank_minus_one(tmp_path):
    doc = _dump({"1": [11, 11]})
    del doc["rank"], doc["global_rank"]
    path = tmp_path / "shoal-collectives-default-rank0-pid4242-x-1.json"
    path.write_text(json.dumps(doc))
    hang = find_hang(4242, str(tmp_path))
    assert hang.culprits == (1,) and hang.detector is None
    assert hang.detector_name() == f"a rank whose dump did not say which ({path})"
    doc["global_rank"] = "zero"  # garbage is no rank either, and must not raise
    path.write_text(json.dumps(doc))
    hang = find_hang(4242, str(tmp_path))
    assert hang.detector is None
    assert hang.detector_name().startswith("a rank whose dump did not say which")
    doc["global_rank"] = 3
    path.write_text(json.dumps(doc))
    assert find_hang(4242, str(tmp_path)).detector_name() == "rank 3"
