"""The worker's environment, built in one place (elastic.agent.env): what every worker of a node
starts from, and what one worker's place in the round adds; read back through the tables."""

import os

from shoal.collectives import settings as collectives_settings
from shoal.core import settings as core_settings
from shoal.elastic.agent.env import WorkerPlace, node_env, worker_env

PLACE = WorkerPlace(rank=5, local_rank=1, world_size=8, local_world_size=2, group_rank=2,
                    num_nodes=4, round=3)


def test_node_env_keeps_the_launchers_environment_but_not_what_is_the_agents_own():
    launcher = {"PATH": "/bin", "GRPC_ENABLE_FORK_SUPPORT": "false",
                "TORCHELASTIC_ERROR_FILE": "/dev/termination-log", "OMP_NUM_THREADS": "4"}
    env = node_env(launcher, nproc_per_node=2, agent_only=("GRPC_ENABLE_FORK_SUPPORT",))
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "4"}


def test_node_env_carries_the_launchers_flags_to_every_worker(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = node_env({}, nproc_per_node=3, collective_timeout=12.5, profile_dir="traces")
    assert collectives_settings.COLLECTIVE_TIMEOUT.get(env) == 12.5
    assert core_settings.PROFILE_DIR.get(env) == os.path.join(str(tmp_path), "traces")
    assert env["OMP_NUM_THREADS"] == "1"  # torchrun's rule for several workers per node
    assert "OMP_NUM_THREADS" not in node_env({}, nproc_per_node=1)


def test_worker_env_places_the_worker_and_reads_back_through_the_tables():
    env = worker_env({"PATH": "/bin"}, PLACE, master_addr="10.0.0.1", master_port=29500,
                     run_id="job", restarts=2, max_restarts=3, checkpoint_dir="/ck",
                     auth_token="s3cret", multiproc_dir="/prom", dump_dir="/dumps",
                     role="trainer", error_file="/err/rank_5/error.json")
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR",
                                "MASTER_PORT", "PATH")} == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "2", "GROUP_WORLD_SIZE": "4", "ROLE_NAME": "trainer",
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "PATH": "/bin"}
    assert core_settings.RUN_ID.get(env) == "job"
    assert core_settings.RESTART_COUNT.get(env) == 2
    assert core_settings.RDZV_ROUND.get(env) == 3
    assert core_settings.CHECKPOINT_DIR.get(env) == "/ck"
    assert core_settings.AUTH_TOKEN.get(env) == "s3cret"
    assert collectives_settings.ASYNC_ERROR_HANDLING.get(env) is True
    assert collectives_settings.USE_AGENT_STORE.get(env) is True
    assert collectives_settings.DUMP_DIR.get(env) == "/dumps"
    assert env["TORCHELASTIC_ERROR_FILE"] == "/err/rank_5/error.json"
    assert env["PROMETHEUS_MULTIPROC_DIR"] == "/prom"
    assert env["TORCHELASTIC_MAX_RESTARTS"] == "3"
    core_settings.TABLE.check(env)
    collectives_settings.TABLE.check(env)


def test_worker_env_leaves_out_what_it_was_not_given():
    env = worker_env({}, PLACE, master_addr="h", master_port=1, run_id="r", restarts=0,
                     max_restarts=0, checkpoint_dir="/c", auth_token="t", multiproc_dir=None)
    assert env["ROLE_NAME"] == "default"
    for name in ("TORCHELASTIC_ERROR_FILE", "PROMETHEUS_MULTIPROC_DIR",
                 collectives_settings.DUMP_DIR.name):
        assert name not in env
