import json

import pytest

from dpvr.cli import main


@pytest.mark.slow  # an experiment end to end
def test_last_iterate_experiment_end_to_end(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(
        [
            "experiment",
            "last-iterate",
            "--epochs",
            "1",
            "--seeds",
            "1",
            "--epsilon",
            "2",
            "--out",
            str(out),
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    assert code == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["experiment"] == "last-iterate" and set(doc) == {"experiment", "config", "versions", "records"}
    methods = {r["method"] for r in doc["records"]}
    assert methods == {"composition", "last-iterate (clipped)", "last-iterate (Lipschitz)"}
    assert doc["config"]["preprocessing"].endswith("each record scaled to unit L2 norm (a per-record map)")
    for r in doc["records"]:
        assert 0 < r["spent_epsilon"] <= 2.0 * (1 + 1e-6)
        assert 0.0 <= r["metrics"]["test_accuracy"] <= 1.0
        assert set(r["metrics"]["diagnostics"]) == {"private", "train_accuracy"}
        assert r["metrics"]["diagnostics"]["private"] is False and "train_accuracy" not in r["metrics"]
    assert (out / "last-iterate.png").stat().st_size > 0
    assert "test accuracy" in capsys.readouterr().out
