"""The `shoal` command's usage and its errors (issue 37's CLI items), run in-process."""

from __future__ import annotations

import pytest

from shoal.launcher import cli, flags


def _usage_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_help_names_every_command(capsys):
    assert cli.main(["--help"]) == 0
    usage = capsys.readouterr().out.splitlines()[0]
    for command in ("run", "store", "trace", "top"):
        assert command in usage, usage


def test_no_command_names_every_command_under_one_usage_line(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["usage: shoal {run,store,trace,top,--version} ...",
                   "shoal: error: name a command: run, store, trace or top"]


def test_run_without_a_script_says_to_name_one(capsys):
    err = _usage_error(capsys, ["run"])
    assert "name the training script to run" in err
    assert "script_args" not in err


def test_a_bad_flag_value_is_not_buried_under_the_usage_block(capsys):
    err = _usage_error(capsys, ["run", "--nproc-per-node", "x", "train.py"]).splitlines()
    # One usage line pointing at --help, then the error: not argparse's usage of every flag.
    assert len(err) == 2, err
    assert err[0].startswith("usage: shoal run [flags] SCRIPT [ARGS...]")
    assert "`shoal run --help` lists every flag" in err[0]
    assert err[1].startswith("shoal run: error: argument --nproc-per-node")


def test_a_bad_profile_directory_is_a_usage_error_at_launch(capsys, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    script = tmp_path / "train.py"
    script.write_text("")
    err = _usage_error(capsys, ["run", "--profile", str(blocker / "traces"), str(script)])
    assert "argument --profile/--profile-dir/--profile_dir: cannot create directory" in err


def test_local_addr_help_describes_the_default_in_use():
    text = next(f.help for group in flags.RUN_GROUPS.values() for f in group
                if f.dest == "local_addr")
    assert "FQDN" not in text
    assert "routes to the rendezvous endpoint" in text


@pytest.mark.parametrize("argv", [["store", "--port", "x"], ["top", "--interval", "x"]],
                         ids=["store", "top"])
def test_the_other_commands_usage_errors_are_short_too(capsys, argv):
    err = _usage_error(capsys, argv).splitlines()
    assert len(err) == 2, err
    assert err[0].startswith(f"usage: shoal {argv[0]} ")
    assert err[1].startswith(f"shoal {argv[0]}: error: argument {argv[1]}")
