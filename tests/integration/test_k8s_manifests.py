"""deploy/kubernetes rendered as a cluster would get it, by the real `kubectl kustomize`: every
variant (the cpu, gpu and Kueue overlays of the Indexed Job, the Kubeflow Trainer v2 TrainJob,
the JobSet) passes kubernetes-validate --strict for the oldest Kubernetes the Job features need
and the newest the validator knows, its custom resources fit their CRDs' schemas (Trainer 2.3,
JobSet 0.12, Kueue 0.19; tests/data/crds), every pod meets the restricted Pod Security Standard,
and each holds what the deployment promises (an Indexed Job that ends, a run id per Job object,
a usage error failing the job at once, etcd reachable only from the job's pods, the variables
the Trainer injects read as torchrun would, a queue chain Kueue can admit, ...).
"""

from __future__ import annotations

import base64
import copy
import shutil
from pathlib import Path

import jsonschema
import pytest

from shoal.launcher.flags import parse_run
from tests.support import crd_schema
from tests.support.kustomize import render

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
VARIANTS = {"cpu": "overlays/cpu", "gpu": "overlays/gpu", "kueue": "overlays/kueue",
            "trainer": "trainer", "jobset": "jobset"}
# podFailurePolicy and the batch.kubernetes.io/ pod labels are beta/GA from 1.27 on; 1.37 is
# the newest schema kubernetes-validate ships.
KUBERNETES_VERSIONS = ["1.27.0", "1.37.0"]
# Kinds with no schema in kubernetes-validate; those with a stored CRD are checked against it.
CUSTOM_KINDS = {"PodMonitor", "PrometheusRule", "TrainJob", "ClusterTrainingRuntime", "JobSet",
                "ResourceFlavor", "ClusterQueue", "LocalQueue"}
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
    # The pod templates inside custom resources are core PodTemplateSpecs: check them too.
    for (kind, name), obj in rendered[variant].items():
        if kind in ("TrainJob", "ClusterTrainingRuntime", "JobSet"):
            for template in _pod_templates(obj):
                pod = {"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": f"{name}-pod", **template.get("metadata", {})},
                       "spec": template["spec"]}
                kubernetes_validate.validate(pod, version, strict=True)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_custom_resources_fit_their_crds_schemas(rendered, variant):
    stored = 0
    for (kind, name), obj in rendered[variant].items():
        try:
            crd_schema.validate(obj)  # raises ValidationError naming the field
        except crd_schema.UnknownKind:
            assert kind in ("PodMonitor", "PrometheusRule") or kind not in CUSTOM_KINDS, kind
            continue
        stored += 1
    assert stored >= {"cpu": 0, "gpu": 0, "kueue": 3, "trainer": 2, "jobset": 1}[variant]


def test_the_crd_check_refuses_a_misspelt_field_a_wrong_type_and_a_misplaced_namespace(
        rendered):
    job = rendered["trainer"][("TrainJob", "shoal-train")]
    misspelt = copy.deepcopy(job)
    misspelt["spec"]["trainer"]["numProcsPerNode"] = 2
    with pytest.raises(jsonschema.ValidationError, match="numProcsPerNode"):
        crd_schema.validate(misspelt)
    wrong = copy.deepcopy(job)
    wrong["spec"]["trainer"]["numNodes"] = "two"
    with pytest.raises(jsonschema.ValidationError, match="'two' is not of type 'integer'"):
        crd_schema.validate(wrong)
    runtime = copy.deepcopy(rendered["trainer"][("ClusterTrainingRuntime", "shoal")])
    runtime["metadata"]["namespace"] = "shoal"  # what a namespace transformer would do
    with pytest.raises(jsonschema.ValidationError, match="Cluster-scoped"):
        crd_schema.validate(runtime)


def _pod_templates(obj):
    if obj["kind"] in ("Job", "StatefulSet"):
        yield obj["spec"]["template"]
    elif obj["kind"] == "JobSet":
        for replicated in obj["spec"]["replicatedJobs"]:
            yield replicated["template"]["spec"]["template"]
    elif obj["kind"] == "ClusterTrainingRuntime":
        for replicated in obj["spec"]["template"]["spec"]["replicatedJobs"]:
            yield replicated["template"]["spec"]["template"]


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
            assert obj["metadata"].get("namespace", "shoal") == "shoal"
            pods += 1
    assert pods >= 1


