"""A worker that dies of a checkpoint save the disk refused is reported as not retryable: the
Checkpointer writes its error file marked so, and the agent's failure record carries it
(elastic.agent.failures.not_retryable); a worker killed by a signal, or one that died of
something else, stays retryable."""

from __future__ import annotations

import errno

import pytest

from shoal.elastic.agent import failures
from shoal.elastic.agent.workers import WorkerExit
from shoal.elastic.checkpoint_files import CheckpointDiskError, report_not_retryable
from shoal.elastic.errors import ERROR_FILE_ENV, error_document, record, write_error_file


def _exit(code: int) -> WorkerExit:
    return WorkerExit(rank=0, local_rank=0, pid=4242, exitcode=code, time=0.0, tail=(),
                      log_path=None)


def _report_disk_error(path, monkeypatch) -> None:
    monkeypatch.setenv(ERROR_FILE_ENV, str(path))
    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError as exc:
        report_not_retryable(CheckpointDiskError(f"Saving failed: {exc}. Still in 'ck': ..."))


def test_a_disk_error_the_checkpointer_reported_is_not_retryable(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    _report_disk_error(path, monkeypatch)
    fields = failures.error_file_fields(str(path), _exit(1))
    assert fields["error"].startswith("CheckpointDiskError: Saving failed: [Errno 28]")
    assert failures.not_retryable(fields)


def test_record_rewriting_the_error_file_keeps_it_not_retryable(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(path))

    @record
    def main():
        raise CheckpointDiskError("Saving failed: disk full.")

    with pytest.raises(CheckpointDiskError):
        main()
    assert failures.not_retryable(failures.error_file_fields(str(path), _exit(1)))


@pytest.mark.parametrize("code", [-9, 0])
def test_a_worker_killed_by_a_signal_after_the_report_stays_retryable(tmp_path, monkeypatch,
                                                                      code):
    path = tmp_path / "error.json"
    _report_disk_error(path, monkeypatch)
    assert not failures.not_retryable(failures.error_file_fields(str(path), _exit(code)))


def test_other_errors_stay_retryable(tmp_path):
    path = tmp_path / "error.json"
    write_error_file(str(path), error_document("RuntimeError: CUDA error", "tb"))
    fields = failures.error_file_fields(str(path), _exit(1))
    assert fields["error"] == "RuntimeError: CUDA error"
    assert not failures.not_retryable(fields)
    assert not failures.not_retryable(failures.failure_record(1, "n0", _exit(1)))
