"""A real `shoal run` of examples/train_ddp.py resuming from a checkpoint directory that someone
seeded with a crafted newest checkpoint (a gadget under a valid MAC) and a checkpoint of another
job: the gadget never runs, both files are named in the log, and the job resumes from the last
good checkpoint and finishes."""

import hashlib
import hmac
import json
import os
import pickle
import re
import struct
import subprocess
import sys

from tests.support.shoal_run import ROOT, TRAIN_DDP, ShoalRun

from shoal.elastic.checkpoint import Checkpointer
from shoal.elastic.checkpoint_format import END, MAGIC, derive_key

TOKEN = "crafted-checkpoint-job-secret"
STEPS = 20
TIMEOUT_S = 60


def _str(text: str) -> bytes:
    raw = text.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw


def _file_handler_gadget(path: str, marker: str) -> None:
    """A format-2 file, MAC'd with the job's key, whose pickle calls
    core.auth.logging.FileHandler(marker): the route format 1's loader let through."""
    skeleton = (pickle.PROTO + b"\x05" + pickle.EMPTY_DICT + _str("model") + _str("shoal.core.auth")
                + _str("logging.FileHandler") + pickle.STACK_GLOBAL
                + pickle.dumps((marker,), protocol=2)[2:-1] + pickle.REDUCE + pickle.SETITEM
                + pickle.STOP)
    header = json.dumps({"format": 2, "step": 10, "payload_bytes": len(skeleton),
                         "skeleton": {"offset": 0, "nbytes": len(skeleton)}, "arrays": []})
    body = MAGIC + struct.pack("<Q", len(header)) + header.encode() + skeleton
    mac = hmac.new(derive_key(TOKEN.encode()), body, hashlib.sha256).digest()
    with open(path, "wb") as f:
        f.write(body + mac + END)


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (
        "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SHOAL_CHECKPOINT_DIR",
        "SHOAL_RESTART_COUNT")}
    env.update(extra)
    return env


def test_a_crafted_newest_checkpoint_is_refused_and_the_job_resumes_from_the_good_one(tmp_path):
    ck_dir, marker = tmp_path / "ck", tmp_path / "gadget-ran.log"
    # A good checkpoint of step 5, written by this job's secret (a run of one, no launcher).
    first = subprocess.run(
        [sys.executable, str(TRAIN_DDP), "--steps", "5", "--checkpoint-every", "5",
         "--checkpoint-dir", str(ck_dir)],
        cwd=ROOT, env=_clean_env(SHOAL_AUTH_TOKEN=TOKEN), capture_output=True, text=True,
        timeout=TIMEOUT_S)
    assert first.returncode == 0, first.stderr[-3000:]
    ck = Checkpointer(ck_dir, token=TOKEN)
    assert ck.steps() == [5]
    _file_handler_gadget(ck.path(10), str(marker))
    Checkpointer(ck_dir, token="some-other-job").save(15, {"model": {}, "optim": {}})

    run = ShoalRun(["--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
                    "--checkpoint-dir", str(ck_dir), str(TRAIN_DDP), "--steps", str(STEPS),
                    "--checkpoint-every", "5"], env={"SHOAL_AUTH_TOKEN": TOKEN}, name="job")
    with run:
        assert run.wait(TIMEOUT_S) == 0, run.tail()
    out = run.output
    assert not marker.exists(), "the crafted checkpoint's gadget ran"
    assert re.search(r"Skipping checkpoint of step 15: Checkpoint '\S*ckpt-000000000015\.shoal' "
                     r".*not written by this job", out), run.tail()
    assert re.search(r"Skipping checkpoint of step 10: Checkpoint '\S*ckpt-000000000010\.shoal' "
                     r"holds the dotted global shoal\.core\.auth\.logging\.FileHandler", out), run.tail()
    assert "[rank 0] resumed from step 5 (restart 0)" in out, run.tail()
    assert re.search(rf"\[rank 0\] final step {STEPS} params_sha256 [0-9a-f]{{64}}", out)
    assert ck.load_latest()[0] == STEPS  # the job's own saves verify under its secret
