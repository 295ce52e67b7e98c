"""deploy/prometheus/shoal-rules.yml and deploy/compose: promtool accepts the rules, its unit tests
(deploy/prometheus/tests/shoal-rules.test.yml) pass and cover every alert, the PrometheusRule
carries the same groups, and the dashboard keeps to its rules (run selector on every query,
$__rate_interval windows, no label that only a custom relabel rule would add)."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS / "shoal-rules.yml"
RULE_TESTS = PROMETHEUS / "tests" / "shoal-rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "shoal-dashboard.json"


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        from tests.support.requirements import missing
        missing("the alert rule tests", "promtool is not installed (apt-get install prometheus)")
    return promtool


def test_promtool_checks_the_rules():
    done = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 10 rules found" in done.stdout


def test_promtool_unit_tests_pass():
    done = subprocess.run([_promtool(), "test", "rules", RULE_TESTS.name], cwd=RULE_TESTS.parent,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_promtool_unit_tests_can_fail(tmp_path):
    # The same tests against rules whose no-progress threshold was raised must fail.
    rules = RULES.read_text().replace("> 600", "> 6000")
    (tmp_path / "shoal-rules.yml").write_text(rules)
    tests_dir = tmp_path / "tests"
    tests_dir.mkdir()
    (tests_dir / RULE_TESTS.name).write_text(RULE_TESTS.read_text())
    done = subprocess.run([_promtool(), "test", "rules", RULE_TESTS.name], cwd=tests_dir,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "ShoalNoProgress" in done.stdout + done.stderr


def _alerts() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [r["alert"] for g in groups for r in g["rules"] if "alert" in r]


def test_every_alert_has_a_firing_and_a_quiet_unit_test():
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    cases = [c for t in tests for c in t.get("alert_rule_test", [])]
    assert set(_alerts()) == {
        "ShoalAgentDown", "ShoalWorkersRestarted", "ShoalRestartsNearlyExhausted",
        "ShoalCollectiveErrors", "ShoalCollectiveTimeouts", "ShoalNoProgress",
        "ShoalRPCAuthRejections", "ShoalCheckpointTooOld"}
    for alert in _alerts():
        mine = [c for c in cases if c["alertname"] == alert]
        assert any(c["exp_alerts"] for c in mine), f"{alert} is never expected to fire"
        assert any(not c["exp_alerts"] for c in mine), f"{alert} is never expected quiet"


def test_the_prometheusrule_carries_the_same_groups():
    sys.path.insert(0, str(PROMETHEUS))
    try:
        import make_prometheusrule
    finally:
        sys.path.remove(str(PROMETHEUS))
    on_disk = make_prometheusrule.TARGET.read_text()
    assert on_disk == make_prometheusrule.render(), \
        "prometheusrule.yaml is stale: run python deploy/prometheus/make_prometheusrule.py"
    doc = yaml.safe_load(on_disk)
    assert doc["kind"] == "PrometheusRule"
    assert doc["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]


def _exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_is_generated_from_its_script():
    done = subprocess.run([sys.executable, "-c",
                           "import json, make_dashboard; print(json.dumps("
                           "make_dashboard.dashboard(), indent=2))"],
                          cwd=DASHBOARD.parent, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == json.loads(DASHBOARD.read_text()), \
        "shoal-dashboard.json is stale: run python deploy/grafana/make_dashboard.py"


def test_dashboard_queries_select_the_run_and_use_the_rate_interval():
    for expr in _exprs():
        assert 'run_id=~"$run"' in expr, expr
        windows = re.findall(r"\[([^\]]+)\]", expr)
        assert all(w == "$__rate_interval" for w in windows), expr
        # `node` and `service` exist only through prometheus.yml's relabel rules.
        assert not re.search(r"\b(node|service)\b", expr), expr
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert any("shoal_rpc_rejected_total" in t["expr"] for p in panels
               for t in p.get("targets", []))
    names = [v["name"] for v in json.loads(DASHBOARD.read_text())["templating"]["list"]]
    assert {"run", "rank"} <= set(names)


@pytest.mark.parametrize("variable", ["run", "rank"])
def test_dashboard_selectors_query_declared_series(variable):
    templating = json.loads(DASHBOARD.read_text())["templating"]["list"]
    (var,) = [v for v in templating if v["name"] == variable]
    assert re.match(r"label_values\(shoal_[a-z_]+(\{[^}]*\})?, (run_id|rank)\)$",
                    var["definition"]), var["definition"]


COMPOSE = ROOT / "deploy" / "compose"


def test_compose_mounts_files_that_exist_and_its_prometheus_config_is_valid(tmp_path):
    compose = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    assert set(compose["services"]) == {"prometheus", "grafana"}
    for service in compose["services"].values():
        for volume in service["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE / source).exists(), f"compose mounts missing {source}"
    # Laid out as the container sees it: the rules file beside the config.
    shutil.copy(COMPOSE / "prometheus.yml", tmp_path / "prometheus.yml")
    shutil.copy(RULES, tmp_path / "shoal-rules.yml")
    done = subprocess.run([_promtool(), "check", "config", str(tmp_path / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 10 rules found" in done.stdout + done.stderr


def test_compose_grafana_reads_the_compose_prometheus_at_its_scrape_interval():
    compose = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    listen = [a for a in compose["services"]["prometheus"]["command"]
              if a.startswith("--web.listen-address=")]
    assert listen == ["--web.listen-address=127.0.0.1:9090"]
    (source,) = yaml.safe_load((COMPOSE / "grafana-datasource.yaml").read_text())["datasources"]
    assert source["url"] == "http://127.0.0.1:9090"
    interval = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())["global"]
    # $__rate_interval is 4x Grafana's idea of the scrape interval: they must agree.
    assert source["jsonData"]["timeInterval"] == interval["scrape_interval"]
    assert compose["services"]["grafana"]["environment"]["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
