"""``dpvr account ALGORITHM ...`` and ``dpvr calibrate ALGORITHM ...``, one sub-command per registry entry.

``account`` prints the epsilon spent at ``--delta`` by a run with the given noise; ``calibrate`` prints the
noise for a target ``--epsilon`` (``--calibration tight``, the accountant's smallest noise, or ``paper``, the
paper's closed form). ``--json`` prints one JSON object (``{"epsilon"|"noise_multiplier": ..., "delta": ...,
"accountant": ..., "streams": [...]}``), otherwise a table. Flags, defaults and the default neighbouring
relation come from :mod:`dpvr.registry`, so they are the Python API's; so is the default accountant, the
tightest that prices the run (PLD wherever it can).
"""

from __future__ import annotations

import argparse
import json
from types import ModuleType

import numpy as np

from ..privacy import Accountant, Plan, PrivacyReport, calibrate, spend_curves
from ..privacy.relations import tightest_accountant
from ..registry import CALIBRATION, PRIVACY, REGISTRY, AlgorithmSpec, Argument, Sigma
from . import flags

_DESCRIPTIONS = {
    "account": (
        "epsilon spent by a run",
        "Print the epsilon that a run with the given noise spends at --delta. Noise is given in the paper's "
        "own units where the paper has them (e.g. DIFF2's sigma multiplies the clip radius of the averaged "
        "mean), else as noise multipliers. See 'dpvr account ALGORITHM --help'.",
    ),
    "calibrate": (
        "noise for a target (epsilon, delta)",
        "Print the noise for a target (--epsilon, --delta): tight, the accountant's smallest noise with the "
        "budget split between streams by --shares, or paper, the paper's closed form. See 'dpvr calibrate "
        "ALGORITHM --help'.",
    ),
}


_TIGHTEST = "the tightest that prices every release: pld, else rdp"
_PAPER_UNITS = "in the paper's own units; the plan converts them to noise multipliers"
_MULTIPLIERS = "noise multipliers: the noise std over the bound on one record's contribution to the sum"


def _plan(spec: AlgorithmSpec, args: argparse.Namespace) -> Plan:
    return spec.make_plan({a.name: getattr(args, a.name) for a in spec.arguments}, args.neighbouring)


def _noise(spec: AlgorithmSpec, args: argparse.Namespace, plan: Plan) -> dict[str, float]:
    """Noise multiplier of every stream with releases, from the noise flags."""
    if spec.noise is not None:
        values = getattr(args, spec.noise.name)
        values = (values,) if isinstance(values, float) else values
        if values is None or len(values) != len(plan.streams):
            raise ValueError(
                f"{spec.name} needs {spec.noise.flag} with one value per stream: {', '.join(plan.streams)}"
            )
        return dict(zip(plan.streams, values))
    noise = {}
    for stream in plan.streams:
        sigma = _sigma_argument(spec.paper_sigma(stream))
        value = getattr(args, sigma.name)
        if value is None:
            raise ValueError(f"{spec.name} needs {sigma.flag} for its {stream!r} stream")
        noise[stream] = plan.noise_multiplier(value, stream)
    return noise


def _sigma_argument(sigma: Sigma) -> Argument:
    """The flag of a paper sigma: ``--sigma1``."""
    return Argument(sigma.name, float, f"{sigma.stream} stream: {sigma.help}")


def _accountant(args: argparse.Namespace, plan: Plan) -> str:
    """``--accountant``, by default the tightest that prices the plan (as the algorithms choose)."""
    event = plan(dict.fromkeys(plan.streams, 1.0)).event
    return args.accountant or tightest_accountant(event, plan.neighbouring)


def _report(args: argparse.Namespace, spec: AlgorithmSpec, plan: Plan, noise: dict[str, float]):
    """The accountant's report and one row per stream (with the paper's sigma where it has one)."""
    accountant = Accountant(_accountant(args, plan), plan.neighbouring)
    mechanism = plan(noise)
    accountant.record_mechanism(mechanism)
    report = accountant.report(args.delta)
    rows = []
    for stream in mechanism.streams:
        row = {
            "name": stream.name,
            "releases": stream.count,
            "noise_multiplier": stream.noise_multiplier,
            "share": report.shares.get(stream.name, 0.0),
        }
        sigma = spec.paper_sigma(stream.name)
        if sigma is not None:
            row["sigma"] = plan.sigma(stream.noise_multiplier, stream.name)
            row["sigma_name"] = sigma.name
        rows.append(row)
    return report, rows


def _print_table(title: str, report: PrivacyReport, rows: list[dict]) -> None:
    order = f", RDP order {report.order:g}" if report.order is not None else ""
    print(
        f"{title} at delta = {report.delta:g} ({report.accountant} accountant, {report.neighbouring}{order})"
    )
    if report.pld_epsilon is not None:  # the choice of accountant, visible
        print(f"  the PLD accountant reports epsilon = {report.pld_epsilon:g} for the same releases")
    if report.pld_grid is not None:
        print(f"  PLD loss grid: {report.pld_grid:g}")
    print()
    sigma = any("sigma" in r for r in rows)
    print(
        f"{'stream':<16}{'releases':>10}{'noise multiplier':>18}"
        + (f"{'paper sigma':>24}" if sigma else "")
        + "   share"
    )
    for r in rows:
        paper = f"{r['sigma_name'] + ' = ' + format(r['sigma'], '.6g'):>24}" if sigma else ""
        print(f"{r['name']:<16}{r['releases']:>10}{r['noise_multiplier']:>18.6g}{paper}{r['share']:>8.1%}")
    print()
    print("assumptions:")
    for text in report.assumptions:
        print(f"  - {text}")


