"""Start `shoal run` as a real subprocess and follow its output (for the integration tests)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ROOT / "tests" / "integration" / "workers"
TRAIN_DDP = ROOT / "examples" / "train_ddp.py"


class FollowedProcess:
    """A started process whose stdout (and stderr, merged) a thread reads line by line, so a
    test can wait for a line, read the output so far, and collect the exit status."""

    def __init__(self, proc: subprocess.Popen, name: str):
        self.name = name
        self.proc = proc
        self._lines: list[str] = []
        self.last_index = 0  # the line the last successful wait_for matched
        self._cond = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                self._lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def output(self) -> str:
        """Everything printed so far."""
        with self._cond:
            return "\n".join(self._lines)

    def lines(self) -> list[str]:
        """The lines printed so far."""
        with self._cond:
            return list(self._lines)

    def wait_for(self, pattern: str, timeout: float, start: int = 0) -> re.Match:
        """Wait for a line matching `pattern` (from line `start`); fail with the output tail.

        The matching line's index is left in `last_index`.
        """
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for index in range(start, len(self._lines)):
                    match = regex.search(self._lines[index])
                    if match:
                        self.last_index = index
                        return match
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    break
                self._cond.wait(min(left, 0.2))
        raise AssertionError(
            f"{self.name} printed no line matching {pattern!r} within {timeout:g}s "
            f"(exit status {self.proc.poll()}); output:\n{self.tail()}"
        )

    def wait(self, timeout: float) -> int:
        """Wait for the exit status; on timeout kill the process and fail with its output."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"{self.name} did not finish within {timeout:g}s; output:\n{self.tail()}"
            ) from None
        self._reader.join(5.0)
        return code

    def kill(self) -> None:
        """SIGKILL the process's group (it was started in a session of its own; a `shoal run`
        agent's workers also die with it through their parent-death signal)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)

    def tail(self, n: int = 80) -> str:
        """The last `n` lines."""
        return "\n".join(self.lines()[-n:])


class ShoalRun(FollowedProcess):
    """One `python -m shoal.launcher run ARGS` process; its stdout and stderr are read by a thread."""

    def __init__(self, args: Sequence[str], env: Optional[dict] = None, name: str = "shoal"):
        self.args = list(args)
        full_env = dict(os.environ)
        full_env.update(env or {})
        super().__init__(subprocess.Popen(
            [sys.executable, "-m", "shoal.launcher", "run", *self.args], cwd=ROOT, env=full_env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, errors="replace", start_new_session=True,
        ), name)

    def signal(self, signum: int) -> None:
        """Send `signum` to the agent process only."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signum)

    def worker_pids(self, timeout: float, start: int = 0) -> list[int]:
        """The pids of the workers this agent started (from its 'Started ranks' log line)."""
        match = self.wait_for(r"Started ranks \[[0-9, ]+\] as pids \[([0-9, ]+)\]", timeout, start)
        return [int(p) for p in match.group(1).split(",")]

    def store_port(self, timeout: float = 30.0) -> int:
        """The port of the embedded rendezvous store this agent hosts."""
        match = self.wait_for(r"Rendezvous store listening on \S+:(\d+)", timeout)
        return int(match.group(1))

    def __enter__(self) -> "ShoalRun":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def pid_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


# ----------------------------------------------------------------------------- train_ddp's output

def digest_in(output: str, steps: int) -> Optional[str]:
    """The params_sha256 rank 0 of examples/train_ddp.py printed after step `steps`, if any."""
    match = re.search(rf"\[rank 0\] final step {steps} params_sha256 ([0-9a-f]{{64}})", output)
    return match.group(1) if match else None


def final_sha(run: ShoalRun, steps: int) -> str:
    """The params_sha256 rank 0 printed after its last step (the run must have printed it)."""
    sha = digest_in(run.output, steps)
    assert sha, f"{run.name} printed no final line for step {steps}:\n{run.tail()}"
    return sha


def steps_run(lines: list[str]) -> list[int]:
    """The steps rank 0 reported, in order."""
    return [int(m.group(1)) for line in lines if (m := re.match(r"\[rank 0\] step (\d+) ", line))]


def check_resume(run: ShoalRun, restart: int, steps: int, every: int, start: int = 0) -> int:
    """The job resumed (in `restart`, at or after output line `start`) from a checkpoint it had
    reached (a multiple of `every`) and then ran every later step exactly once; returns the
    step it resumed from."""
    lines = run.lines()
    pattern = re.compile(rf"\[rank 0\] resumed from step (\d+) \(restart {restart}\)")
    index = next((i for i, line in enumerate(lines) if i >= start and pattern.search(line)),
                 None)
    assert index is not None, f"{run.name} never resumed (restart {restart}):\n{run.tail()}"
    resumed = int(pattern.search(lines[index]).group(1))
    before, after = steps_run(lines[:index]), steps_run(lines[index:])
    assert resumed >= every and resumed % every == 0, (resumed, every)
    assert resumed <= max(before), f"resumed from step {resumed}, which the job had not reached"
    assert after == list(range(resumed + 1, steps + 1)), \
        f"steps after the resume: {after}\n" + "\n".join(lines[max(0, index - 20):index + 80])
    return resumed
