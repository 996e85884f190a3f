"""``dpvr account`` and ``dpvr calibrate``: output shape, agreement with the library, plots and errors."""

import argparse
import json
import re

import numpy as np
import pytest

from dpvr.algorithms import CyclicDPSGDPlan, DIFF2Plan, DPSGDPlan
from dpvr.cli import account as account_cli
from dpvr.cli import build_parser
from dpvr.privacy import account, calibrate


def _parse(command: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dpvr")
    account_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(command.split())


def _run(capsys, command: str) -> str:
    args = _parse(command)
    assert args.run(args) == 0
    return capsys.readouterr().out


def _json(capsys, command: str) -> dict:
    return json.loads(_run(capsys, command + " --json"))


DP_SGD = "account dp-sgd --sample-rate 0.01 --noise-multiplier 1.1 --steps 1000 --delta 1e-5"


def test_account_dp_sgd_json(capsys):
    out = _json(capsys, DP_SGD + " --accountant rdp")
    assert {"epsilon", "delta", "accountant", "streams"} <= set(out)
    assert out["epsilon"] == pytest.approx(account(DPSGDPlan(1000, "poisson", 0.01)(1.1), 1e-5).epsilon)
    assert out["accountant"] == "rdp" and out["neighbouring"] == "add-remove"
    assert out["streams"] == [{"name": "gradient", "releases": 1000, "noise_multiplier": 1.1, "share": 1.0}]
    pld = _json(capsys, DP_SGD + " --accountant pld --neighbouring replace-one")
    assert pld["accountant"] == "pld" and pld["order"] is None and pld["epsilon"] > out["epsilon"]
    # By default the tightest accountant that prices the run, as the algorithms choose: PLD here.
    tightest = _json(capsys, DP_SGD)
    plan = DPSGDPlan(1000, "poisson", 0.01)
    assert tightest["accountant"] == "pld" and tightest["epsilon"] < out["epsilon"]
    assert tightest["epsilon"] == pytest.approx(account(plan(1.1), 1e-5, accountant="pld").epsilon, rel=1e-12)
    # ... and RDP where PLD cannot price a release (the last-iterate bound is an RDP curve).
    last = "account last-iterate --dataset-size 100 --batch-size 10 --epochs 2 --lr 1e-3 --clip 1 --sigma 1 "
    last += "--weak-convexity 1 --smoothness 1 --no-clipping --delta 1e-5"
    assert _json(capsys, last)["accountant"] == "rdp"


def test_calibrate_diff2_paper_and_tight(capsys):
    common = (
        "calibrate diff2 --dataset-size 1651 --clients 10 --steps 2000 --restart 20 --epsilon 3 --delta 1e-5"
    )
    paper = _json(capsys, common + " --calibration paper --u 1.25")
    plan = DIFF2Plan(1651, 10, 2000, 20)
    assert paper["noise_multiplier"] == pytest.approx(calibrate(plan, 3, 1e-5, calibration="paper", u=1.25))
    sigma = {s["name"]: s["sigma"] for s in paper["streams"]}
    assert sigma["restart"] == pytest.approx(0.00235, abs=5e-6) and paper["spent_epsilon"] < 3
    tight = _json(capsys, common + " --shares restart=0.8,difference=0.2")
    assert tight["spent_epsilon"] == pytest.approx(3, rel=1e-3)
    shares = {s["name"]: s["share"] for s in tight["streams"]}
    assert shares == pytest.approx({"restart": 0.8, "difference": 0.2})


def test_calibrate_dp_sgd_fixed_size_batches(capsys):
    """For fixed-size batches the batch size is what the user knows; the relation defaults to replace-one,
    as DPSGD(sampling="wor") does (add/remove cannot account such batches)."""
    out = _json(
        capsys,
        "calibrate dp-sgd --sampling wor --batch-size 256 --dataset-size 60000 --steps 1000 --epsilon 2 "
        "--delta 1e-5",
    )
    assert out["neighbouring"] == "replace-one" and out["accountant"] == "pld"
    plan = DPSGDPlan(1000, "wor", batch_size=256, dataset_size=60_000, neighbouring="replace-one")
    assert out["noise_multiplier"] == pytest.approx(calibrate(plan, 2, 1e-5, accountant="pld")["gradient"])
    assert out["spent_epsilon"] <= 2 and out["spent_epsilon"] == pytest.approx(2, rel=1e-3)
    poisson = _json(capsys, "calibrate dp-sgd --batch-size 256 --dataset-size 60000 --steps 1000 --epsilon 2")
    assert poisson["neighbouring"] == "add-remove" and poisson["delta"] == 1e-5  # the algorithms' delta
    assert poisson["noise_multiplier"] == pytest.approx(
        calibrate(DPSGDPlan(1000, "poisson", 256 / 60_000), 2, 1e-5, accountant="pld")["gradient"]
    )


def test_table_names_the_paper_sigmas(capsys):
    out = _run(
        capsys,
        "account private-diff --dataset-size 1000 --batch-size 50 --steps 10 --restart 5 --sigma-x1 0.1 "
        "--sigma-x2 0.2 --sigma-y 0.3",
    )
    assert re.search(r"checkpoint .* sigma_x1 = 0\.1 ", out) and re.search(r"\by .* sigma_y = 0\.3 ", out)
    rows = _json(capsys, "calibrate diff2 --dataset-size 100 --clients 2 --steps 10 --restart 2 --epsilon 1")[
        "streams"
    ]
    assert [r["sigma_name"] for r in rows] == ["sigma1", "sigma2"]


def _parsers(parser: argparse.ArgumentParser, name: str = "dpvr"):
    """Every parser of the command line but the experiments' own (``dpvr experiment NAME``), by name."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name != "dpvr experiment":
            for sub, child in action.choices.items():
                yield from _parsers(child, f"{name} {sub}")


def test_help_is_plain_text_with_every_flag_described_and_defaults_shown(capsys):
    parsers = dict(_parsers(build_parser()))
    assert {"dpvr account dp-sgd", "dpvr calibrate last-iterate", "dpvr audit", "dpvr bench"} <= set(parsers)
    for name, parser in parsers.items():
        text = parser.format_help()
        assert not re.search(r"``|:(class|func|mod|meth|data):", text), name
        for action in parser._actions:
            assert action.help, f"{name}: {action.dest} has no help"
            switch = action.nargs == 0  # off unless given: nothing to show
            shown = not switch and not action.required and action.default not in (None, argparse.SUPPRESS)
            assert not shown or "(default: " in action.help, f"{name}: {action.dest} hides its default"
    # defaults are the Python API's: the algorithm's relation, DIFF2's u, the phased class's Gaussian
    dp_sgd = {a.dest: a.help for a in parsers["dpvr account dp-sgd"]._actions}
    assert dp_sgd["neighbouring"].endswith(
        "(default: add-remove with --sampling poisson or random-allocation, else replace-one)"
    )
    assert _parse("calibrate phased --setting sc --epsilon 1").gaussian == "analytic"
    assert _parse("calibrate diff2 --dataset-size 10 --clients 2 --steps 4 --restart 2 --epsilon 1").u == 1.25
    assert _parse("account dp-gd --steps 3").neighbouring is None  # the plan's own: replace-one


ALGORITHMS = {
    "dp-sgd": "--dataset-size 10000 --batch-size 100 --steps 300",
    "dp-gd": "--steps 100",
    "diff2": "--dataset-size 5000 --clients 4 --steps 40 --restart 10 --local-steps 3 --local-batch 20",
    "dp-sgda": "--dataset-size 10000 --batch-size 100 --steps 200",
    "private-diff": "--dataset-size 10000 --batch-size 100 --steps 50 --restart 5 --y-steps 2",
    "double-spider": "--dataset-size 10000 --steps 300 --restart 30 --batch-sizes 10000,64,10000,64",
    "recursive-spider": "--dataset-size 10000 --steps 300 --restart 30 --batch-sizes 10000,64,10000,64",
    "phased": "--setting c-c",
    "last-iterate": "--dataset-size 1000 --batch-size 10 --epochs 5 --lr 1e-3 --clip 1 --weak-convexity 1 "
    "--smoothness 1 --no-clipping",
}

NOISE_FLAGS = {
    "dp-sgd": {"gradient": "--noise-multiplier"},
    "dp-gd": {"gradient": "--noise-multiplier"},
    "diff2": {"restart": "--sigma1", "difference": "--sigma2", "local": "--sigma3"},
    "dp-sgda": {"x": "--sigma-x", "y": "--sigma-y"},
    "private-diff": {"checkpoint": "--sigma-x1", "difference": "--sigma-x2", "y": "--sigma-y"},
    "phased": {"x": "--sigma-x", "y": "--sigma-y"},
    "last-iterate": {"gradient": "--sigma"},
}


def _noise_flags(name: str, streams: list) -> str:
    """The noise flags that give back the calibrated noise (in each algorithm's own units)."""
    if name.endswith("spider"):
        return "--noise-multipliers " + ",".join(repr(s["noise_multiplier"]) for s in streams)
    return " ".join(
        f"{NOISE_FLAGS[name][s['name']]} {s.get('sigma', s['noise_multiplier'])!r}" for s in streams
    )


# The default run leaves out (to the slow run) the algorithms whose `dpvr account` flags are also checked
# against a run of the algorithm itself: test_minimax (dp-sgda, private-diff) and test_spider (the SPIDERs).
CHECKED_ELSEWHERE = ("dp-sgda", "private-diff", "double-spider", "recursive-spider")


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in CHECKED_ELSEWHERE else n for n in ALGORITHMS],
)
def test_every_algorithm_calibrates_and_accounts(capsys, name):
    calibrated = _json(capsys, f"calibrate {name} {ALGORITHMS[name]} --epsilon 1.5 --delta 1e-6")
    assert calibrated["spent_epsilon"] == pytest.approx(1.5, rel=1e-3)
    noise = _noise_flags(name, calibrated["streams"])
    accounted = _json(capsys, f"account {name} {ALGORITHMS[name]} {noise} --delta 1e-6")
    assert accounted["epsilon"] == pytest.approx(1.5, rel=1e-3)


