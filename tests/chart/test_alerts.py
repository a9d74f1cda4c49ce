"""The chart's alerting rules: rendered by helm, checked and unit-tested by promtool (the Prometheus build's)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness.autoscaling import prometheus_dir
from tests.chart.test_chart import CHART, KUBE_VERSION, by_kind, helm, one, render

pytestmark = pytest.mark.usefixtures("testbin")

PROMETHEUS_RULE_API = "monitoring.coreos.com/v1/PrometheusRule"
PROMTOOL_TESTS = Path(__file__).with_name("alerts_test.yaml")


def rendered_rules(*sets: str) -> dict[str, Any]:
    """The rule groups of the chart's alerts ConfigMap (the same groups as its PrometheusRule); `sets`
    are --set-json values, so that a number stays a number."""
    args = ["template", "fm", str(CHART), "--namespace", "flashmodel-system", "--kube-version", KUBE_VERSION]
    for value in ("alerts.configMap.enabled=true", *sets):
        args += ["--set-json", value]
    docs = [d for d in yaml.safe_load_all(helm(*args).stdout) if d]
    config_map = one(docs, "ConfigMap", "fm-flashmodel-operator-alerts")
    rules: dict[str, Any] = yaml.safe_load(config_map["data"]["rules.yaml"])
    return rules


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    binary = prometheus_dir() / "promtool"
    if not binary.exists():
        pytest.fail(f"promtool not found at {binary}; run scripts/testbin.sh (it builds promtool beside prometheus)")
    return subprocess.run([str(binary), *args], capture_output=True, text=True, cwd=cwd, check=False)


def test_the_rules_pass_promtools_check_and_its_unit_tests(tmp_path: Path) -> None:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(rendered_rules()))
    checked = promtool("check", "rules", "rules.yaml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tests = yaml.safe_load(PROMTOOL_TESTS.read_text())
    tests["rule_files"] = ["rules.yaml"]
    (tmp_path / "alerts_test.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    tested = promtool("test", "rules", "alerts_test.yaml", cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_every_alert_is_unit_tested() -> None:
    alerts = {r["alert"] for g in rendered_rules()["groups"] for r in g["rules"] if "alert" in r}
    tested = {
        t["alertname"] for case in yaml.safe_load(PROMTOOL_TESTS.read_text())["tests"] for t in case["alert_rule_test"]
    }
    assert alerts == tested


def test_the_slo_and_the_operator_job_come_from_values() -> None:
    rules = rendered_rules(
        "alerts.slo.objective=0.995",
        'alerts.slo.ttftSeconds="0.5"',
        'alerts.operatorJob="flashmodel"',
        'alerts.labels={"team": "ml"}',
    )
    by_name = {r.get("alert") or r["record"]: r for g in rules["groups"] for r in g["rules"]}
    assert 'le="0.5"' in by_name["flashmodel:ttft_slo_errors:ratio_rate1h"]["expr"]
    burns = [r["expr"] for g in rules["groups"] for r in g["rules"] if r.get("alert") == "FlashModelTTFTBudgetBurn"]
    # 14.4 and 6 times a 0.5 % budget.
    assert ["> 0.072" in e for e in burns] == [True, False] and ["> 0.03" in e for e in burns] == [False, True]
    assert by_name["FlashModelOperatorDown"]["expr"] == 'absent(up{job="flashmodel"} == 1)'
    assert all(r["labels"]["team"] == "ml" for r in by_name.values() if "alert" in r)


def _rendered_with_the_prometheus_rule_crd(*args: str) -> list[dict[str, Any]]:
    out = helm(
        "template",
        "fm",
        str(CHART),
        "--namespace",
        "flashmodel-system",
        "--kube-version",
        KUBE_VERSION,
        "--api-versions",
        PROMETHEUS_RULE_API,
        *args,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_a_prometheus_rule_where_the_crd_is_served_and_none_where_it_is_not() -> None:
    assert not by_kind(render(), "PrometheusRule")
    rule = one(_rendered_with_the_prometheus_rule_crd(), "PrometheusRule")
    assert rule["spec"] == rendered_rules()
    off = _rendered_with_the_prometheus_rule_crd("--set", "alerts.prometheusRule.enabled=false")
    assert not by_kind(off, "PrometheusRule")
