"""The settings ``make_private`` derives from the papers' theorems when they are not given.

Each algorithm binds its rules in its own module (:attr:`dpvr.registry.AlgorithmSpec.rules` and
``steps_rule``, set in :mod:`dpvr.algorithms`); the theorems' formulas are :mod:`dpvr.algorithms.theorems`,
whose public names are re-exported here. An algorithm registered from outside dpvr binds its own rules the
same way and gets its defaults like the built-in ones.

Privacy: a derived setting is a function of public quantities only (sizes, the budget and the user's
settings), so it is chosen before, and independently of, the private data, like any setting the user gives;
the run's accountant prices the run with it as with any other value.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .. import registry
from ..algorithms.theorems import (
    Derived,
    Missing,
    Protocol,
    Public,
    SpiderProtocol,
    diff2_lr,
    diff2_noise,
    diff2_protocol,
    diff2_tau,
    dpgd_protocol,
    dpsgda_protocol,
    noise_constant,
    private_diff_lr,
    private_diff_noise,
    private_diff_protocol,
    private_diff_tau,
    restart_period,
    sgda_kappa_factor,
    spider_period_theorem7,
    spider_protocol,
    spider_protocol_batch,
)


def _spec(algorithm: str) -> registry.AlgorithmSpec | None:
    return registry.REGISTRY.get(algorithm)


def derivable(algorithm: str) -> tuple[str, ...]:
    """The settings of ``algorithm`` that :func:`derive` can fill in."""
    spec = _spec(algorithm)
    return tuple(spec.rules) if spec is not None else ()


def derive(algorithm: str, settings: Mapping[str, Any], public: Public) -> dict[str, Derived]:
    """The defaults of ``algorithm``'s derivable settings absent from ``settings``.

    Raises:
        ValueError: a setting is absent and its theorem needs a radius that ``clip`` does not give (every
            such setting named at once).
    """
    spec = _spec(algorithm)
    derived, problems = {}, []
    for name, rule in (spec.rules if spec is not None else {}).items():
        if settings.get(name) is not None:
            continue
        try:
            value = rule({**settings, **{k: d.value for k, d in derived.items()}}, public)
        except Missing as missing:
            problems.append(f"{name}: not given, and its default ({missing})")
            continue
        if value is not None:  # None: the setting does not apply to this configuration
            derived[name] = value
    if problems:
        raise ValueError(f"make_private({algorithm!r}): " + "; ".join(problems))
    return derived


def derives_steps(algorithm: str) -> bool:
    """Whether ``algorithm``'s run length ``R`` is derived from its theorem when neither steps nor epochs are
    given (:func:`derive_steps`)."""
    spec = _spec(algorithm)
    return spec is not None and spec.steps_rule is not None


def derive_steps(algorithm: str, settings: Mapping[str, Any], public: Public) -> Derived:
    """The run length ``R`` of ``algorithm``'s theorem (``public.steps`` is not read).

    Raises:
        ValueError: ``algorithm`` has no such rule, or its theorem needs a radius ``clip`` does not give.
    """
    if not derives_steps(algorithm):
        raise ValueError(f"make_private({algorithm!r}): give the run's length as one of epochs= or steps=")
    try:
        return registry.get(algorithm).steps_rule(settings, public)
    except Missing as missing:
        message = f"make_private({algorithm!r}): steps: not given, and its default ({missing})"
        raise ValueError(message) from None


__all__ = [
    "Derived",
    "Protocol",
    "Public",
    "SpiderProtocol",
    "derivable",
    "derive",
    "derive_steps",
    "derives_steps",
    "diff2_lr",
    "diff2_noise",
    "diff2_protocol",
    "diff2_tau",
    "dpgd_protocol",
    "dpsgda_protocol",
    "noise_constant",
    "private_diff_lr",
    "private_diff_noise",
    "private_diff_protocol",
    "private_diff_tau",
    "restart_period",
    "sgda_kappa_factor",
    "spider_period_theorem7",
    "spider_protocol",
    "spider_protocol_batch",
]