def _pyplot() -> ModuleType:
    # Imported for --plot only: matplotlib is no hard dependency of dpvr (it is the "plot" extra).
    try:
        import matplotlib
    except ImportError as err:
        raise RuntimeError('--plot draws with matplotlib, which is not installed: pip install matplotlib (or '
                           '"dpvr[plot]")') from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # as above: the plot extra

    return plt


def _plot(path: str, spec: AlgorithmSpec, plan: Plan, noise: dict[str, float], delta: float,
          accountant: str) -> None:
    """Epsilon spent against the steps of the run, per bound that accounts it (the last-iterate plan draws
    its bound beside composition of passes: the paper's Figure 1)."""
    plt = _pyplot()

    total = getattr(plan, "steps", 1)
    steps = sorted({int(k) for k in np.linspace(1, total, min(total, 40))})
    fig, ax = plt.subplots(figsize=(6, 4))
    for k, (label, curve) in enumerate(spend_curves(plan, noise, delta, steps, accountant).items()):
        ax.plot(steps, curve, "-" if k == 0 else "--", marker="." if len(steps) < 12 else None, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("steps")
    ax.set_ylabel(f"epsilon at delta = {delta:g} ({accountant})")
    ax.set_title(f"{spec.name}: privacy spent over the run")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _run_account(args: argparse.Namespace) -> int:
    spec: AlgorithmSpec = args.algorithm_spec
    if args.plot:
        _pyplot()  # before any work: a missing matplotlib is refused up front
    plan = _plan(spec, args)
    noise = _noise(spec, args, plan)
    report, rows = _report(args, spec, plan, noise)
    if args.plot:
        _plot(args.plot, spec, plan, noise, args.delta, _accountant(args, plan))
    if args.json:
        print(json.dumps({"algorithm": spec.name, **report.to_dict(), "streams": rows}))
    else:
        _print_table(f"dpvr account {spec.name}: epsilon = {report.epsilon:.6g}", report, rows)
    return 0


def _run_calibrate(args: argparse.Namespace) -> int:
    spec: AlgorithmSpec = args.algorithm_spec
    if args.plot:
        _pyplot()  # before any work: a missing matplotlib is refused up front
    plan = _plan(spec, args)
    options = (
        {a.name: getattr(args, a.name) for a in spec.paper_options} if args.calibration == "paper" else {}
    )
    noise = calibrate(
        plan, args.epsilon, args.delta, args.shares, _accountant(args, plan), args.calibration, **options
    )
    report, rows = _report(args, spec, plan, noise)
    if args.plot:
        _plot(args.plot, spec, plan, noise, args.delta, _accountant(args, plan))
    if args.json:
        single = next(iter(noise.values())) if len(noise) == 1 else noise
        out = {"algorithm": spec.name, "noise_multiplier": single, "calibration": args.calibration}
        out.update(report.to_dict(), epsilon=args.epsilon, spent_epsilon=report.epsilon, streams=rows)
        print(json.dumps(out))
    else:
        title = f"dpvr calibrate {spec.name} ({args.calibration}): target epsilon = {args.epsilon:g}, spent "
        _print_table(title + f"{report.epsilon:.6g}", report, rows)
    return 0


def _default_neighbouring(spec: AlgorithmSpec) -> str:
    """The algorithm's default relation in words (it may depend on the sampling)."""
    usual = spec.plan_type.default_neighbouring()
    sampling = next((a for a in spec.arguments if a.name == "sampling"), None)
    other = {c: spec.default_neighbouring({"sampling": c}) for c in (sampling.choices if sampling else ())}
    grouped: dict[str, list[str]] = {}
    for c, relation in other.items():
        if relation != usual:
            grouped.setdefault(relation, []).append(c)
    return "".join(f"{r} with --sampling {' or '.join(cs)}, else " for r, cs in grouped.items()) + usual


def _add_algorithm(parser: argparse.ArgumentParser, spec: AlgorithmSpec, command: str) -> None:
    """The flags of ``dpvr COMMAND ALGORITHM``: the plan's, the noise (account) or the calibration's."""
    run = parser.add_argument_group(f"{spec.name} run")
    for argument in spec.arguments:
        flags.add(run, argument)
    if command == "account":
        noise = parser.add_argument_group("noise", _PAPER_UNITS if spec.sigmas else _MULTIPLIERS)
        for argument in (spec.noise,) if spec.noise else map(_sigma_argument, spec.sigmas):
            flags.add(noise, argument)
    privacy = parser.add_argument_group("privacy")
    described = {"neighbouring": _default_neighbouring(spec), "accountant": _TIGHTEST}
    for argument in PRIVACY:
        flags.add(privacy, argument, described.get(argument.name))
    if command == "calibrate":
        for argument in CALIBRATION:
            flags.add(privacy, argument)
        if spec.paper_options:
            paper = parser.add_argument_group("paper calibration")
            for argument in spec.paper_options:
                flags.add(paper, argument)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--plot", metavar="FILE",
        help="also write a PNG of epsilon against the run's steps (for last-iterate: beside composition)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``account`` and ``calibrate`` commands, each with one sub-command per algorithm."""
    for command, run in (("account", _run_account), ("calibrate", _run_calibrate)):
        summary, description = _DESCRIPTIONS[command]
        parser = subparsers.add_parser(command, help=summary, description=description)
        parser.set_defaults(run=run)
        algorithms = parser.add_subparsers(
            dest="algorithm", required=True, metavar="ALGORITHM", help="the algorithm whose run is described"
        )
        for spec in REGISTRY.values():
            sub = algorithms.add_parser(spec.name, help=spec.description, description=spec.description)
            _add_algorithm(sub, spec, command)
            sub.set_defaults(run=run, algorithm_spec=spec)
