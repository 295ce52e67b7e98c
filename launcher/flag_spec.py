"""`Flag`: one option of `shoal run` or `shoal store`, with its spellings, converter, default and
the variables that back it; `add_flag` puts it on an argparse parser and `apply_env` fills in
what the command line left out from those variables, then the default.

The flag tables themselves are `launcher.flags` (shoal's) and `launcher.torch_conf` (torchrun's
flags that shoal accepts without a counterpart).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Callable, Mapping, Optional, Sequence

from shoal.launcher.converters import boolean

# A flag such as --max-restarts reads SHOAL_MAX_RESTARTS (see Flag.env).
ENV_PREFIX = "SHOAL_"


@dataclasses.dataclass(frozen=True)
class Flag:
    """One option: its name (dashes), converter, default, help and whether it takes no value."""

    name: str
    convert: Callable[[str], object]
    default: object
    help: str
    switch: bool = False
    short: Optional[str] = None
    env_prefix: str = ENV_PREFIX

    @property
    def dest(self) -> str:
        """The attribute name (underscores)."""
        return self.name.replace("-", "_")

    @property
    def env(self) -> str:
        """The variable that backs this flag."""
        return self.env_prefix + self.dest.upper()

    @property
    def envs(self) -> tuple[str, ...]:
        """The variables that back this flag, first found wins: shoal's, then torchrun's
        `PET_<FLAG>` (what Kubeflow's PyTorchJob and Trainer inject)."""
        if self.env_prefix != ENV_PREFIX:
            return (self.env,)
        return (self.env, "PET_" + self.dest.upper())

    @property
    def option_strings(self) -> list[str]:
        """Both spellings (and the short one, if any)."""
        spellings = [f"--{self.name}"]
        if "-" in self.name:
            spellings.append(f"--{self.dest}")
        if self.short:
            spellings.insert(0, self.short)
        return spellings


def add_flag(container, flag: Flag) -> None:
    """Add `flag` to an argparse parser or argument group (its default is left to apply_env)."""
    kwargs = dict(dest=flag.dest, default=None, help=f"{flag.help} [{', '.join(flag.envs)}]")
    if flag.switch:
        # A switch takes no value (so `--standalone train.py` keeps the script); its variable
        # may still say false.
        container.add_argument(*flag.option_strings, action="store_const", const=True, **kwargs)
    else:
        container.add_argument(*flag.option_strings, type=flag.convert,
                               metavar=flag.dest.upper(), **kwargs)


def apply_env(parser: argparse.ArgumentParser, flags: Sequence[Flag], ns: argparse.Namespace,
              environ: Mapping[str, str]) -> None:
    """Set each of `flags` not given on the command line from its variable, else its default;
    a bad value ends in `parser`'s usage error naming the flag and the variable."""
    for flag in flags:
        if getattr(ns, flag.dest) is not None:
            continue
        name, raw = next(((n, environ[n]) for n in flag.envs if environ.get(n, "") != ""),
                         (None, None))
        if raw is not None:
            convert = boolean if flag.switch else flag.convert
            try:
                value = convert(raw)
            except argparse.ArgumentTypeError as exc:
                parser.error(
                    f"argument {'/'.join(flag.option_strings)} (from {name}={raw!r}): {exc}"
                )
        else:
            value = flag.default
        setattr(ns, flag.dest, value)


class CommandParser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are short: one usage line, the error, and where
    the full list is, instead of argparse's usage block of every flag above the error (30
    lines for `shoal run`, which pushed the error itself off a small terminal)."""

    # argparse's own words for a command line without the script, and what to say instead.
    _NO_SCRIPT = "the following arguments are required: script"

    def __init__(self, *args, short_usage: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.short_usage = short_usage

    def error(self, message: str):
        """Print the short usage line and `message`, then exit with status 2."""
        if message.startswith(self._NO_SCRIPT):
            message = ("name the training script to run, after the flags (or -m MODULE, or a "
                       "program with --no-python)")
        # The error stays the last line, where argparse (and scripts reading it) put it.
        self.exit(2, f"usage: {self.short_usage}   (`{self.prog} --help` lists every flag)\n"
                     f"{self.prog}: error: {message}\n")
