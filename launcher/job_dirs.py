"""The directories a `shoal run` job writes: checkpoints, the workers' metrics files, logs,
error files and watchdog dumps; and which of them go when the job ends."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile
from typing import Optional

from shoal.launcher import flags

logger = logging.getLogger("shoal.run")


@dataclasses.dataclass
class JobDirs:
    """Where the job writes, and what is removed when it ends: `temporary` always,
    `kept_on_failure` unless the job failed (a failed job's error files are evidence)."""

    checkpoint_dir: str
    multiproc_dir: str
    log_dir: Optional[str]
    error_dir: str
    dump_dir: str
    temporary: list[str] = dataclasses.field(default_factory=list)
    kept_on_failure: list[str] = dataclasses.field(default_factory=list)

    def remove(self, keep_errors: bool) -> None:
        """Remove the job's temporary directories, and its error files unless `keep_errors`."""
        for path in self.temporary + ([] if keep_errors else self.kept_on_failure):
            shutil.rmtree(path, ignore_errors=True)


def scratch_dir() -> Optional[str]:
    """The temporary directory the agent may write (tempfile's choice: TMPDIR, /tmp, ...), or
    None when there is none, as on a read-only root filesystem without an emptyDir at /tmp."""
    try:
        return tempfile.gettempdir()
    except FileNotFoundError:
        return None


def no_scratch_message() -> str:
    """Why `shoal run` cannot start without a writable temporary directory, and the fix."""
    tried = tempfile._candidate_tempdir_list()  # noqa: SLF001  (no public list of what it tried)
    candidates = ", ".join(tried)
    return ("no writable temporary directory (tried " + candidates + "). The root filesystem "
            "is probably read-only: mount a writable volume (a Kubernetes emptyDir) at /tmp, "
            "or point TMPDIR at a writable directory.")


def make_job_dirs(settings: flags.RunSettings, *, metrics_parent: Optional[str],
                  dump_dir: str) -> JobDirs:
    """Create the job's directories (temporary ones where no flag names one).

    Raises:
        OSError: a directory cannot be created; those made so far are removed.
    """
    prefix = f"shoal-{settings.rdzv_id}-"
    made: list[str] = []
    try:
        if settings.checkpoint_dir is not None:
            checkpoint_dir = os.path.abspath(settings.checkpoint_dir)
            os.makedirs(checkpoint_dir, exist_ok=True)
        else:
            checkpoint_dir = tempfile.mkdtemp(prefix=prefix + "checkpoints-")
            made.append(checkpoint_dir)
        if metrics_parent:
            os.makedirs(metrics_parent, exist_ok=True)
        multiproc_dir = tempfile.mkdtemp(prefix=prefix + "metrics-", dir=metrics_parent or None)
        made.append(multiproc_dir)
        log_dir = os.path.abspath(settings.log_dir) if settings.log_dir else None
        if log_dir is None and (settings.redirects or settings.tee):
            # As torchrun: redirected or teed streams need files; make a directory for them.
            log_dir = tempfile.mkdtemp(prefix=prefix + "logs-")
            logger.info("Worker logs go to %s (no --log-dir was given)", log_dir)
        error_dir = log_dir or tempfile.mkdtemp(prefix=prefix + "errors-")
        kept = [error_dir] if error_dir != log_dir else []
        made += kept
        # The agent writes <dir>/<run id>/round_N/...: a file of that name is refused here,
        # in a sentence, not mid-round with a traceback.
        os.makedirs(os.path.join(error_dir, settings.rdzv_id), exist_ok=True)
        os.makedirs(dump_dir, exist_ok=True)
    except OSError:
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
        raise
    return JobDirs(checkpoint_dir, multiproc_dir, log_dir, error_dir, dump_dir,
                   temporary=[p for p in made if p not in kept], kept_on_failure=kept)
