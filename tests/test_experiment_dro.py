import json

from dpvr.cli import main


def test_dro_experiment_end_to_end(tmp_path):
    out = tmp_path / "out"
    code = main(
        [
            "experiment",
            "dro",
            "--quick",
            "--epochs",
            "1",
            "--seeds",
            "1",
            "--epsilon",
            "5",
            "--out",
            str(out),
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    assert code == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    methods = {r["method"] for r in doc["records"]}
    assert methods == {
        "non-private",
        "DP-SGDA",
        "PrivateDiff",
        "DP-SGD-dual",
        "Double-SPIDER",
        "Recursive-SPIDER",
    }
    assert "declared range [0, 16]" in doc["config"]["preprocessing"]
    for r in doc["records"]:
        assert set(r["metrics"]) >= {"test_accuracy", "worst_class_accuracy", "diagnostics"}
        assert r["metrics"]["diagnostics"] == {
            "private": False,
            "grad_norm": r["metrics"]["diagnostics"]["curves"]["grad_norm"][-1],
            "curves": {"grad_norm": r["metrics"]["diagnostics"]["curves"]["grad_norm"]},
        }
        assert "grad_norm" not in r["metrics"] and "grad_norm" not in r["metrics"]["curves"]
        if r["method"] != "non-private":
            assert 0 < r["spent_epsilon"] <= 5.0 * (1 + 1e-6)
    assert list(out.glob("*.png"))
