"""``dpvr experiment transfer``: public pre-training, then a tiny private AUC fine-tuning run."""

import json

import pytest

from dpvr.cli import main
from dpvr_lab.experiments import transfer


def test_public_and_private_parts_are_disjoint():
    split = transfer._split("transfer-heavy-tailed", seed=0)
    assert set(split.public[1].tolist()) == set(range(transfer.PUBLIC_CLASSES))
    assert set(split.private.train[1].tolist()) == {0, 1}
    public_rows = {tuple(r) for r in split.public[0].tolist()}
    assert not public_rows & {tuple(r) for r in split.private.train[0].tolist()}


@pytest.mark.slow  # an experiment end to end
def test_transfer_experiment_runs(tmp_path, capsys):
    argv = ["experiment", "transfer", "--quick", "--seeds", "1", "--epochs", "1", "--pretrain-epochs", "2"]
    assert main([*argv, "--epsilon", "2", "--dataset", "transfer-imbalanced", "--out", str(tmp_path)]) == 0
    assert "PrivateDiff" in capsys.readouterr().out
    doc = json.loads((tmp_path / "transfer.json").read_text())
    assert {r["method"] for r in doc["records"]} == {"non-private", "DP-SGDA", "PrivateDiff"}
    assert "declared range [0, 16]" in doc["config"]["preprocessing"]
    for record in doc["records"]:
        assert "test_auc" in record["metrics"] and not {"train_auc", "grad_norm"} & set(record["metrics"])
        diagnostics = record["metrics"]["diagnostics"]
        assert diagnostics["private"] is False and {"train_auc", "grad_norm"} <= set(diagnostics)
        if record["method"] != "non-private":
            assert 0 < record["spent_epsilon"] <= 2.0 * (1 + 1e-6)
