"""Every SHOAL_* variable is declared once, read only through its layer's table, and documented.

The tables are `<layer>/settings.py` (`core.config.Setting`); the flags' variables come from
`launcher.flags`. docs/configuration.md is generated from both.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from shoal.core.config import Setting, SettingError, SettingsTable
from shoal.launcher import config_doc
from shoal.launcher.flags import RUN_GROUPS, STORE_FLAGS
from shoal.launcher.settings import LAYER_TABLES

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("core", "collectives", "rpc_agent", "elastic", "launcher", "examples", "shoal")
# Preprocessor macros inside core's CUDA kernel sources: C names, not environment variables.
CUDA_MACROS = {"SHOAL_AMSGRAD", "SHOAL_GELU_TANH", "SHOAL_INF", "SHOAL_NAN"}
NAME = re.compile(r"\bSHOAL_[A-Z0-9][A-Z0-9_]*\b")
TABLE_FILES = {"core/config.py", *(m.split(".", 1)[1].replace(".", "/") + ".py"
                                   for m in LAYER_TABLES)}


def _product_files():
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            if "_generated" not in path.parts and not path.is_symlink():
                yield path


def _declared() -> set[str]:
    names = set()
    for table in config_doc.tables():
        names |= table.names()
    for flag in [f for group in RUN_GROUPS.values() for f in group] + list(STORE_FLAGS):
        names.update(e for e in flag.envs if e.startswith("SHOAL_"))
    return names


def test_every_shoal_variable_the_code_names_is_declared():
    declared = _declared()
    unknown = []
    for path in [*_product_files(), *sorted((ROOT / "deploy").rglob("*.y*ml"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for name in NAME.findall(line):
                if name not in declared and name not in CUDA_MACROS:
                    unknown.append(f"{path.relative_to(ROOT)}:{number}: {name}")
    assert not unknown, "named but declared by no settings table or flag:\n" + "\n".join(unknown)


def _env_reads(tree: ast.AST):
    """(line, name) of each place that reads a SHOAL_ variable by its literal name: a
    .get/.getenv/.pop/.setdefault call, a subscript load, or an `in` test."""
    def literal(node):
        return (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and node.value.startswith("SHOAL_"))

    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("get", "getenv", "pop", "setdefault")
                and node.args and literal(node.args[0])):
            yield node.lineno, node.args[0].value
        elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
              and literal(node.slice)):
            yield node.lineno, node.slice.value
        elif (isinstance(node, ast.Compare) and literal(node.left)
              and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)):
            yield node.lineno, node.left.value


def test_no_code_reads_a_shoal_variable_around_its_table():
    reads = []
    for path in _product_files():
        rel = path.relative_to(ROOT).as_posix()
        if rel in TABLE_FILES:
            continue
        reads += [f"{rel}:{line}: {name}" for line, name in
                  _env_reads(ast.parse(path.read_text(), rel))]
    assert not reads, ("read directly instead of through its settings table:\n"
                       + "\n".join(reads))


def test_each_variable_is_declared_by_one_table_only():
    seen: dict[str, str] = {}
    twice = []
    for table in config_doc.tables():
        for name in table.names():
            if name in seen:
                twice.append(f"{name}: {seen[name]} and {table.layer}")
            seen[name] = table.layer
    assert not twice, twice


def test_the_configuration_page_is_generated_from_the_tables():
    assert config_doc.PAGE.read_text() == config_doc.render(), (
        "docs/configuration.md is out of date: run python -m shoal.launcher.config_doc")


def test_the_page_lists_every_declared_variable():
    page = config_doc.PAGE.read_text()
    missing = sorted(n for n in _declared() if f"`{n}`" not in page)
    assert not missing, missing


# ----------------------------------------------------------------------------- Setting itself

def test_values_are_parsed_by_kind_and_unset_means_the_default():
    spin = Setting("SHOAL_T_SPIN", "float", 50.0, "Spin.", minimum=0)
    flag = Setting("SHOAL_T_FLAG", "bool", True, "Flag.")
    mode = Setting("SHOAL_T_MODE", "choice", "shm", "Mode.", choices=("shm", "unix", "tcp"))
    assert spin.get({}) == 50.0 and spin.get({"SHOAL_T_SPIN": " "}) == 50.0
    assert spin.get({"SHOAL_T_SPIN": "0"}) == 0.0
    assert [flag.get({"SHOAL_T_FLAG": v}) for v in ("1", "on", "No", "false")] == [
        True, True, False, False]
    assert mode.get({"SHOAL_T_MODE": " UNIX "}) == "unix"


@pytest.mark.parametrize("setting, raw, rule", [
    (Setting("SHOAL_T_SPIN", "float", 50.0, "Spin.", minimum=0), "-5", "at least 0"),
    (Setting("SHOAL_T_SPIN", "float", 50.0, "Spin.", minimum=0), "nan", "finite"),
    (Setting("SHOAL_T_N", "int", None, "N.", positive=True), "0", "greater than 0"),
    (Setting("SHOAL_T_N", "int", None, "N.", positive=True), "2.5", "an integer"),
    (Setting("SHOAL_T_FLAG", "bool", True, "Flag."), "maybe", "must be 0 or 1"),
    (Setting("SHOAL_T_MODE", "choice", "a", "Mode.", choices=("a", "b")), "c", "one of 'a', 'b'"),
])
def test_a_bad_value_is_refused_naming_the_variable_the_rule_and_the_value(setting, raw, rule):
    with pytest.raises(SettingError, match=rf"^{setting.name} .*{rule}.*got {raw!r}"):
        setting.get({setting.name: raw})


def test_a_secret_is_never_shown_in_an_error():
    token = Setting("SHOAL_T_TOKEN", "secret", None, "Token.")
    assert token.get({"SHOAL_T_TOKEN": " s3cret "}) == " s3cret "  # kept byte for byte
    refusal = token._refuse("s3cret", "must be something")
    assert isinstance(refusal, SettingError)
    assert "s3cret" not in str(refusal) and "(hidden)" in str(refusal)


def test_an_alias_is_read_when_the_name_is_unset():
    debug = Setting("SHOAL_T_DEBUG", "choice", "off", "Debug.", choices=("off", "info"),
                    aliases=("TORCH_T_DEBUG",))
    assert debug.get({"TORCH_T_DEBUG": "INFO"}) == "info"
    assert debug.get({"TORCH_T_DEBUG": "INFO", "SHOAL_T_DEBUG": "off"}) == "off"


def test_a_table_refuses_a_name_twice_and_checks_every_value():
    one = Setting("SHOAL_T_A", "int", 1, "A.")
    with pytest.raises(ValueError, match="twice"):
        SettingsTable("t", "T.", (one, one))
    table = SettingsTable("t", "T.", (one, Setting("SHOAL_T_B", "bool", False, "B.")))
    table.check({"SHOAL_T_A": "3"})
    with pytest.raises(SettingError, match="SHOAL_T_B"):
        table.check({"SHOAL_T_B": "2"})
