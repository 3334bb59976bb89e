"""The chart's alerts: the rules from the rendered PrometheusRule pass `promtool check rules`, and `promtool test rules`
runs a unit test for every alert (fires when it should, with the expected labels and text, and stays quiet when it
should not)."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.integration.test_chart import one, render_chart
from tests.services import require_binary

ALERTS = {"TrainingRunFailed", "TrainingRunNoProgress", "TrainingRunRestartsClimbing", "TrainingRunScheduleImbalanceHigh"}


def rules_file(tmp_path, values: dict | None = None):
    values = {"prometheusRule": {"enabled": True, **(values or {})}}
    rule = one(render_chart(values), "PrometheusRule")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return path, rule


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([require_binary("promtool"), *args], capture_output=True, text=True, timeout=60)


def test_rules_pass_promtool_check(tmp_path):
    path, rule = rules_file(tmp_path)
    assert {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]} == ALERTS
    proc = promtool("check", "rules", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 rules found" in proc.stdout


def test_promtool_check_catches_a_broken_rule(tmp_path):
    path, _ = rules_file(tmp_path)
    doc = yaml.safe_load(path.read_text())
    doc["groups"][0]["rules"][0]["expr"] = "max by (namespace, run) (trainingrun_operator_run_phase{phase=Failed})"
    path.write_text(yaml.safe_dump(doc))
    assert promtool("check", "rules", str(path)).returncode != 0


def _run_unit_tests(tmp_path, rules, tests: list[dict]) -> subprocess.CompletedProcess:
    test_file = tmp_path / "tests.yaml"
    test_file.write_text(yaml.safe_dump({"rule_files": [rules.name], "evaluation_interval": "1m", "tests": tests},
                                        sort_keys=False))
    return promtool("test", "rules", str(test_file))


def _failed_alert(ns: str, run: str) -> dict:
    return {
        "exp_labels": {"severity": "warning", "namespace": ns, "run": run},
        "exp_annotations": {
            "summary": f"TrainingRun {ns}/{run} failed",
            "description": f"TrainingRun {ns}/{run} is in phase Failed; see its status.message and events: "
                           f"`kubectl describe trainingrun -n {ns} {run}`.",
        },
    }


PHASE = "trainingrun_operator_run_phase"
FAILED = {
    "interval": "1m",
    "input_series": [
        # research/a: Running, Failed from minute 2, deleted at minute 6 (the operator removes its series)
        {"series": f'{PHASE}{{namespace="research", run="a", phase="Running", job="operator", pod="op-1"}}',
         "values": "1 1 0 0 0 0 stale"},
        {"series": f'{PHASE}{{namespace="research", run="a", phase="Failed", job="operator", pod="op-1"}}',
         "values": "0 0 1 1 1 1 stale"},
        # research/b: Running throughout
        {"series": f'{PHASE}{{namespace="research", run="b", phase="Running", job="operator", pod="op-1"}}',
         "values": "1x10"},
        {"series": f'{PHASE}{{namespace="research", run="b", phase="Failed", job="operator", pod="op-1"}}',
         "values": "0x10"},
        # prod/c: Failed from minute 3; the operator pod is replaced at minute 5 (same run, new pod label)
        {"series": f'{PHASE}{{namespace="prod", run="c", phase="Failed", job="operator", pod="op-1"}}',
         "values": "0 0 0 1 1 stale"},
        {"series": f'{PHASE}{{namespace="prod", run="c", phase="Failed", job="operator", pod="op-2"}}',
         "values": "_x5 1x5"},
    ],
    "alert_rule_test": [
        {"eval_time": "1m", "alertname": "TrainingRunFailed", "exp_alerts": []},
        {"eval_time": "2m", "alertname": "TrainingRunFailed", "exp_alerts": []},  # research/a pending (for: 1m)
        {"eval_time": "4m", "alertname": "TrainingRunFailed",
         "exp_alerts": [_failed_alert("research", "a"), _failed_alert("prod", "c")]},
        # research/a was deleted; prod/c is one alert across the operator pods
        {"eval_time": "7m", "alertname": "TrainingRunFailed", "exp_alerts": [_failed_alert("prod", "c")]},
    ],
}

NO_PROGRESS = {
    "interval": "1m",
    "input_series": [
        # run a trains 20 steps, then hangs; run b keeps training; run c is young and still at step 0.
        {"series": 'trainingrun_trainer_step{namespace="research", run="a", rank="0"}', "values": "0+1x20 20x30"},
        {"series": 'trainingrun_trainer_step{namespace="research", run="b", rank="0"}', "values": "0+1x50"},
        {"series": 'trainingrun_trainer_step{namespace="prod", run="c", rank="0"}', "values": "_x40 0x10"},
    ],
    "alert_rule_test": [
        {"eval_time": "30m", "alertname": "TrainingRunNoProgress", "exp_alerts": []},
        {"eval_time": "35m", "alertname": "TrainingRunNoProgress", "exp_alerts": []},  # 15m without a step: pending
        {"eval_time": "37m", "alertname": "TrainingRunNoProgress", "exp_alerts": [{
            "exp_labels": {"severity": "warning", "namespace": "research", "run": "a"},
            "exp_annotations": {
                "summary": "TrainingRun research/a makes no progress",
                "description": "No new optimizer step for 15m (step 20): check the rollout pod and the trainers' logs.",
            },
        }]},
        {"eval_time": "50m", "alertname": "TrainingRunNoProgress", "exp_alerts": [{
            "exp_labels": {"severity": "warning", "namespace": "research", "run": "a"},
            "exp_annotations": {
                "summary": "TrainingRun research/a makes no progress",
                "description": "No new optimizer step for 15m (step 20): check the rollout pod and the trainers' logs.",
            },
        }]},
    ],
}

def _restarts_alert(ns: str, run: str, n: int, threshold: int = 2) -> dict:
    return {
        "exp_labels": {"severity": "warning", "namespace": ns, "run": run},
        "exp_annotations": {
            "summary": f"TrainingRun {ns}/{run} restarts repeatedly",
            "description": f"TrainingRun {ns}/{run} restarted its group {n} times within 1h (threshold {threshold}); "
                           "see its events and pod logs.",
        },
    }


RUN_RESTARTS = "trainingrun_operator_run_restarts"
RESTARTS = {
    "interval": "1m",
    "input_series": [
        # research/a: restarts at minutes 11, 22 and 33, then none; the operator pod is replaced at minute 26
        {"series": f'{RUN_RESTARTS}{{namespace="research", run="a", job="operator", pod="op-1"}}',
         "values": "0x10 1x10 2x3 stale"},
        {"series": f'{RUN_RESTARTS}{{namespace="research", run="a", job="operator", pod="op-2"}}',
         "values": "_x26 2x6 3x90"},
        # prod/b: created at minute 50, crash-loops: 3 restarts in its first 3 minutes (younger than the window)
        {"series": f'{RUN_RESTARTS}{{namespace="prod", run="b", job="operator", pod="op-2"}}',
         "values": "_x50 0 1 2 3x70"},
        # research/c: 5 restarts, deleted at minute 21, re-created under the same name at minute 26, 1 restart since
        {"series": f'{RUN_RESTARTS}{{namespace="research", run="c", job="operator", pod="op-1"}}',
         "values": "0 1 2 3 4 5x15 stale _x4 0x5 1x95"},
    ],
    "alert_rule_test": [
        {"eval_time": "30m", "alertname": "TrainingRunRestartsClimbing", "exp_alerts": []},  # a: 2 restarts
        {"eval_time": "35m", "alertname": "TrainingRunRestartsClimbing",
         "exp_alerts": [_restarts_alert("research", "a", 3)]},  # c: 1 restart of the new run, not 5
        {"eval_time": "52m", "alertname": "TrainingRunRestartsClimbing",
         "exp_alerts": [_restarts_alert("research", "a", 3)]},  # b: 2 restarts so far
        {"eval_time": "54m", "alertname": "TrainingRunRestartsClimbing",
         "exp_alerts": [_restarts_alert("research", "a", 3), _restarts_alert("prod", "b", 3)]},
        {"eval_time": "100m", "alertname": "TrainingRunRestartsClimbing",  # a's last hour was quiet
         "exp_alerts": [_restarts_alert("prod", "b", 3)]},
        {"eval_time": "115m", "alertname": "TrainingRunRestartsClimbing", "exp_alerts": []},
    ],
}

IMBALANCE = {
    "interval": "1m",
    "input_series": [
        {"series": 'trainingrun_rollout_schedule_imbalance{namespace="research", run="a"}', "values": "1.2x10 1.8x60"},
        {"series": 'trainingrun_rollout_schedule_imbalance{namespace="research", run="b"}', "values": "1.1x70"},
        # a short spike that resolves before 30m
        {"series": 'trainingrun_rollout_schedule_imbalance{namespace="prod", run="c"}', "values": "1.9x10 1.0x60"},
    ],
    "alert_rule_test": [
        {"eval_time": "20m", "alertname": "TrainingRunScheduleImbalanceHigh", "exp_alerts": []},
        {"eval_time": "40m", "alertname": "TrainingRunScheduleImbalanceHigh", "exp_alerts": []},  # 29m above: pending
        {"eval_time": "45m", "alertname": "TrainingRunScheduleImbalanceHigh", "exp_alerts": [{
            "exp_labels": {"severity": "info", "namespace": "research", "run": "a"},
            "exp_annotations": {
                "summary": "TrainingRun research/a has an unbalanced schedule",
                "description": "The busiest rank gets 1.80× the mean token load (threshold 1.5 for 30m); consider a "
                               "smaller maxTokensPerGPU or more samples per step.",
            },
        }]},
    ],
}


def test_every_alert_has_a_passing_promtool_unit_test(tmp_path):
    rules, _ = rules_file(tmp_path)
    tests = [FAILED, NO_PROGRESS, RESTARTS, IMBALANCE]
    tested = {case["alertname"] for t in tests for case in t["alert_rule_test"]}
    assert tested == ALERTS
    proc = _run_unit_tests(tmp_path, rules, tests)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_promtool_unit_tests_fail_on_a_wrong_expectation(tmp_path):
    """The unit tests can fail: expecting the hung run to be `b` is reported."""
    rules, _ = rules_file(tmp_path)
    wrong = yaml.safe_load(yaml.safe_dump(NO_PROGRESS))
    wrong["alert_rule_test"][2]["exp_alerts"][0]["exp_labels"]["run"] = "b"
    proc = _run_unit_tests(tmp_path, rules, [wrong])
    assert proc.returncode != 0 and "FAILED" in proc.stdout + proc.stderr


@pytest.mark.parametrize("threshold, fires_at_35m", [(2, True), (3, False)])
def test_restart_threshold_comes_from_values(tmp_path, threshold, fires_at_35m):
    rules, _ = rules_file(tmp_path, {"restartsThreshold": threshold})
    case = yaml.safe_load(yaml.safe_dump(RESTARTS))
    case["alert_rule_test"] = [case["alert_rule_test"][1]]
    case["alert_rule_test"][0]["exp_alerts"] = [_restarts_alert("research", "a", 3, threshold)] if fires_at_35m else []
    proc = _run_unit_tests(tmp_path, rules, [case])
    assert proc.returncode == 0, proc.stdout + proc.stderr
