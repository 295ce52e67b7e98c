"""`shoal run` inside a Slurm job step: the node count, this node's rank and the rendezvous
come from Slurm's variables, as torchrun users otherwise spell them out by hand.

    #SBATCH --nodes=2 --ntasks-per-node=1
    srun shoal run --nproc-per-node 4 train.py

In a step started by `srun` (SLURM_STEP_ID is set) with one task per node, and unless the
rendezvous was given (a --rdzv-backend, --rdzv-endpoint, --master-addr or --master-port flag,
or their SHOAL_ or PET_ variables, or --standalone):

- the node count is the step's (SLURM_STEP_NUM_NODES, else SLURM_JOB_NUM_NODES), unless
  --nnodes says otherwise (`--nnodes 1:$SLURM_JOB_NUM_NODES` lets the job shrink);
- this node's rank is SLURM_NODEID, so the first node of the step hosts the rendezvous store;
- the rendezvous is torchrun's c10d at the first host of SLURM_STEP_NODELIST (else
  SLURM_JOB_NODELIST), port 29400 plus the job id modulo 1000 (two jobs sharing that node
  do not collide);
- the run id is `slurm-<job id>-<requeue count>.<step id>`: a requeued job (SLURM_RESTART_COUNT)
  or a new step meets a fresh rendezvous, and resumes from its checkpoints.

A flag or a SHOAL_ variable always wins over what Slurm says. Outside a step (the batch script
itself, a login node) nothing is read: run `shoal run` under `srun`.
"""

from __future__ import annotations

import argparse
import re
from typing import Mapping, Optional

from shoal.launcher.flag_spec import ENV_PREFIX

__all__ = ["RENDEZVOUS_BASE_PORT", "SlurmError", "first_host", "in_step", "slurm_settings",
           "fill_in"]

RENDEZVOUS_BASE_PORT = 29400  # torchrun's c10d default; plus the job id modulo 1000
_PORT_SPREAD = 1000
# The flags (and their SHOAL_/PET_ variables) that name a rendezvous: with any of them the
# user chose one and Slurm's is not applied.
_RENDEZVOUS_FLAGS = ("rdzv_backend", "rdzv_endpoint", "master_addr", "master_port", "standalone")
_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


class SlurmError(ValueError):
    """A Slurm step shoal run cannot take its settings from (the message says why)."""


def in_step(environ: Mapping[str, str]) -> bool:
    """True inside a job step started by srun."""
    return bool(environ.get("SLURM_JOB_ID")) and bool(environ.get("SLURM_STEP_ID",
                                                                  environ.get("SLURM_STEPID")))


def first_host(hostlist: str) -> str:
    """The first host of a Slurm hostlist (`node[03-05,9],gpu1` -> `node03`).

    Raises:
        SlurmError: an empty or malformed hostlist.
    """
    text = hostlist.strip()
    depth, end = 0, len(text)
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            break
        if char == "," and depth == 0:
            end = i
            break
    first = text[:end]
    if not first or depth not in (0, 1) or first.count("[") != first.count("]"):
        raise SlurmError(f"Cannot read the first host of the Slurm hostlist {hostlist!r}.")
    # Each bracketed range set stands for its first member: "[03-05,9]" -> "03".
    return re.sub(r"\[([^\]]*)\]", lambda m: m.group(1).split(",")[0].split("-")[0], first)


def _tasks_per_node(spec: str) -> list[int]:
    """Slurm's tasks-per-node list (`2(x3),1` -> [2, 2, 2, 1])."""
    counts: list[int] = []
    for part in spec.split(","):
        match = _TASKS.match(part.strip())
        if not match:
            raise SlurmError(f"Cannot read SLURM_STEP_TASKS_PER_NODE={spec!r}.")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """What Slurm's variables say for this step, by flag ({dest: value}; {} outside a step).

    Raises:
        SlurmError: more than one task on a node (two agents would share a node rank), or a
            variable Slurm always sets in a step is missing or malformed.
    """
    if not in_step(environ):
        return {}
    tasks = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    if tasks and any(n != 1 for n in _tasks_per_node(tasks)):
        raise SlurmError(
            f"This Slurm step runs {tasks} tasks per node (SLURM_STEP_TASKS_PER_NODE); shoal "
            "run starts every worker of its node itself, so run one per node: srun "
            "--ntasks-per-node=1 shoal run --nproc-per-node N ...")
    nodes = environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_JOB_NUM_NODES") \
        or environ.get("SLURM_NNODES")
    hostlist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST") \
        or environ.get("SLURM_NODELIST")
    node_id = environ.get("SLURM_NODEID")
    job = environ["SLURM_JOB_ID"]
    missing = [name for name, value in (("SLURM_STEP_NUM_NODES", nodes),
                                        ("SLURM_STEP_NODELIST", hostlist),
                                        ("SLURM_NODEID", node_id)) if not value]
    if missing:
        raise SlurmError(f"Slurm step {job}.{environ.get('SLURM_STEP_ID')} has no "
                         f"{', '.join(missing)}: cannot tell the nodes of this job apart.")
    if not job.isdigit() or not str(node_id).isdigit():
        raise SlurmError(f"SLURM_JOB_ID={job!r} and SLURM_NODEID={node_id!r} must be numbers.")
    port = RENDEZVOUS_BASE_PORT + int(job) % _PORT_SPREAD
    step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
    return {
        "nnodes": str(nodes),
        "node_rank": str(node_id),
        "rdzv_backend": "c10d",
        "rdzv_endpoint": f"{first_host(hostlist)}:{port}",
        "rdzv_id": f"slurm-{job}-{environ.get('SLURM_RESTART_COUNT') or 0}.{step}",
    }


def fill_in(parser: argparse.ArgumentParser, ns: argparse.Namespace,
            environ: Mapping[str, str]) -> Mapping[str, str]:
    """`environ` with Slurm's settings added beneath the user's: applied only inside a step
    and when neither the command line (`ns`) nor a variable names a rendezvous; a variable
    already set (shoal's or PET_) is kept. A step shoal run cannot use is a usage error."""
    if not in_step(environ):
        return environ
    for dest in _RENDEZVOUS_FLAGS:
        if getattr(ns, dest, None) is not None or _set(environ, dest):
            return environ
    try:
        found = slurm_settings(environ)
    except SlurmError as exc:
        parser.error(str(exc))
    merged = dict(environ)
    for dest, value in found.items():
        if getattr(ns, dest, None) is None and not _set(environ, dest):
            merged[ENV_PREFIX + dest.upper()] = value
    return merged


def _set(environ: Mapping[str, str], dest: str) -> Optional[str]:
    """The user's own variable for flag `dest` (shoal's or torchrun's PET_), if not empty."""
    upper = dest.upper()
    return environ.get(ENV_PREFIX + upper) or environ.get("PET_" + upper) or None