def test_every_registry_algorithm_is_calibrated_and_accounted_here():
    from dpvr import registry

    assert sorted(ALGORITHMS) == sorted(registry.REGISTRY)


def test_table_and_plot(capsys, tmp_path):
    out = _run(
        capsys,
        "account diff2 --dataset-size 1651 --clients 10 --steps 2000 --restart 20 --sigma1 0.00235 "
        "--sigma2 0.02045 --delta 1e-5",
    )
    assert "epsilon" in out and "restart" in out and "difference" in out and "assumptions:" in out
    png = tmp_path / "figure1.png"
    out = _run(
        capsys,
        "account last-iterate --dataset-size 10000 --batch-size 10 --epochs 20 --lr 1e-5 "
        f"--clip 10 --sigma 1e-5 --weak-convexity 1 --smoothness 1 --no-clipping --delta 1e-5 --plot {png}",
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plan = CyclicDPSGDPlan(10_000, 10, 20_000, 1e-5, 10, 1, 1, clipping=False)
    assert f"{account(plan(1.0), 1e-5).epsilon:.6g}" in out


@pytest.mark.parametrize(
    ("command", "match"),
    [
        (
            "account diff2 --dataset-size 100 --clients 2 --steps 10 --restart 2 --sigma1 0.1 --delta 1e-5",
            "--sigma2",
        ),
        ("account dp-sgd --sample-rate 0.01 --noise-multiplier 1 --steps 10 --delta 2", "delta"),
        (
            "account dp-sgd --sample-rate 0.01 --noise-multiplier -1 --steps 10 --delta 1e-5",
            "noise multiplier",
        ),
        ("account dp-sgd --sample-rate 0 --noise-multiplier 1 --steps 10 --delta 1e-5", "sample_rate"),
        ("account dp-sgd --sample-rate 0.01 --noise-multiplier 1 --steps -3 --delta 1e-5", "steps"),
        (DP_SGD + " --neighbouring replace-one --accountant rdp", "Poisson"),
        (
            "calibrate double-spider --dataset-size 100 --steps 10 --restart 2 --batch-sizes 10,10,10,10 "
            "--epsilon 1 --delta 1e-5 --calibration paper",
            "closed-form",
        ),
        ("calibrate dp-sgd --sample-rate 0.01 --steps 10 --epsilon 0 --delta 1e-5", "epsilon"),
        (
            "account last-iterate --dataset-size 100 --batch-size 10 --epochs 2 --lr 1 --clip 1 --sigma 1 "
            "--weak-convexity 1 --smoothness 1 --bound last-iterate --delta 1e-5",
            "lr",
        ),
    ],
)
def test_errors_name_the_argument(command, match):
    args = _parse(command)
    with pytest.raises(ValueError, match=match):
        args.run(args)


def test_spend_curves_end_at_the_runs_epsilon_and_plot_for_every_command(capsys, tmp_path):
    from dpvr.algorithms import DPSGDPlan, epsilon_by_epoch
    from dpvr.privacy import spend_curves

    plan = DPSGDPlan(dataset_size=1000, batch_size=50, steps=40)
    curves = spend_curves(plan, {"gradient": 1.0}, 1e-5, [1, 10, 40])
    assert list(curves) == ["epsilon"]
    assert curves["epsilon"][-1] == pytest.approx(account(plan(1.0), 1e-5).epsilon, rel=1e-12)
    assert curves["epsilon"] == sorted(curves["epsilon"])
    cyclic = CyclicDPSGDPlan(10_000, 10, 20_000, 1e-5, 10, 1, 1, clipping=False)
    both = spend_curves(cyclic, {"gradient": 1e-5 * 1e4}, 1e-5, [1000, 20_000])  # a pass is 1000 steps
    by_epoch = epsilon_by_epoch(cyclic, 1e-5 * 1e4, 1e-5, [1, 20])
    np.testing.assert_allclose(both["last iterate (Kong & Ribero)"], by_epoch["last-iterate"], rtol=1e-12)
    np.testing.assert_allclose(both["composition of passes"], by_epoch["composition"], rtol=1e-12)
    png = tmp_path / "spend.png"
    _run(capsys, f"calibrate diff2 --dataset-size 1000 --clients 2 --steps 40 --restart 4 --epsilon 2 "
                 f"--delta 1e-5 --plot {png}")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- a full batch under add/remove: refused, on the command line as in the library -----------------------
# Each is a run whose releases include a full-batch mean divided by the data's own size (DIFF2's server
# rounds; DP-GD; a SPIDER stream whose batch is the dataset; DP-SGDA's full batch; PrivateDiff's output y,
# whose sensitivity shrinks with n). Under add/remove n is private, so the mean moves by up to 2C/(n+1), not
# the C/n such a plan would price: before the refusal, DIFF2's example below printed epsilon 2.94 under
# add-remove where the same rounds cost 6.57 under replace-one.
FULL_BATCH_RUNS = {
    "diff2": "diff2 --dataset-size 10000 --clients 1 --steps 50 --restart 5",
    "diff2-bvr": "diff2 --dataset-size 1000 --clients 2 --steps 10 --restart 5 --local-steps 2 "
    "--local-batch 10",
    "dp-sgd": "dp-sgd --sampling full --steps 10",
    "dp-gd": "dp-gd --steps 10",
    "double-spider": "double-spider --dataset-size 1000 --steps 10 --restart 5 --batch-sizes 1000,64,1000,64 "
    "--sampling poisson",
    "recursive-spider": "recursive-spider --dataset-size 1000 --steps 10 --restart 5 "
    "--batch-sizes 64,64,1000,64 --sampling poisson",
    "dp-sgda": "dp-sgda --dataset-size 100 --batch-size 100 --steps 10 --sampling full",
    "private-diff": "private-diff --dataset-size 1000 --batch-size 10 --steps 10 --restart 2 "
    "--sampling poisson --y-release output",
}
FULL_BATCH_NOISE = {
    "diff2": "--sigma1 1e-3 --sigma2 1e-3",
    "diff2-bvr": "--sigma1 1e-3 --sigma2 1e-3 --sigma3 1",
    "dp-sgd": "--noise-multiplier 1",
    "dp-gd": "--noise-multiplier 1",
    "double-spider": "--noise-multipliers 1,1,1,1",
    "recursive-spider": "--noise-multipliers 1,1,1,1,1",
    "dp-sgda": "--sigma-x 0.1 --sigma-y 0.1",
    "private-diff": "--sigma-x1 0.1 --sigma-x2 0.1 --sigma-y 0.1",
}


@pytest.mark.parametrize("command", ["account", "calibrate"])
@pytest.mark.parametrize("run", sorted(FULL_BATCH_RUNS))
def test_a_full_batch_plan_refuses_add_remove_on_the_command_line(capsys, command, run):
    tail = FULL_BATCH_NOISE[run] if command == "account" else "--epsilon 2"
    line = f"{command} {FULL_BATCH_RUNS[run]} {tail} --delta 1e-5"
    priced = _json(capsys, line + " --neighbouring replace-one")  # what the same run costs where n is public
    assert priced["neighbouring"] == "replace-one"
    from dpvr.cli import main

    assert main((line + " --neighbouring add-remove").split()) == 2
    err = capsys.readouterr().err
    assert f"dpvr {command}: error: neighbouring='add-remove'" in err and "'replace-one'" in err
    assert "size" in err and "private" in err


def test_diff2s_add_remove_price_was_below_its_replace_one_price():
    """The mechanism the command line used to price (a mean over a public n, sensitivity C/(nP)) against the
    one DIFF2 runs: replace-one is what the library's shard-size divisor costs, and the refused relation
    would have printed less than half of it."""
    from dpvr.privacy.mechanism import Mechanism

    plan = DIFF2Plan(10_000, 1, 50, 5)
    noise = {s: plan.noise_multiplier(1e-3, s) for s in plan.streams}
    replace_one = account(plan(noise), 1e-5, accountant="pld").epsilon
    assert replace_one == pytest.approx(6.573, abs=1e-3)
    unsound = account(Mechanism(plan(noise).streams, "add-remove"), 1e-5, accountant="pld").epsilon
    assert unsound == pytest.approx(2.94, abs=0.01)
    with pytest.raises(ValueError, match="neighbouring='add-remove'.*'restart', 'difference'"):
        DIFF2Plan(10_000, 1, 50, 5, neighbouring="add-remove")


def test_sampled_streams_keep_add_remove():
    """The refusal is of a full batch, not of add/remove: the same algorithms with every batch sampled at a
    stated (public) size are still priced under add/remove."""
    for line in (
        "account double-spider --dataset-size 1000 --steps 10 --restart 5 --batch-sizes 64,64,64,64 "
        "--sampling poisson --noise-multipliers 1,1,1,1",
        "account dp-sgda --dataset-size 1000 --batch-size 10 --steps 10 --sampling poisson --sigma-x 0.1 "
        "--sigma-y 0.1",
        "account dp-sgd --sample-rate 0.01 --steps 10 --noise-multiplier 1",
    ):
        args = _parse(line + " --delta 1e-5 --neighbouring add-remove --json")
        assert args.run(args) == 0


def test_the_table_shows_what_the_other_accountant_would_report(capsys):
    """Under RDP the table also prints PLD's epsilon for the same releases (the choice visible), equal to the
    report's; under PLD it prints the loss grid the epsilon was computed on."""
    rdp = _run(capsys, DP_SGD + " --accountant rdp")
    shown = re.search(r"the PLD accountant reports epsilon = ([0-9.e+-]+)", rdp)
    assert shown is not None
    pld = _json(capsys, DP_SGD + " --accountant pld")
    assert float(shown.group(1)) == pytest.approx(pld["epsilon"], rel=1e-5)
    assert float(shown.group(1)) < _json(capsys, DP_SGD + " --accountant rdp")["epsilon"]
    assert re.search(r"PLD loss grid: [0-9.e-]+", _run(capsys, DP_SGD + " --accountant pld"))
