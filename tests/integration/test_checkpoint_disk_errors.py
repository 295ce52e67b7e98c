"""Saving checkpoints onto a disk that refuses them: full (a small tmpfs), read-only (a tmpfs
remounted read-only), or a directory deleted under the job. Each save runs in a private mount
namespace (`unshare -m`; we are root, and root ignores file modes, so chmod cannot make a
read-only directory), and must fail with CheckpointDiskError saying what is left on disk, with
the worker's error file marked not retryable so the agent does not restart into it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from shoal.elastic.checkpoint import Checkpointer

TOKEN = "disk-errors-secret"
TIMEOUT_S = 60


def _in_private_mount(tmp_path, setup: str, script: str) -> subprocess.CompletedProcess:
    """Run `setup` (shell, $M is a fresh tmpfs mount point) then python `script`, inside a
    private mount namespace; the mounts vanish with it."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    mount = tmp_path / "m"
    mount.mkdir()
    (tmp_path / "job.py").write_text(textwrap.dedent(script))
    command = (f"set -e; M={mount}; {setup}; "
               f"exec {sys.executable} {tmp_path / 'job.py'} {mount}")
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "TORCHELASTIC_ERROR_FILE":
           str(tmp_path / "error.json"), "PYTHONPATH": ":".join(sys.path)}
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", command],
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


_SAVE_TWO = f"""
    import sys
    import numpy as np
    from shoal.elastic.checkpoint import Checkpointer, CheckpointDiskError
    ck = Checkpointer(sys.argv[1] + "/ck", token={TOKEN!r})
    ck.save(1, {{"w": np.zeros(16)}})
    open(sys.argv[1] + "/saved-1", "w").close()
    STEP_TWO
    try:
        ck.save(2, {{"w": np.zeros(1 << 18)}})
    except CheckpointDiskError as exc:
        print("DISK ERROR:", exc)
        raise SystemExit(3)
    print("saved 2")
"""


def _error_file(tmp_path) -> dict:
    return json.loads((tmp_path / "error.json").read_text())


def _assert_not_retryable(tmp_path, done, errno_text: str, left: str) -> None:
    assert done.returncode == 3, done.stdout + done.stderr
    assert errno_text in done.stdout and left in done.stdout, done.stdout
    assert "not restarted" in done.stdout and "intact" not in done.stdout
    doc = _error_file(tmp_path)
    assert doc["message"]["message"].startswith("CheckpointDiskError: ")
    assert doc["shoal"] == {"retryable": False}


def test_a_full_disk_fails_the_save_as_not_retryable_and_names_what_is_left(tmp_path):
    done = _in_private_mount(tmp_path, "mount -t tmpfs -o size=1m tmpfs $M",
                             _SAVE_TWO.replace("STEP_TWO", "pass"))
    _assert_not_retryable(tmp_path, done, "No space left on device", "step(s) 1;")
    # Only the save that failed is gone: no temporary file is left to fill the disk further.
    assert "'.ckpt-" not in done.stdout


def test_a_read_only_directory_fails_the_save_as_not_retryable(tmp_path):
    done = _in_private_mount(
        tmp_path, "mount -t tmpfs -o size=8m tmpfs $M",
        _SAVE_TWO.replace("STEP_TWO", "import subprocess; subprocess.run(['mount', '-o', "
                          "'remount,ro', sys.argv[1]], check=True)"))
    _assert_not_retryable(tmp_path, done, "Read-only file system", "step(s) 1;")


def test_a_deleted_directory_that_cannot_be_made_again_says_it_is_gone(tmp_path):
    done = _in_private_mount(
        tmp_path, "mount -t tmpfs -o size=8m tmpfs $M",
        _SAVE_TWO.replace("STEP_TWO", "import shutil, subprocess; shutil.rmtree(sys.argv[1] + "
                          "'/ck'); subprocess.run(['mount', '-o', 'remount,ro', sys.argv[1]], "
                          "check=True)"))
    _assert_not_retryable(tmp_path, done, "Read-only file system", "is gone")


def test_a_deleted_directory_is_made_again_and_the_save_holds_the_state(tmp_path, caplog):
    ck = Checkpointer(tmp_path / "ck", token=TOKEN)
    ck.save(1, {"w": np.zeros(4)})
    shutil.rmtree(tmp_path / "ck")
    with caplog.at_level("WARNING", logger="shoal.elastic.checkpoint"):
        ck.save(2, {"w": np.ones(4)})
    assert "is gone (deleted while the job ran): the checkpoints it held are lost" in caplog.text
    step, state = ck.load_latest()
    assert step == 2 and state["w"][0] == 1.0


_FILLING_WORKER = f"""
    import os
    import numpy as np
    from shoal.elastic.checkpoint import Checkpointer
    directory = os.environ["SHOAL_CHECKPOINT_DIR"]
    ck = Checkpointer(directory, token={TOKEN!r})
    print("restart", os.environ["SHOAL_RESTART_COUNT"], "found", ck.latest_step(), flush=True)
    ck.save(1, {{"w": np.zeros(16)}})
    with open(os.path.join(directory, "..", "filler"), "wb") as f:
        try:
            f.write(bytes(8 << 20))
        except OSError:
            pass
    ck.save(2, {{"w": np.zeros(1 << 16)}})
"""


def test_shoal_run_does_not_restart_into_a_full_checkpoint_disk(tmp_path):
    """A worker dies of a save the full disk refused: with restarts to spare, the job still
    ends after that one round, and the summary names the disk error and what is left."""
    (tmp_path / "worker.py").write_text(textwrap.dedent(_FILLING_WORKER))
    done = _in_private_mount(
        tmp_path, "mount -t tmpfs -o size=1m tmpfs $M",
        f"""
        import subprocess, sys
        sys.exit(subprocess.run([sys.executable, "-m", "shoal.launcher", "run",
                                 "--standalone", "--nproc-per-node", "1", "--max-restarts", "3",
                                 "--checkpoint-dir", sys.argv[1] + "/ck",
                                 {str(tmp_path / "worker.py")!r}], timeout=50,
                                env={{**__import__("os").environ,
                                      "SHOAL_AUTH_TOKEN": {TOKEN!r}}}).returncode)
        """)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out[-4000:]
    assert out.count("Started ranks") == 1, out[-4000:]
    assert "failed after 0 restart(s)" in out and "Its error: CheckpointDiskError:" in out, out
    assert "No space left on device" in out and "step(s) 1;" in out
