"""`shoal run` inside a Slurm step: the node count, node rank and rendezvous from SLURM_*,
beneath whatever the user said (a flag, a SHOAL_ or PET_ variable), and nothing outside a step."""

from __future__ import annotations

import pytest

from shoal.launcher import slurm
from shoal.launcher.flags import parse_run

SCRIPT = ["-m", "shoal.examples.train_ddp"]
# What srun sets on the second node of `sbatch --nodes=2` job 4321, step 0, one task per node.
STEP = {"SLURM_JOB_ID": "4321", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2",
        "SLURM_JOB_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NODEID": "1",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}


@pytest.mark.parametrize("hostlist, first", [
    ("node1", "node1"), ("node1,node2", "node1"), ("node[03-05,9]", "node03"),
    ("gpu[1,3],cpu[2-4]", "gpu1"), ("rack[2-3]-n[010-012]", "rack2-n010"),
    ("a-b.c", "a-b.c"), ("n[7]", "n7"),
])
def test_the_first_host_of_a_hostlist(hostlist, first):
    assert slurm.first_host(hostlist) == first


@pytest.mark.parametrize("bad", ["", "node[1-2", "node]1[", "[[1]]"])
def test_a_malformed_hostlist_is_named(bad):
    with pytest.raises(slurm.SlurmError, match="hostlist"):
        slurm.first_host(bad)


def test_a_step_gives_the_node_count_rank_and_a_c10d_rendezvous_on_the_first_node():
    settings = parse_run(["--nproc-per-node", "2", *SCRIPT], STEP)
    assert (settings.min_nodes, settings.max_nodes, settings.node_rank) == (2, 2, 1)
    assert settings.requested_backend == "c10d" and settings.rdzv_backend == "store"
    # 29400 + 4321 % 1000: another job's rendezvous on gpu07 takes another port.
    assert settings.rdzv_endpoints == (("gpu07", 29721),)
    assert settings.rdzv_id == "slurm-4321-0.0"
    assert not settings.embedded_store  # node 1 is a client of node 0's store
    first = parse_run(SCRIPT, {**STEP, "SLURM_NODEID": "0"})
    assert first.node_rank == 0 and first.embedded_store


def test_a_requeued_job_and_a_new_step_meet_fresh_rendezvous():
    assert parse_run(SCRIPT, {**STEP, "SLURM_RESTART_COUNT": "2"}).rdzv_id == "slurm-4321-2.0"
    assert parse_run(SCRIPT, {**STEP, "SLURM_STEP_ID": "3"}).rdzv_id == "slurm-4321-0.3"


def test_the_user_wins_over_slurm():
    # A flag, or the flag's own variable, beats what Slurm says ...
    assert parse_run(["--nnodes", "1:2", *SCRIPT], STEP).min_nodes == 1
    assert parse_run(SCRIPT, {**STEP, "SHOAL_NNODES": "1:2"}).min_nodes == 1
    assert parse_run(SCRIPT, {**STEP, "SHOAL_RDZV_ID": "mine"}).rdzv_id == "mine"
    # ... and a rendezvous the user names leaves Slurm's out entirely.
    etcd = parse_run(["--rdzv-backend", "etcd", "--rdzv-endpoint", "etcd:2379", *SCRIPT],
                     {**STEP, "SHOAL_RDZV_ID": "run"})
    assert etcd.rdzv_backend == "etcd" and etcd.rdzv_endpoints == (("etcd", 2379),)
    assert (etcd.min_nodes, etcd.node_rank) == (1, None)
    static = parse_run(SCRIPT, {**STEP, "PET_MASTER_ADDR": "m0", "PET_MASTER_PORT": "23456"})
    assert static.rdzv_endpoints == (("m0", 23456),) and static.min_nodes == 1


def test_outside_a_step_nothing_is_read():
    batch_script = {k: v for k, v in STEP.items() if k != "SLURM_STEP_ID"}
    settings = parse_run(SCRIPT, batch_script)
    assert (settings.min_nodes, settings.node_rank, settings.rdzv_endpoints) == (1, None, ())


def test_several_tasks_on_a_node_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_run(SCRIPT, {**STEP, "SLURM_STEP_TASKS_PER_NODE": "2,1"})
    assert exit_info.value.code == 2
    assert "srun --ntasks-per-node=1 shoal run" in capsys.readouterr().err


def test_a_step_without_its_node_list_is_a_usage_error(capsys):
    broken = {k: v for k, v in STEP.items() if not k.endswith("NODELIST")}
    with pytest.raises(SystemExit):
        parse_run(SCRIPT, broken)
    assert "SLURM_STEP_NODELIST" in capsys.readouterr().err
