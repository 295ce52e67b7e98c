"""deploy/kubernetes rendered as a cluster would get it: every variant (the cpu and gpu overlays,
the Kubeflow PyTorchJob) passes kubernetes-validate --strict for the oldest Kubernetes the Job
features need and the newest the validator knows, meets the restricted Pod Security Standard,
and holds what the deployment promises (an Indexed Job that ends, a run id per Job object, a
usage error failing the Job at once, etcd reachable only from the job's pods, ...).

Rendering: tests/support/kustomize_lite.py, and `kubectl kustomize` too where installed; both
must give the same objects.
"""

from __future__ import annotations

import base64
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from shoal.launcher.flags import parse_run
from tests.support.kustomize_lite import render

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
VARIANTS = {"cpu": "overlays/cpu", "gpu": "overlays/gpu", "kubeflow": "kubeflow"}
# podFailurePolicy and the batch.kubernetes.io/ pod labels are beta/GA from 1.27 on; 1.37 is
# the newest schema kubernetes-validate ships.
KUBERNETES_VERSIONS = ["1.27.0", "1.37.0"]
CUSTOM_KINDS = {"PodMonitor", "PyTorchJob", "PrometheusRule"}
TOKEN = "0123456789abcdef" * 4


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """A copy of deploy/kubernetes with the secret's file in place, as an operator makes it."""
    copy = tmp_path_factory.mktemp("k8s") / "kubernetes"
    shutil.copytree(KUBERNETES, copy)
    (copy / "common" / "secrets" / "token").write_text(TOKEN)
    return copy


def _by_key(objects):
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


@pytest.fixture(scope="module")
def rendered(tree) -> dict[str, dict]:
    return {name: _by_key(render(tree / path)) for name, path in VARIANTS.items()}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_small_renderer_agrees_with_kubectl_kustomize(tree, rendered, variant):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: kustomize_lite's output is not cross-checked")
    done = subprocess.run([kubectl, "kustomize", str(tree / VARIANTS[variant])],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    theirs = _by_key(d for d in yaml.safe_load_all(done.stdout) if d)
    assert _decoded(theirs) == _decoded(rendered[variant])


def _decoded(objects: dict) -> dict:
    """Secrets' data decoded: kustomize wraps long base64 values over several lines."""
    out = {}
    for key, obj in objects.items():
        if obj["kind"] == "Secret":
            obj = {**obj, "data": {k: base64.b64decode(v) for k, v in obj["data"].items()}}
        out[key] = obj
    return out


def test_no_secret_renders_without_the_operators_token(tmp_path):
    copy = tmp_path / "kubernetes"
    shutil.copytree(KUBERNETES, copy)
    (copy / "common" / "secrets" / "token").unlink(missing_ok=True)
    with pytest.raises(FileNotFoundError):
        render(copy / "overlays" / "cpu")
    assert not (KUBERNETES / "common" / "secrets" / "token").exists() or \
        "token" in (KUBERNETES / "common" / "secrets" / ".gitignore").read_text()


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_object_passes_kubernetes_validate_strict(rendered, variant, version):
    import kubernetes_validate

    checked = 0
    for (kind, name), obj in rendered[variant].items():
        if kind in CUSTOM_KINDS:
            with pytest.raises(kubernetes_validate.SchemaNotFoundError):
                kubernetes_validate.validate(obj, version, strict=True)
            continue
        kubernetes_validate.validate(obj, version, strict=True)  # raises ValidationError
        checked += 1
    assert checked >= 3


def _pod_templates(obj):
    if obj["kind"] in ("Job", "StatefulSet"):
        yield obj["spec"]["template"]
    elif obj["kind"] == "PyTorchJob":
        for replica in obj["spec"]["pytorchReplicaSpecs"].values():
            yield replica["template"]


RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                      "persistentVolumeClaim", "projected", "secret"}


