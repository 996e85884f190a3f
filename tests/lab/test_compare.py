"""dpvr_lab.experiments.compare, ``dpvr compare``: seeds paired, p-values equal to scipy's paired t-test."""

import json
import math

import numpy as np
import pytest
from scipy import stats

from dpvr.cli import main
from dpvr.results import Record, document, write_json
from dpvr_lab.experiments import compare


def _records(method_values, baseline_values, dataset="d", epsilon=1.0):
    out = []
    for seed, (m, b) in enumerate(zip(method_values, baseline_values)):
        out.append(Record("M", dataset, epsilon, 1e-5, seed, epsilon, {"acc": m, "diagnostics": {"norm": m}}))
        out.append(Record("B", dataset, epsilon, 1e-5, seed, epsilon, {"acc": b, "diagnostics": {"norm": b}}))
    return out


def _dicts(records):
    return document("x", {}, records)["records"]


def test_paired_p_value_wins_and_difference_match_scipy():
    m, b = [0.80, 0.75, 0.90, 0.70, 0.85], [0.78, 0.70, 0.91, 0.60, 0.80]
    (cell,) = compare.compare(_dicts(_records(m, b)), "M", "B", "acc")
    assert cell.seeds == (0, 1, 2, 3, 4)
    assert cell.wins == 4
    assert cell.difference == pytest.approx(np.mean(np.subtract(m, b)))
    assert cell.p_value == pytest.approx(stats.ttest_rel(m, b, alternative="greater").pvalue)
    # a loss: lower is better, so the same numbers favour the baseline
    (loss,) = compare.compare(_dicts(_records(m, b)), "M", "B", "acc", higher_is_better=False)
    assert loss.wins == 1
    assert loss.p_value == pytest.approx(stats.ttest_rel(m, b, alternative="less").pvalue)


def test_unpaired_seeds_are_left_out_and_cells_split_by_dataset_and_epsilon():
    records = _records([0.9, 0.8], [0.5, 0.3]) + _records([0.7], [0.6], epsilon=3.0)
    records.append(Record("M", "d", 1.0, 1e-5, 9, 1.0, {"acc": 0.0}))  # no baseline at seed 9
    records.append(Record("M", "d", None, None, 0, None, {"acc": 1.0}))  # non-private: not a cell
    cells = compare.compare(_dicts(records), "M", "B", "acc")
    assert [(c.epsilon, c.seeds) for c in cells] == [(1.0, (0, 1)), (3.0, (0,))]
    assert math.isnan(cells[1].p_value)  # one seed: no test
    assert "n/a" in compare.table(cells)


def test_diagnostic_metrics_are_found_and_unknown_names_refused():
    (cell,) = compare.compare(_dicts(_records([1.0, 2.5], [0.0, 0.5])), "M", "B", "norm")
    assert cell.method_values == (1.0, 2.5) and cell.baseline_values == (0.0, 0.5)
    with pytest.raises(ValueError, match="metric 'auc' not in the records"):
        compare.compare(_dicts(_records([1.0], [0.0])), "M", "B", "auc")
    with pytest.raises(ValueError, match="no private records of method 'C'"):
        compare.compare(_dicts(_records([1.0], [0.0])), "C", "B", "acc")


@pytest.mark.slow  # draws a plot (matplotlib)
def test_cli_prints_the_table_and_plots(tmp_path, capsys):
    path = tmp_path / "r.json"
    write_json(path, document("x", {}, _records([0.8, 0.9, 0.7], [0.6, 0.7, 0.75])))
    png = tmp_path / "c.png"
    assert main(["compare", str(path), "--method", "M", "--baseline", "B", "--metric", "acc",
                 "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "| d " in out and "2/3" in out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_reports_an_unreadable_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"no": "records"}))
    assert main(["compare", str(bad), "--method", "M", "--baseline", "B", "--metric", "acc"]) == 2
    assert "not a dpvr result document" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "missing.json"), "--method", "M", "--baseline", "B",
                 "--metric", "acc"]) == 2
    assert "cannot read a result document" in capsys.readouterr().err
