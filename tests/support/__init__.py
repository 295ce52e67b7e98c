"""Helpers the test folders share, imported as `tests.support.<module>` (pytest puts the
repository root on sys.path through `pythonpath` in pyproject.toml)."""
