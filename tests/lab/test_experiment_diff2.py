"""``dpvr experiment diff2``: result shape, spent epsilon, files, command line, and its pooled shards."""

import csv
import dataclasses
import json
import math

import pytest
import torch

import dpvr
from dpvr.algorithms import DIFF2
from dpvr.cli import main
from dpvr.cli.experiment import parse
from dpvr.optim import PrivacyConfig, RuntimeConfig
from dpvr_lab.experiments import diff2
from dpvr_lab.experiments.common import metric, one_sided_ttest

RECORD_KEYS = {"method", "dataset", "epsilon", "delta", "seed", "spent_epsilon", "metrics"}


@pytest.mark.slow  # an experiment end to end
def test_tiny_run_gives_every_method_its_records_and_files(tmp_path):
    args = parse(
        "diff2",
        [
            "--quick",
            "--rounds",
            "12",
            "--seeds",
            "2",
            "--dataset",
            "diabetes",
            "--epsilon",
            "3",
            "--out",
            str(tmp_path),
        ],
    )
    doc = diff2.run(args)
    assert set(doc) == {"experiment", "config", "versions", "records"}
    assert doc["experiment"] == "diff2" and doc["config"]["protocols"]["diabetes"]["rounds"] == 12
    assert doc["config"]["preprocessing"].startswith("features standardised")
    records = doc["records"]
    assert all(set(r) == RECORD_KEYS for r in records)
    assert sorted((r["method"], r["seed"]) for r in records) == sorted(
        (m, s) for m in diff2.METHODS for s in (0, 1)
    )
    for r in records:
        diagnostics = r["metrics"]["diagnostics"]
        assert diagnostics["private"] is False
        assert set(diagnostics) == {"private", *diff2.DIAGNOSTICS}
        assert not set(diff2.DIAGNOSTICS) & set(r["metrics"])  # training-set metrics only in there
        assert all(math.isfinite(metric(r["metrics"], m)) for m in diff2.METRICS), r
        if r["method"] == "GD":
            assert r["spent_epsilon"] is None and r["epsilon"] is None
        else:
            assert r["epsilon"] == 3.0 and r["delta"] == diff2.DELTA
            assert 0 < r["spent_epsilon"] <= 3.0 * (1 + 1e-6)
    with open(tmp_path / "diff2.json") as f:
        assert json.load(f)["records"] == json.loads(json.dumps(records))
    with open(tmp_path / "diff2.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(records) and "selected.train_loss.lr" in rows[0]
    assert rows[0]["diagnostics.private"] == "False" and "diagnostics.train_loss" in rows[0]
    assert "train_loss" not in rows[0]
    png = tmp_path / "diff2_diabetes_eps3.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # an experiment end to end
def test_command_line_with_the_paper_calibration(tmp_path, capsys):
    out = tmp_path / "result.json"
    code = main(
        [
            "experiment",
            "diff2",
            "--quick",
            "--rounds",
            "6",
            "--seeds",
            "1",
            "--dataset",
            "breast_cancer",
            "--epsilon",
            "5",
            "--calibration",
            "paper",
            "--out",
            str(tmp_path),
            "--json",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "DIFF2-GD" in printed and "train loss (diagnostic, not private)" in printed
    records = json.loads(out.read_text())["records"]
    for r in records:
        assert 0 <= r["metrics"]["test_accuracy"] <= 1
        if r["method"] in ("DP-GD", "DIFF2-GD"):  # Proposition 4.1 is loose: it spends less than its target
            assert 0 < r["spent_epsilon"] < 5.0


@pytest.mark.slow  # an experiment end to end
def test_private_tuning_records_each_methods_whole_search(tmp_path, capsys):
    """``--private-tuning``: every private method's record comes from its own search over (C1, C2, eta) at
    the grid's smallest restart period, and spends the whole search's epsilon, at most the target."""
    options = ["--quick", "--rounds", "6", "--seeds", "1", "--dataset", "diabetes", "--epsilon", "3"]
    doc = diff2.run(parse("diff2", [*options, "--private-tuning", "--out", str(tmp_path)]))
    printed = capsys.readouterr().out
    assert "selected inside the budget by a private search" in printed and "not covered" not in printed
    assert doc["config"]["hyperparameter_tuning_accounted"] is True
    protocol = dataclasses.replace(diff2.QUICK, rounds=6)
    assert {r["method"] for r in doc["records"]} == set(diff2.METHODS)
    for r in doc["records"]:
        metrics = r["metrics"]
        assert all(math.isfinite(metric(metrics, m)) for m in diff2.METRICS), r
        if r["method"] == "GD":  # non-private: nothing to account
            assert r["spent_epsilon"] is None and "hyperparameter_tuning_accounted" not in metrics
            continue
        assert metrics["hyperparameter_tuning_accounted"] is True
        assert 0 < metrics["per_trial_epsilon"] < r["spent_epsilon"] <= 3.0
        grid = diff2._private_grid(r["method"], protocol)
        assert metrics["trials_mean"] == len(grid)
        selected = metrics["selected"]
        assert selected["train_loss"] == selected["grad_norm_sq"] and selected["train_loss"] in grid
        if r["method"] != "DP-GD":
            assert selected["train_loss"]["restart"] == protocol.restarts[0]


@pytest.mark.slow  # an experiment end to end
def test_private_tuning_on_client_processes_selects_what_the_simulation_does(tmp_path):
    """Each trial of a search enters the backend's context: two client processes release what the
    in-process clients do, so the searches draw, score and select alike."""
    records = {}
    for backend in ("local", "torch-distributed"):
        options = ["--quick", "--rounds", "4", "--seeds", "1", "--dataset", "diabetes", "--epsilon", "3"]
        options += ["--private-tuning", "--clients", "2", "--backend", backend]
        options += ["--out", str(tmp_path / backend)]
        records[backend] = diff2.run(parse("diff2", options))["records"]
    assert records["torch-distributed"] == records["local"]


def test_unknown_experiment_and_missing_data_dir_are_errors(capsys):
    with pytest.raises(SystemExit):
        main(["experiment", "nope"])
    assert main(["experiment", "diff2", "--quick", "--dataset", "covtype"]) == 2
    assert "--data-dir" in capsys.readouterr().err


@pytest.mark.slow  # an experiment end to end
def test_distributed_backend_writes_the_records_of_the_local_simulation(tmp_path):
    """Three client processes and this process aggregating release what the in-process clients do."""
    docs = {}
    for backend in ("pooled", "local", "torch-distributed"):
        options = ["--quick", "--rounds", "6", "--seeds", "1", "--dataset", "diabetes", "--epsilon", "3"]
        options += ["--clients", "3", "--backend", backend, "--out", str(tmp_path / backend)]
        docs[backend] = diff2.run(parse("diff2", options))
        assert docs[backend]["config"]["backend"] == backend and docs[backend]["config"]["clients"] == 3
    local, remote, pooled = (docs[b]["records"] for b in ("local", "torch-distributed", "pooled"))
    assert remote == local
    # The pooled shard runs the same algorithm (test_pooled_equal_shards_run_the_same_algorithm) with noise
    # of its own: each noise key binds the run's settings, so only the noise-free GD reference coincides.
    assert [(r["method"], r["seed"]) for r in pooled] == [(r["method"], r["seed"]) for r in local]
    for a, b in zip(pooled, local):
        if b["method"] == "GD":
            assert a["metrics"] == b["metrics"]
        else:
            assert 0 < a["spent_epsilon"] <= 3.0 * (1 + 1e-6)


def test_clients_must_be_positive(capsys):
    assert main(["experiment", "diff2", "--quick", "--clients", "0"]) == 2
    assert "--clients must be at least 1" in capsys.readouterr().err


def _equal_shards_and_pooled(noise: dict[str, object]) -> list[DIFF2]:
    """DIFF2 on four equal client shards and on their pooled records, with the same options."""
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(40, 3, generator=g, dtype=torch.float64),
        torch.randn(40, 1, generator=g, dtype=torch.float64),
    )
    clients = [(x[i::4], y[i::4]) for i in range(4)]
    options = dict(lr=0.2, steps=7, restart=3, clip={"restart": 0.5, "difference": 1.0}, **noise)
    runs = []
    for shards in (clients, [(torch.cat([c[0] for c in clients]), torch.cat([c[1] for c in clients]))]):
        model = diff2._model(3, 1, seed=0)
        runtime = RuntimeConfig(generator=dpvr.NoiseGenerator(5, reproducible=True))
        alg = DIFF2(model, diff2.sample_loss, shards, **options, runtime=runtime)
        alg.run(progress=False)
        runs.append(alg)
    return runs


def test_pooled_equal_shards_run_the_same_algorithm():
    """The experiment runs the GD-routine methods on the pooled shards: the same iterates without noise (the
    two runs never share noise: their keys bind different settings) and the same accounting."""
    sharded, pooled = _equal_shards_and_pooled({"noise": dpvr.PaperSigmas(restart=1e-100, difference=1e-100)})
    for a, b in zip(sharded.params, pooled.params):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    sharded, pooled = _equal_shards_and_pooled({"privacy": PrivacyConfig(epsilon=3.0)})
    assert sharded.privacy_spent().epsilon == pytest.approx(pooled.privacy_spent().epsilon, rel=1e-12)


def test_one_sided_paired_t_test():
    lower, higher = [1.0, 2.0, 3.0, 4.0], [1.5, 2.4, 3.6, 4.4]
    assert one_sided_ttest(lower, higher, paired=True) < 0.01
    assert one_sided_ttest(higher, lower, paired=True) > 0.99
    assert math.isnan(one_sided_ttest([1.0], [2.0], paired=True))
