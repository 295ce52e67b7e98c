"""The check again from saved output of this bench, with the formulas as they are now."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from .fit import fit_model, median_model
from .formulas import Model


def replay(paths: Sequence[str]) -> tuple[Model, list[list[dict]], int]:
    """The median model, the bench rows of each round and the cores they ran on, from saved
    output of this bench (its `round_fit` rows, which carry the raw figures, and its `bench`
    rows): to check the formulas and the fits as they are now against earlier runs."""
    models, runs, cores = [], {}, set()
    for path in paths:
        for line in Path(path).read_text().splitlines():
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            if row.get("bench") != "scale_model":
                continue
            key = (path, row.get("round"))
            if row.get("row") == "round_fit":
                if "raw" not in row:
                    raise SystemExit(f"{path}: a round_fit row without its raw figures "
                                     f"(written before --replay could refit); cannot replay")
                models.append(fit_model(row["raw"]))
                cores.add(row["cores"])
            elif row.get("row") == "bench":
                runs.setdefault(key, []).append(row["data"])
    if not models:
        raise SystemExit(f"no round_fit rows in {', '.join(paths)}")
    if len(cores) != 1:
        raise SystemExit(f"the runs replayed ran on different core counts {sorted(cores)}: "
                         f"replay one machine's runs at a time")
    # Predictions for the check depend on the cores the runs had, not on this machine's.
    return median_model(models), list(runs.values()), cores.pop()
