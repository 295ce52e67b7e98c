"""Settings read from the environment, declared once in a table per layer.

Each layer keeps one table, `<layer>/settings.py`, of `Setting`s (name, type, default, meaning)
and reads its `SHOAL_*` variables only through it: `SPIN_US.get()`, never `os.environ`. The
configuration page (docs/configuration.md) is generated from every table and from the launcher's
flag table (`python -m shoal.launcher.config_doc`), and tests/unit/test_settings.py fails when
code names a `SHOAL_` variable that no table declares or reads one outside its table.

A value is checked where it is read, with an error that names the variable, the rule and the
value, so `SHOAL_SPIN_US=-5` is refused rather than clamped; the launcher checks every table up
front (`check_all`) so a bad value stops `shoal run` before any worker starts.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from shoal.core.errors import ShoalError

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off"})
KINDS = ("str", "int", "float", "bool", "choice", "path", "secret")


class SettingError(ShoalError, ValueError):
    """A `SHOAL_*` variable whose value its setting refuses; the message names both."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One environment variable: its name, kind, default (None: unset) and meaning.

    `kind` is one of `KINDS`: "bool" reads 1/0/true/false/yes/no/on/off; "choice" one of
    `choices` (case-insensitive, returned lower-case); "int"/"float" a number, at least `minimum`
    when given (`positive` excludes zero); "path" and "secret" are strings ("secret" is never
    printed). `aliases` are read, in order, when the name itself is unset or empty (torch's
    spelling of the same knob, say). `set_by` names what writes it when users normally do not
    (the launcher, for a worker's environment).
    """

    name: str
    kind: str
    default: Any
    meaning: str
    choices: tuple[str, ...] = ()
    minimum: Optional[float] = None
    positive: bool = False
    aliases: tuple[str, ...] = ()
    set_by: str = ""

    def __post_init__(self) -> None:
        if not self.name.isupper() or " " in self.name:
            raise ValueError(f"A setting's name is an upper-case variable name, got {self.name!r}.")
        if self.kind not in KINDS:
            raise ValueError(f"Setting {self.name}: kind must be one of {KINDS}, got {self.kind!r}.")
        if self.kind == "choice" and not self.choices:
            raise ValueError(f"Setting {self.name}: a choice needs its choices.")
        if not self.meaning.strip():
            raise ValueError(f"Setting {self.name} needs a meaning.")

    def raw(self, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
        """The text of the first of the name and its aliases that is set and not blank."""
        env = os.environ if environ is None else environ
        for name in (self.name, *self.aliases):
            value = env.get(name)
            if value is not None and value.strip() != "":
                return value
        return None

    def is_set(self, environ: Optional[Mapping[str, str]] = None) -> bool:
        """Whether the variable (or an alias) holds a value."""
        return self.raw(environ) is not None

    def get(self, environ: Optional[Mapping[str, str]] = None) -> Any:
        """The parsed value, or the default when unset.

        Raises:
            SettingError: the value is not of the setting's kind or breaks its rule.
        """
        raw = self.raw(environ)
        return self.default if raw is None else self.parse(raw)

    def parse(self, raw: str) -> Any:
        """`raw` converted to the setting's kind and checked against its rule."""
        text = raw.strip()
        if self.kind in ("str", "path", "secret"):
            return raw if self.kind == "secret" else text
        if self.kind == "bool":
            low = text.lower()
            if low in TRUE_WORDS:
                return True
            if low in FALSE_WORDS:
                return False
            raise self._refuse(raw, "must be 0 or 1 (or true/false, yes/no, on/off)")
        if self.kind == "choice":
            low = text.lower()
            if low not in self.choices:
                raise self._refuse(raw, "must be one of " + ", ".join(repr(c) for c in self.choices))
            return low
        return self._number(raw, text)

    def _number(self, raw: str, text: str) -> Any:
        convert: Callable[[str], Any] = int if self.kind == "int" else float
        try:
            value = convert(text)
        except ValueError:
            raise self._refuse(raw, f"must be {'an integer' if self.kind == 'int' else 'a number'}"
                               ) from None
        if isinstance(value, float) and not math.isfinite(value):
            raise self._refuse(raw, "must be a finite number")
        if self.positive and value <= 0:
            raise self._refuse(raw, "must be greater than 0")
        if self.minimum is not None and value < self.minimum:
            raise self._refuse(raw, f"must be at least {self.minimum:g}")
        return value

    def _refuse(self, raw: str, rule: str) -> SettingError:
        shown = "(hidden)" if self.kind == "secret" else repr(raw)
        return SettingError(f"{self.name} {rule}; got {shown}. {self.meaning}")

    @property
    def default_text(self) -> str:
        """The default as the configuration page shows it."""
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        return str(self.default)


@dataclasses.dataclass(frozen=True)
class SettingsTable:
    """A layer's settings, in the order its configuration section lists them."""

    layer: str
    summary: str
    settings: tuple[Setting, ...]

    def __post_init__(self) -> None:
        names = [s.name for s in self.settings]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"The {self.layer} settings table declares {twice} twice.")

    def __iter__(self) -> Iterator[Setting]:
        return iter(self.settings)

    def __getitem__(self, name: str) -> Setting:
        for setting in self.settings:
            if setting.name == name:
                return setting
        raise KeyError(f"The {self.layer} settings table has no {name}.")

    def names(self) -> set[str]:
        """Every variable the table reads, aliases included."""
        return {n for s in self.settings for n in (s.name, *s.aliases)}

    def check(self, environ: Optional[Mapping[str, str]] = None) -> None:
        """Parse every setting that is set, so a bad value fails here and not inside a worker.

        Raises:
            SettingError: the first bad value, in table order.
        """
        for setting in self.settings:
            setting.get(environ)


def check_all(tables: Sequence[SettingsTable], environ: Optional[Mapping[str, str]] = None) -> None:
    """`check` each of `tables`."""
    for table in tables:
        table.check(environ)
