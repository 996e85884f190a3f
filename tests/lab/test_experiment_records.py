"""The one record shape of the experiments: training-set metrics under ``metrics["diagnostics"]``, flagged
``"private": false`` and labelled so wherever they are shown."""

import csv
import json

import pytest

from dpvr.cli.experiment import parse
from dpvr_lab.experiments import phased
from dpvr_lab.experiments.common import DIAGNOSTIC_NOTE, diagnostic, metric, record_metrics


def test_record_metrics_keep_training_set_metrics_apart():
    values = {"test_loss": 0.5, "train_loss": 0.25, "lr": 0.1}
    curves = {"test_loss": [1.0, 0.5], "train_loss": [1.0, 0.25]}
    metrics = record_metrics(values, ("train_loss",), curves)
    assert metrics == {
        "test_loss": 0.5,
        "lr": 0.1,
        "curves": {"test_loss": [1.0, 0.5]},
        "diagnostics": {"private": False, "train_loss": 0.25, "curves": {"train_loss": [1.0, 0.25]}},
    }
    assert metric(metrics, "train_loss") == 0.25 and metric(metrics, "test_loss") == 0.5
    assert record_metrics({"mmd2": 0.1}, ()) == {"mmd2": 0.1}  # nothing measured on private data
    assert diagnostic("train loss") == "train loss (diagnostic, not private)"
    assert DIAGNOSTIC_NOTE.startswith("(diagnostic, not private): measured on the private training data")


@pytest.mark.slow  # an experiment end to end
def test_phased_records_mark_every_metric_a_diagnostic(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(phased, "_SIZES", {name: ((64,), ()) for name in phased._SIZES})
    doc = phased.run(parse("phased", ["--quick", "--seeds", "1", "--epsilon", "2", "--out", str(tmp_path)]))
    assert doc["config"]["preprocessing"].startswith("breast_cancer: features standardised")
    for record in json.loads((tmp_path / "phased.json").read_text())["records"]:
        assert set(record["metrics"]) == {"n", "diagnostics"}
        diagnostics = record["metrics"]["diagnostics"]
        assert diagnostics["private"] is False and diagnostics["grad_evals"] > 0
        assert {"excess_risk", "duality_gap"} & set(diagnostics)
    with open(tmp_path / "phased.csv") as f:
        header = next(csv.reader(f))
    assert {"diagnostics.private", "diagnostics.grad_evals", "diagnostics.grad_evals_per_n"} <= set(header)
    printed = capsys.readouterr().out
    assert diagnostic("grad evals / n") in printed and DIAGNOSTIC_NOTE in printed