def _check_restricted(where: str, pod: dict) -> None:
    """The restricted Pod Security Standard (its 'latest' rules)."""
    spec = pod["spec"]
    ctx = spec.get("securityContext", {})
    assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), where
    for volume in spec.get("volumes", []):
        assert set(volume) - {"name"} <= RESTRICTED_VOLUMES, (where, volume)
    assert ctx.get("seccompProfile", {}).get("type") in ("RuntimeDefault", "Localhost"), where
    for container in spec.get("initContainers", []) + spec["containers"]:
        c = container.get("securityContext", {})
        assert c.get("allowPrivilegeEscalation") is False, (where, container["name"])
        assert c.get("capabilities", {}).get("drop") == ["ALL"], (where, container["name"])
        assert set(c.get("capabilities", {}).get("add", [])) <= {"NET_BIND_SERVICE"}, where
        assert not c.get("privileged"), where
        non_root = c.get("runAsNonRoot", ctx.get("runAsNonRoot"))
        user = c.get("runAsUser", ctx.get("runAsUser"))
        assert non_root is True and isinstance(user, int) and user > 0, (where, "numeric uid")
        # Beyond the standard, as the issue asks: nothing writes the image's filesystem.
        assert c.get("readOnlyRootFilesystem") is True, (where, container["name"])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_pod_meets_the_restricted_pod_security_standard(rendered, variant):
    namespace = rendered[variant][("Namespace", "shoal")]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    pods = 0
    for (kind, name), obj in rendered[variant].items():
        for pod in _pod_templates(obj):
            _check_restricted(f"{kind}/{name}", pod)
            assert obj["metadata"]["namespace"] == "shoal"
            pods += 1
    assert pods >= 2


