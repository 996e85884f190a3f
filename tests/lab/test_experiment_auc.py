"""``dpvr experiment auc``: a tiny run through the command line writes the documented result shape."""

import csv
import json

import pytest

from dpvr.cli import main


@pytest.mark.slow  # an experiment end to end (the private search: a minute and more)
def test_auc_experiment_runs_and_records_the_spent_epsilon(tmp_path, capsys):
    argv = ["experiment", "auc", "--quick", "--seeds", "1", "--epochs", "1", "--epsilon", "2"]
    assert main([*argv, "--dataset", "digits-imbalanced", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "PrivateDiff" in printed and "train AUC (diagnostic, not private)" in printed
    assert "tuned on the private training data" in printed and "not covered" in printed
    doc = json.loads((tmp_path / "auc.json").read_text())
    methods = {r["method"] for r in doc["records"]}
    assert methods == {"non-private", "DP-SGDA", "PrivateDiff"}
    assert "declared range [0, 16]" in doc["config"]["preprocessing"]
    for record in doc["records"]:
        assert record["dataset"] == "digits-imbalanced"
        metrics = record["metrics"]
        assert {"test_auc", "lr", "lr_y"} <= set(metrics) and set(metrics["curves"]) == {"test_auc"}
        assert not {"train_auc", "grad_norm"} & set(metrics)
        diagnostics = metrics["diagnostics"]
        assert diagnostics["private"] is False and {"train_auc", "grad_norm"} <= set(diagnostics)
        assert set(diagnostics["curves"]) == {"train_auc", "grad_norm"}
        if record["method"] != "non-private":
            assert 0 < record["spent_epsilon"] <= 2.0 * (1 + 1e-6)
            assert record["delta"] < 1e-2
    assert (tmp_path / "auc_digits-imbalanced_eps2.png").exists()
    with open(tmp_path / "auc.csv") as f:
        header = next(csv.reader(f))
    assert {"test_auc", "diagnostics.private", "diagnostics.train_auc", "diagnostics.grad_norm"} <= {*header}


@pytest.mark.slow  # an experiment end to end (the private search: a minute and more)
def test_private_tuning_accounts_the_learning_rate_search(tmp_path, capsys):
    argv = ["experiment", "auc", "--quick", "--seeds", "1", "--epochs", "1", "--epsilon", "2",
            "--private-tuning"]
    assert main([*argv, "--dataset", "digits-imbalanced", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "selected inside the budget by a private search" in printed and "not covered" not in printed
    doc = json.loads((tmp_path / "auc.json").read_text())
    assert doc["config"]["hyperparameter_tuning_accounted"] is True
    private = [r for r in doc["records"] if r["method"] != "non-private"]
    assert {r["method"] for r in private} == {"DP-SGDA", "PrivateDiff"}
    for record in private:
        metrics = record["metrics"]
        assert metrics["hyperparameter_tuning_accounted"] is True
        # the whole search spends the budget; one of its trials spends less
        assert 0 < metrics["per_trial_epsilon"] < record["spent_epsilon"] <= 2.0
        assert (metrics["lr"], metrics["lr_y"]) in [(lr, 0.2) for lr in (0.02, 0.2, 2.0)]


@pytest.mark.slow  # an experiment end to end (the private search: a minute and more)
def test_y_release_output_runs_as_its_own_method(tmp_path, capsys):
    argv = ["experiment", "auc", "--quick", "--seeds", "1", "--epochs", "1", "--epsilon", "2",
            "--y-release", "ascent", "output"]
    assert main([*argv, "--dataset", "digits-imbalanced", "--out", str(tmp_path)]) == 0
    assert "PrivateDiff (y output)" in capsys.readouterr().out
    doc = json.loads((tmp_path / "auc.json").read_text())
    assert doc["config"]["y_release"] == ["ascent", "output"]
    records = {r["method"]: r for r in doc["records"]}
    assert set(records) == {"non-private", "DP-SGDA", "PrivateDiff", "PrivateDiff (y output)"}
    output = records["PrivateDiff (y output)"]
    assert 0 < output["spent_epsilon"] <= 2.0 * (1 + 1e-6)
    # its y-step is the inner solver's 1/mu (AUC-M v1 at the imbalanced ratio 0.1), not a tuned one
    assert output["metrics"]["lr_y"] == 1 / (2 * 0.1 * 0.9)
