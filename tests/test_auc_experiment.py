"""``dpvr experiment auc``: a tiny run through the command line writes the documented result shape."""

import json

from dpvr.cli import main


def test_auc_experiment_runs_and_records_the_spent_epsilon(tmp_path, capsys):
    argv = ["experiment", "auc", "--quick", "--seeds", "1", "--epochs", "1", "--epsilon", "2"]
    assert main([*argv, "--dataset", "digits-imbalanced", "--out", str(tmp_path)]) == 0
    assert "PrivateDiff" in capsys.readouterr().out
    doc = json.loads((tmp_path / "auc.json").read_text())
    methods = {r["method"] for r in doc["records"]}
    assert methods == {"non-private", "DP-SGDA", "PrivateDiff"}
    for record in doc["records"]:
        assert record["dataset"] == "digits-imbalanced"
        assert {"test_auc", "train_auc", "grad_norm"} <= set(record["metrics"])
        if record["method"] != "non-private":
            assert 0 < record["spent_epsilon"] <= 2.0 * (1 + 1e-6)
            assert record["delta"] < 1e-2
    assert (tmp_path / "auc_digits-imbalanced_eps2.png").exists()
