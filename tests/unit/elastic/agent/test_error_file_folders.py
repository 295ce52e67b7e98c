"""The agent creates the folder of every TORCHELASTIC_ERROR_FILE it hands out: torch's `@record`
writes the file but makes no folder, and died with FileNotFoundError under `shoal run`."""

from __future__ import annotations

import logging
import os

from shoal.elastic.agent.round_setup import fresh_error_file
from shoal.elastic.agent.spec import WorkerSpec


def _spec(error_dir) -> WorkerSpec:
    return WorkerSpec(argv=("x",), nproc_per_node=2, run_id="run1", checkpoint_dir="/c",
                      auth_token="t" * 32, local_addr="127.0.0.1", max_restarts=0,
                      error_dir=str(error_dir))


def test_each_rank_gets_its_folder_and_no_stale_file(tmp_path):
    stale = tmp_path / "run1" / "round_3" / "rank_1" / "error.json"
    stale.parent.mkdir(parents=True)
    stale.write_text("{}")  # an earlier job's: never to be taken for this worker's
    for rank in (0, 1):
        path = fresh_error_file(_spec(tmp_path), 3, rank)
        assert path == str(tmp_path / "run1" / "round_3" / f"rank_{rank}" / "error.json")
        assert os.path.isdir(os.path.dirname(path))
        assert not os.path.exists(path)
        with open(path, "w") as f:  # what torch's @record does: open, no makedirs
            f.write("{}")


def test_a_folder_that_cannot_be_made_gives_no_error_file_and_says_why(tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING):
        assert fresh_error_file(_spec(blocker), 0, 1) is None
    assert "Rank 1 gets no TORCHELASTIC_ERROR_FILE in round 0: cannot create" in caplog.text
