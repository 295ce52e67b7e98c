"""Writes deploy/kubernetes/monitoring/prometheusrule.yaml from shoal-rules.yml (no arguments).

The plain rules file is the one to edit; the Prometheus Operator's PrometheusRule carries the
same groups (tests/unit/test_observability_deploy.py checks they agree).
"""

from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
TARGET = HERE.parents[0] / "kubernetes" / "monitoring" / "prometheusrule.yaml"
HEADER = """\
# For the Prometheus Operator: shoal's alert and recording rules, the same groups as
# deploy/prometheus/shoal-rules.yml (written by deploy/prometheus/make_prometheusrule.py; edit
# the plain file and rerun it). Listed in monitoring/kustomization.yaml, which every variant includes;
# a cluster without the Prometheus Operator has no PrometheusRule kind: drop it there. The
# `release` label is what kube-prometheus-stack selects rules by (see podmonitor.yaml).
"""


class _Dumper(yaml.SafeDumper):
    """Multi-line PromQL as YAML block scalars, as a person would write it."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar(
    "tag:yaml.org,2002:str", s, style="|" if "\n" in s else None))


def render() -> str:
    groups = yaml.safe_load((HERE / "shoal-rules.yml").read_text())["groups"]
    doc = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
           "metadata": {"name": "shoal", "labels": {"app.kubernetes.io/part-of": "shoal",
                                                       "release": "kube-prometheus-stack"}},
           "spec": {"groups": groups}}
    return HEADER + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=120)


if __name__ == "__main__":
    TARGET.write_text(render())
    print(f"wrote {TARGET}")