def _container(obj, name="shoal"):
    return next(c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def _env(container) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_the_job_ends_with_training_and_fails_at_once_on_a_usage_error(rendered, variant,
                                                                       monkeypatch):
    job = rendered[variant][("Job", "shoal-train")]
    gpus = _container(job)["resources"].get("limits", {}).get("nvidia.com/gpu", 0)
    from shoal.launcher import devices

    monkeypatch.setattr(devices, "gpu_count", lambda: gpus)  # what the pod would see
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == 2
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    rules = spec["podFailurePolicy"]["rules"]
    assert {"action": "FailJob", "onExitCodes": {"containerName": "shoal", "operator": "In",
                                                 "values": [2]}, "onPodConditions": []} in rules
    container = _container(job)
    env = _env(container)
    # A run id per Job object, the node rank from the completion index.
    assert env["SHOAL_RDZV_ID"] == {"fieldRef": {
        "fieldPath": "metadata.labels['batch.kubernetes.io/controller-uid']"}}
    assert env["SHOAL_NODE_RANK"] == {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    assert env["TORCHELASTIC_ERROR_FILE"] == "/dev/termination-log"
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]  # the read-only root needs a writable /tmp
    assert env["SHOAL_DUMP_DIR"].startswith("/checkpoints/")  # dumps on the checkpoint volume
    assert volumes[mounts["/checkpoints"]]["persistentVolumeClaim"]["claimName"] == \
        "shoal-checkpoints"
    secret = rendered[variant][("Secret", "shoal-auth")]
    assert env["SHOAL_AUTH_TOKEN"] == {"secretKeyRef": {"name": "shoal-auth", "key": "token"}}
    assert base64.b64decode(secret["data"]["token"]).decode() == TOKEN
    # The command line is one shoal run accepts: the image's entry point is `tini -- shoal`.
    args = container["args"]
    assert args[0] == "run"
    fields = {"SHOAL_RDZV_ID": "0b7d3c3e-uid", "SHOAL_NODE_RANK": "0"}
    settings = parse_run(args[1:], {**{k: v for k, v in env.items() if isinstance(v, str)},
                                    **fields})
    assert settings.rdzv_backend == "etcd" and settings.rdzv_id == "0b7d3c3e-uid"
    assert settings.min_nodes == settings.max_nodes == spec["completions"]
    assert settings.module and settings.script == "shoal.examples.train_ddp"


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_a_missing_job_uid_label_fails_the_job_at_once(rendered, variant, monkeypatch, capsys):
    """Before Kubernetes 1.27 the pod has no batch.kubernetes.io/controller-uid label, so the
    downward API gives SHOAL_RDZV_ID an empty value: every Job would share etcd run id
    'default'. shoal run refuses it with exit 2, which the podFailurePolicy turns into a
    failed Job at once (not backoffLimit retries of the same mistake)."""
    job = rendered[variant][("Job", "shoal-train")]
    container = _container(job)
    from shoal.launcher import devices

    monkeypatch.setattr(devices, "gpu_count", lambda: 2)
    env = {k: v for k, v in _env(container).items() if isinstance(v, str)}
    with pytest.raises(SystemExit) as exit_info:
        parse_run(container["args"][1:], {**env, "SHOAL_RDZV_ID": "", "SHOAL_NODE_RANK": "0"})
    assert exit_info.value.code == 2
    assert "SHOAL_RDZV_ID is set but empty" in capsys.readouterr().err
    assert 2 in job["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"]


def test_the_gpu_overlay_asks_for_gpus_shared_memory_and_one_worker_per_gpu(rendered):
    job = rendered["gpu"][("Job", "shoal-train")]
    container = _container(job)
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert "--nproc-per-node=gpu" in container["args"]
    assert container["image"].startswith("shoal-gpu:")
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert "NCCL_SOCKET_IFNAME" in _env(container)


def _on_an_empty_dir(pod: dict, container: dict, path: str) -> bool:
    """Whether `path` lies on one of the container's emptyDir mounts (writable under a
    read-only root filesystem)."""
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    return any("emptyDir" in volumes[m["name"]]
               and (path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/"))
               for m in container["volumeMounts"])


# What writes under $HOME at run time: the user (10001) has no home directory and the root
# filesystem is read-only, so each must point at the /tmp emptyDir.
HOME_WRITERS = {"cpu": ["HOME"], "kubeflow": ["HOME"],
                "gpu": ["HOME", "CUPY_CACHE_DIR", "CUDA_CACHE_PATH"]}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_caches_that_default_to_home_are_on_the_tmp_empty_dir(rendered, variant):
    pods = [pod for obj in rendered[variant].values() if obj["kind"] in ("Job", "PyTorchJob")
            for pod in _pod_templates(obj)]  # the training pods (etcd writes only its data)
    assert pods
    for pod in pods:
        container = pod["spec"]["containers"][0]
        env = _env(container)
        for name in HOME_WRITERS[variant]:
            assert isinstance(env.get(name), str), (variant, name, "not set")
            assert _on_an_empty_dir(pod, container, env[name]), (variant, name, env[name])
    if variant == "gpu":
        assert _env(pods[0]["spec"]["containers"][0])["CUPY_CACHE_DIR"] == \
            "/tmp/cupy/kernel_cache"


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_etcd_takes_clients_only_from_the_jobs_pods(rendered, variant):
    objects = rendered[variant]
    policy = objects[("NetworkPolicy", "etcd")]
    etcd = objects[("StatefulSet", "etcd")]["spec"]["template"]["metadata"]["labels"]
    job_pod = objects[("Job", "shoal-train")]["spec"]["template"]["metadata"]["labels"]
    assert _selects(policy["spec"]["podSelector"], etcd)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    client_rules = [r for r in policy["spec"]["ingress"]
                    if {"port": 2379, "protocol": "TCP"} in r["ports"]]
    assert len(client_rules) == 1
    sources = client_rules[0]["from"]
    assert all(set(s) == {"podSelector"} for s in sources)  # no namespace or IP block
    assert any(_selects(s["podSelector"], job_pod) for s in sources)
    assert not any(_selects(s["podSelector"], {"app.kubernetes.io/part-of": "shoal"})
                   for s in sources)  # not every pod of the app: only the workers


@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_disruption_budget_and_pod_monitor_select_the_jobs_pods(rendered, variant):
    objects = rendered[variant]
    job = objects[("Job", "shoal-train")]
    labels = job["spec"]["template"]["metadata"]["labels"]
    pdb = objects[("PodDisruptionBudget", "shoal-train")]
    assert _selects(pdb["spec"]["selector"], labels) and pdb["spec"]["maxUnavailable"] == 1
    monitor = objects[("PodMonitor", "shoal-train")]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert _selects(monitor["spec"]["selector"], labels)
    ports = {p["name"] for p in _container(job)["ports"]}
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports
    assert _env(_container(job))["SHOAL_METRICS_PORT"] == "9400"
    # Without the operator: the headless Service that deploy/prometheus/prometheus.yml resolves.
    service = objects[("Service", "shoal-train")]
    assert service["spec"]["clusterIP"] == "None"
    assert all(labels.get(k) == v for k, v in service["spec"]["selector"].items())
    assert job["spec"]["template"]["spec"]["subdomain"] == "shoal-train"
    scrape = (ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text()
    assert f'"shoal-train.{service["metadata"]["namespace"]}.svc.cluster.local"' in scrape


def test_the_pytorchjob_variant_runs_shoal_on_kubeflows_variables(rendered):
    job = rendered["kubeflow"][("PyTorchJob", "shoal-train")]
    assert job["apiVersion"] == "kubeflow.org/v1"
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    for replica in replicas.values():
        assert replica["restartPolicy"] == "ExitCode"
        container = replica["template"]["spec"]["containers"][0]
        assert container["name"] == "pytorch"  # the name the operator injects into
        # What the operator injects for 2 nodes; the args name no rendezvous of their own.
        pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": job["spec"]["nprocPerNode"],
               "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "shoal-train-master-0",
               "PET_MASTER_PORT": "23456"}
        settings = parse_run(container["args"][1:], pet)
        assert settings.requested_backend == "static" and settings.node_rank == 1
        assert settings.rdzv_endpoints == (("shoal-train-master-0", 23456),)
        assert (settings.min_nodes, settings.nproc_per_node) == (2, 2)
