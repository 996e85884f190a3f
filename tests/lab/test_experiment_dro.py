import json

import pytest

from dpvr.cli import main
from dpvr_lab.experiments import dro

PRIVATE = {"DP-SGDA", "PrivateDiff", "DP-SGD-dual", "Double-SPIDER", "Recursive-SPIDER"}


@pytest.mark.slow  # an experiment end to end (a minute)
def test_dro_experiment_end_to_end(tmp_path, capsys):
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
    noiseless = {dro.NOISELESS_LABEL.format(m) for m in PRIVATE}
    assert methods == {"non-private", "non-private-penalised"} | PRIVATE | noiseless
    assert "declared range [0, 16]" in doc["config"]["preprocessing"]
    assert doc["config"]["batch_size"] == 128
    for r in doc["records"]:
        assert set(r["metrics"]) >= {"test_accuracy", "worst_class_accuracy", "lr", "diagnostics"}
        assert r["metrics"]["lr"] in dro.LRS[r["method"].removesuffix(" (noiseless)")]
        curves = r["metrics"]["diagnostics"]["curves"]
        assert r["metrics"]["diagnostics"] == {
            "private": False,
            "grad_norm": curves["grad_norm"][-1],
            "train_objective": curves["train_objective"][-1],
            "curves": {"grad_norm": curves["grad_norm"], "train_objective": curves["train_objective"]},
        }
        assert "grad_norm" not in r["metrics"] and "grad_norm" not in r["metrics"]["curves"]
        if r["epsilon"] is not None:
            assert 0 < r["spent_epsilon"] <= 5.0 * (1 + 1e-6)
        else:  # the references and the noiseless rows are not private runs
            assert r["spent_epsilon"] is None and r["delta"] is None
        if r["method"] in noiseless:
            assert set(r["metrics"]["noise_multipliers"].values()) == {dro.NOISELESS}
        if r["method"] in PRIVATE:
            z, scales = r["metrics"]["noise_multipliers"], r["metrics"]["noise_scales"]
            assert set(z) == set(scales) and all(v > 0 for v in z.values())
    assert list(out.glob("*.png"))
    printed = capsys.readouterr().out
    for challenger in ("Double-SPIDER", "Recursive-SPIDER"):
        assert f"{challenger} > DP-SGDA" in printed
    assert "Noise per release" in printed


def test_selection_prefers_the_lowest_finite_objective():
    def run(lr, objective):
        return dro._Run(lr, [{"train_objective": objective}])

    runs = [run(0.1, 0.7), run(0.5, float("nan")), run(2.0, 0.4)]
    assert min(runs, key=lambda r: r.score).lr == 2.0
    assert run(8.0, float("inf")).score == float("inf")
