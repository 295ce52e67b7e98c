"""`shoal run --collective-timeout` and a clear sentence when --metrics-port is taken."""

import socket
import subprocess
import sys

import pytest

from shoal.launcher.flags import parse_run

SCRIPT = __file__


def test_collective_timeout_in_both_spellings_and_from_its_variable():
    assert parse_run([SCRIPT], {}).collective_timeout is None
    assert parse_run(["--collective-timeout", "3", SCRIPT], {}).collective_timeout == 3.0
    assert parse_run(["--collective_timeout", "2.5", SCRIPT], {}).collective_timeout == 2.5
    environ = {"SHOAL_COLLECTIVE_TIMEOUT": "9"}
    assert parse_run([SCRIPT], environ).collective_timeout == 9.0
    assert parse_run(["--collective-timeout", "4", SCRIPT], environ).collective_timeout == 4.0


@pytest.mark.parametrize("value", ["0", "-2", "soon"])
def test_a_bad_collective_timeout_is_a_usage_error(capsys, value):
    with pytest.raises(SystemExit) as info:
        parse_run(["--collective-timeout", value, SCRIPT], {})
    assert info.value.code == 2
    assert "--collective-timeout/--collective_timeout" in capsys.readouterr().err


def test_the_workers_get_the_collective_timeout(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import os\nprint('TIMEOUT', os.environ.get('SHOAL_COLLECTIVE_TIMEOUT'))\n")
    out = subprocess.run([sys.executable, "-m", "shoal.launcher", "run", "--standalone",
                          "--collective-timeout", "3", str(script)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "TIMEOUT 3.0" in out.stdout


def test_a_metrics_port_in_use_is_one_sentence_and_exit_2(tmp_path):
    script = tmp_path / "nothing.py"
    script.write_text("")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "shoal.launcher", "run", "--standalone",
                              "--metrics-port", str(port), str(script)],
                             capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines == [f"shoal run: error: argument --metrics-port/--metrics_port: 127.0.0.1:{port} "
                     "is already in use; choose another port, or 0 for any free one."], out.stderr