def _container(obj, name="shoal"):
    return next(c for c in obj["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def _env(container) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


@pytest.mark.parametrize("variant", ["cpu", "gpu", "kueue"])
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


@pytest.mark.parametrize("variant", ["cpu", "gpu", "kueue"])
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
    # No guessed interface name: NCCL chooses the pod network itself, and the agents bind the
    # pod IP from the downward API.
    env = _env(container)
    assert "NCCL_SOCKET_IFNAME" not in env, env.get("NCCL_SOCKET_IFNAME")
    assert env["SHOAL_LOCAL_ADDR"] == "$(POD_IP)"
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}


def _on_an_empty_dir(pod: dict, container: dict, path: str) -> bool:
    """Whether `path` lies on one of the container's emptyDir mounts (writable under a
    read-only root filesystem)."""
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    return any("emptyDir" in volumes[m["name"]]
               and (path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/"))
               for m in container["volumeMounts"])


# What writes under $HOME at run time: the user (10001) has no home directory and the root
# filesystem is read-only, so each must point at the /tmp emptyDir.
HOME_WRITERS = {"cpu": ["HOME"], "kueue": ["HOME"], "trainer": ["HOME"], "jobset": ["HOME"],
                "gpu": ["HOME", "CUPY_CACHE_DIR", "CUDA_CACHE_PATH"]}
TRAINING_KINDS = ("Job", "JobSet", "ClusterTrainingRuntime")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_caches_that_default_to_home_are_on_the_tmp_empty_dir(rendered, variant):
    pods = [pod for obj in rendered[variant].values() if obj["kind"] in TRAINING_KINDS
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


@pytest.mark.parametrize("variant", ["cpu", "gpu", "kueue"])
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


# kube-prometheus-stack's Prometheus selects PodMonitors and PrometheusRules with this label
# (its Helm release name; the chart's install docs name the release kube-prometheus-stack).
KUBE_PROMETHEUS_STACK_SELECTOR = {"matchLabels": {"release": "kube-prometheus-stack"}}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_pod_monitor_and_rules_are_selected_by_kube_prometheus_stack(rendered, variant):
    objects = rendered[variant]
    monitor = objects[("PodMonitor", "shoal-train")]
    rule = objects[("PrometheusRule", "shoal")]
    assert _selects(KUBE_PROMETHEUS_STACK_SELECTOR, monitor["metadata"]["labels"])
    assert _selects(KUBE_PROMETHEUS_STACK_SELECTOR, rule["metadata"]["labels"])
    # ... and the monitor selects every training pod of the variant, on its metrics port.
    pods = [pod for obj in objects.values() if obj["kind"] in TRAINING_KINDS
            for pod in _pod_templates(obj)]
    assert pods
    for pod in pods:
        assert _selects(monitor["spec"]["selector"], pod["metadata"]["labels"])
        ports = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
        assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} <= ports


def _strings(env: dict) -> dict:
    return {k: v for k, v in env.items() if isinstance(v, str)}


def test_the_trainjob_runs_shoal_on_the_variables_the_trainer_injects(rendered):
    objects = rendered["trainer"]
    job = objects[("TrainJob", "shoal-train")]
    runtime = objects[("ClusterTrainingRuntime", "shoal")]
    ref = job["spec"]["runtimeRef"]
    assert (ref["apiGroup"], ref["kind"], ref["name"]) == (
        "trainer.kubeflow.org", "ClusterTrainingRuntime", runtime["metadata"]["name"])
    assert "namespace" not in runtime["metadata"] and job["metadata"]["namespace"] == "shoal"
    assert "torch" in runtime["spec"]["mlPolicy"]
    (replicated,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    # The Trainer injects into the container named `node` of the job labelled as its trainer
    # step, and numbers pods by their completion index.
    assert replicated["template"]["metadata"]["labels"][
        "trainer.kubeflow.org/trainjob-ancestor-step"] == "trainer"
    assert replicated["template"]["spec"]["completionMode"] == "Indexed"
    (container,) = replicated["template"]["spec"]["template"]["spec"]["containers"]
    assert container["name"] == "node"
    rules = replicated["template"]["spec"]["podFailurePolicy"]["rules"]
    assert {"action": "FailJob", "onExitCodes": {"containerName": "node", "operator": "In",
                                                 "values": [2]}} in rules
    # A lost pod: the JobSet recreates all (a fresh static rendezvous); a usage error ends it.
    failure = runtime["spec"]["template"]["spec"]["failurePolicy"]
    assert failure["maxRestarts"] >= 1
    assert {"name": "usage-error", "action": "FailJobSet",
            "onJobFailureReasons": ["PodFailurePolicy"]} in failure["rules"]
    trainer = job["spec"]["trainer"]
    assert not [e for e in trainer.get("env", []) if e["name"].startswith("PET_")]
    env = _env(container)
    assert env["SHOAL_AUTH_TOKEN"] == {"secretKeyRef": {"name": "shoal-auth", "key": "token"}}
    # What Trainer 2.3's torch plugin injects for this TrainJob (pkg/runtime/framework/plugins/
    # torch): the node count and processes per node from the TrainJob, the node rank from the
    # completion index, and pod 0 of the JobSet at port 29500.
    name = job["metadata"]["name"]
    pet = {"PET_NNODES": str(trainer["numNodes"]),
           "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]), "PET_NODE_RANK": "1",
           "PET_MASTER_ADDR": f"{name}-node-0-0.{name}", "PET_MASTER_PORT": "29500"}
    assert container["args"][0] == "run"
    settings = parse_run(container["args"][1:], {**_strings(env), **pet})
    assert settings.requested_backend == "static" and settings.node_rank == 1
    assert settings.rdzv_endpoints == ((f"{name}-node-0-0.{name}", 29500),)
    assert (settings.min_nodes, settings.max_nodes, settings.nproc_per_node) == (2, 2, 2)
    assert settings.module and settings.script == "shoal.examples.train_ddp"


def test_the_jobset_runs_a_static_rendezvous_on_pod_zeros_stable_name(rendered):
    jobset = rendered["jobset"][("JobSet", "shoal-train")]
    spec = jobset["spec"]
    assert spec["network"]["enableDNSHostnames"] is True
    (replicated,) = spec["replicatedJobs"]
    job = replicated["template"]["spec"]
    assert replicated["replicas"] == 1 and job["completionMode"] == "Indexed"
    assert job["completions"] == job["parallelism"] == 2
    # A usage error (exit 2) fails the Job by its podFailurePolicy, and that reason the JobSet.
    assert {"action": "FailJob", "onExitCodes": {"containerName": "shoal", "operator": "In",
                                                 "values": [2]}} in job["podFailurePolicy"]["rules"]
    assert {"name": "usage-error", "action": "FailJobSet",
            "onJobFailureReasons": ["PodFailurePolicy"]} in spec["failurePolicy"]["rules"]
    (container,) = job["template"]["spec"]["containers"]
    env = _env(container)
    assert env["SHOAL_NODE_RANK"] == {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    # A fresh rendezvous per JobSet and per restart of it.
    assert env["SHOAL_RDZV_ID"] == "$(JOBSET_UID)-$(RESTART_ATTEMPT)"
    assert env["RESTART_ATTEMPT"] == {"fieldRef": {
        "fieldPath": "metadata.labels['jobset.sigs.k8s.io/restart-attempt']"}}
    settings = parse_run(container["args"][1:], {**_strings(env), "SHOAL_NODE_RANK": "1",
                                                 "SHOAL_RDZV_ID": "0b7d3c3e-uid-0"})
    # JobSet names pod i of job j of replicated job r `<jobset>-<r>-<j>-<i>` in a subdomain
    # named after the JobSet.
    name = jobset["metadata"]["name"]
    assert settings.requested_backend == "static" and settings.node_rank == 1
    assert settings.rdzv_endpoints == ((f"{name}-{replicated['name']}-0-0.{name}", 29500),)
    assert settings.min_nodes == settings.max_nodes == job["completions"]


def _quantity(text) -> float:
    """A Kubernetes quantity (the forms the manifests use) as a number."""
    units = {"Gi": 2 ** 30, "Mi": 2 ** 20, "m": 1e-3}
    text = str(text)
    for suffix, factor in units.items():
        if text.endswith(suffix):
            return float(text[:-len(suffix)]) * factor
    return float(text)


def test_kueue_can_admit_the_job_through_its_queues(rendered):
    objects = rendered["kueue"]
    job = objects[("Job", "shoal-train")]
    assert job["spec"]["suspend"] is True  # Kueue starts it when admitted
    queue_name = job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
    local = objects[("LocalQueue", queue_name)]
    assert local["metadata"]["namespace"] == job["metadata"]["namespace"]
    cluster = objects[("ClusterQueue", local["spec"]["clusterQueue"])]
    # The API server labels every namespace with its name; the cluster queue serves this one.
    assert _selects(cluster["spec"]["namespaceSelector"],
                    {"kubernetes.io/metadata.name": job["metadata"]["namespace"]})
    (group,) = cluster["spec"]["resourceGroups"]
    (flavor,) = group["flavors"]
    assert ("ResourceFlavor", flavor["name"]) in objects
    quota = {r["name"]: _quantity(r["nominalQuota"]) for r in flavor["resources"]}
    # The whole job fits at once (Kueue admits all pods of a Job together or none).
    requests = _container(job)["resources"]["requests"]
    for resource in group["coveredResources"]:
        need = job["spec"]["parallelism"] * _quantity(requests[resource])
        assert need <= quota[resource], (resource, need, quota)
    # Everything else is the cpu overlay's Job.
    plain = copy.deepcopy(rendered["cpu"][("Job", "shoal-train")])
    plain["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] = queue_name
    plain["spec"]["suspend"] = True
    assert plain == job


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_training_pods_take_only_each_other_and_the_metrics_port(rendered, variant):
    policy = rendered[variant][("NetworkPolicy", "shoal-train")]
    pods = [pod for obj in rendered[variant].values() if obj["kind"] in TRAINING_KINDS
            for pod in _pod_templates(obj)]
    assert pods
    for pod in pods:
        labels = pod["metadata"]["labels"]
        assert _selects(policy["spec"]["podSelector"], labels)
        ingress = policy["spec"]["ingress"]
        # Any port from the job's own pods (stores, collectives, RPC bind port 0) ...
        assert any(set(rule) == {"from"} and _selects(rule["from"][0]["podSelector"], labels)
                   for rule in ingress)
        # ... and from anywhere else only the metrics port.
        others = [rule for rule in ingress if "ports" in rule]
        assert [p["port"] for rule in others for p in rule["ports"]] == [9400]
