"""The accountant an algorithm carries: it records every release as it happens and answers epsilon/delta.

Composition and conversion are dp_accounting's, through the accountant's backend
(:mod:`dpvr.privacy.backends`): each distinct event is priced by its ``RdpAccountant`` (RDP curve over the
orders) and the total is converted with its ``compute_epsilon``/``compute_delta``; with ``accountant="pld"``
the ledger is composed in its ``PLDAccountant``. What dpvr adds is the ledger by noise
stream (so a report can say which stream spent what), the neighbouring-relation convention of
:mod:`dpvr.privacy.relations`, a failure probability for sensitivity bounds that hold only with high
probability, runs (random allocation's epochs are counted per run and stream), and a JSON-serialisable state
for checkpoints.

With the PLD accountant the ledger is composed as a multiset of releases, in a canonical order, so that a run
recorded release by release, its budget guard and its calibration as one mechanism all compose identically.
Unsampled Gaussian releases are composed in closed form first (a composition of Gaussians with noise
multipliers ``z_i`` is exactly one with ``z = (sum_i 1/z_i^2)^(-1/2)``), so that their rounding to the loss
grid is paid once, not once per release. The loss grid is dp_accounting's ``1e-4`` unless a distribution
would then need more than ``_MAX_PLD_POINTS`` points after dp_accounting's truncation of its tails (a
release with little noise); it is then coarsened by the least power of two that fits, which keeps the bound
pessimistic, and the report says so (``PrivacyReport.pld_grid``).

A stream's *share* is its part of the total RDP at the reporting order (the optimal order of the RDP
conversion). RDP composes additively at a fixed order, so the shares of all streams sum to one. With the
PLD accountant the shares are still measured on the RDP curves, because a privacy-loss distribution has no
additive per-stream decomposition at a given delta.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Union

import attr
import dp_accounting as dpa
import numpy as np
from dp_accounting import dp_event
from dp_accounting.pld import privacy_loss_distribution
from dp_accounting.rdp import rdp_privacy_accountant

from . import _checks, pld_numerics
from .backends import PLD, RDP
from .mechanism import Mechanism
from .random_allocation import (
    RandomAllocationDpEvent,
    epochs,
    is_random_allocation,
    random_allocation_gaussian_pld,
)
from .relations import (
    ADD_REMOVE,
    DEFAULT_ORDERS,
    REPLACE_ONE,
    Composition,
    Ledger,
    accountant_backend,
    check_neighbouring,
    is_wor_gaussian,
    require_supported,
    walk,
)
from .subsampling import PLD_DISCRETIZATION, gaussian_loss_width, gaussian_pld, wor_gaussian_pld

StreamSpec = Union[str, Mapping[str, float]]
_FORMAT = "dpvr.privacy.Accountant/2"
_UNTAGGED_FORMAT = "dpvr.privacy.Accountant/1"  # ledger entries without their run
_UNTAGGED_NOTE = (
    "restored from a state without run identities: each of its random-allocation ledger entries is charged "
    "as a run of its own (an upper bound)"
)

_RELATION_NOTES = {
    REPLACE_ONE: "neighbouring datasets differ by replacing one record (the dataset size is public)",
    ADD_REMOVE: "neighbouring datasets differ by adding or removing one record; every mean is normalised "
    "by a public count (batch size, expected batch size or nominal dataset size)",
}


@dataclass
class PrivacyReport:
    """What was spent: ``(epsilon, delta)``-DP under ``neighbouring``; per noise stream its ``shares`` of the
    spend (fractions of the total RDP at the reporting order, summing to 1) and, in an algorithm's report,
    its ``noise_multipliers``; and every assumption the guarantee rests on.

    Attributes:
        epsilon: the privacy loss of everything recorded, at ``delta``.
        delta: the ``delta`` it is reported at (including any failure probability recorded).
        accountant: ``"rdp"`` or ``"pld"`` (or a registered accountant's name).
        neighbouring: ``"replace-one"`` or ``"add-remove"``.
        order: the RDP order that gave ``epsilon`` (``None`` under PLD).
        shares: each stream's fraction of the spend.
        assumptions: every assumption the guarantee rests on (relation, clipping, sampling, ...).
        noise_multipliers: each stream's noise multiplier, in an algorithm's report.
        pld_grid: under PLD, the width of the privacy-loss grid ``epsilon`` was computed on (dp_accounting's
            ``1e-4`` unless the releases need a coarser one to fit in memory); ``None`` otherwise.
        pld_epsilon: under RDP, the epsilon the PLD accountant reports for the same releases at ``delta``
            (usually smaller: RDP's conversion is looser), so that the choice of accountant is visible;
            ``None`` where PLD cannot price them.

    Guarantee:
        The recorded releases, composed, are ``(epsilon, delta)``-DP under ``neighbouring`` provided every
        entry of ``assumptions`` holds.
    """

    epsilon: float
    delta: float
    accountant: str
    neighbouring: str
    order: float | None
    shares: dict[str, float]
    assumptions: list[str] = field(default_factory=list)
    noise_multipliers: dict[str, float] = field(default_factory=dict)
    pld_grid: float | None = None
    pld_epsilon: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        """One line for ``print(trainer.privacy_spent())``: epsilon at delta, the accountant and relation, and
        per stream its noise multiplier (and share of epsilon when there are several); the assumptions are
        in :attr:`assumptions`."""
        epsilon = "inf (unbounded)" if math.isinf(self.epsilon) else f"{self.epsilon:.4g}"
        several = len(self.shares) > 1
        streams = [
            f"{name}: noise multiplier {z:.4g}"
            + (f", {self.shares[name]:.0%} of epsilon" if several and name in self.shares else "")
            for name, z in self.noise_multipliers.items()
        ]
        return (f"epsilon={epsilon} at delta={self.delta:g} ({self.accountant.upper()}, {self.neighbouring}"
                + "".join(f"; {s}" for s in streams) + ")")


def event_to_dict(event: dpa.DpEvent) -> dict[str, Any]:
    """A JSON-serialisable description of a dp_accounting event (nested events included)."""
    out: dict[str, Any] = {"type": type(event).__name__}
    for a in attr.fields(type(event)):
        out[a.name] = _encode(getattr(event, a.name))
    return out


def _encode(value: Any) -> Any:
    if isinstance(value, dpa.DpEvent):
        return event_to_dict(value)
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


_DPVR_EVENTS = {RandomAllocationDpEvent.__name__: RandomAllocationDpEvent}


def event_from_dict(data: Mapping[str, Any]) -> dpa.DpEvent:
    """Inverse of :func:`event_to_dict`; only dp_accounting's own event classes and dpvr's
    :class:`~dpvr.privacy.random_allocation.RandomAllocationDpEvent` are accepted."""
    cls = _DPVR_EVENTS.get(str(data.get("type"))) or getattr(dp_event, str(data.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, dpa.DpEvent)):
        raise ValueError(f"unknown DpEvent type {data.get('type')!r}")
    return cls(**{k: _decode(v) for k, v in data.items() if k != "type"})


def _decode(value: Any) -> Any:
    if isinstance(value, Mapping) and "type" in value:
        return event_from_dict(value)
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


@dataclass
class _Entry:
    parts: tuple[tuple[str, float], ...]
    event: dpa.DpEvent
    count: int
    run: str = ""  # releases of one run (or segment of a run): random allocation's epochs are counted per run


def _parts(stream: StreamSpec) -> tuple[tuple[str, float], ...]:
    if isinstance(stream, str):
        if not stream:
            raise ValueError("stream must be a non-empty name")
        return ((stream, 1.0),)
    if not isinstance(stream, Mapping) or not stream:
        raise ValueError(f"stream must be a name or a mapping of names to weights, got {stream!r}")
    weights = {str(k): _checks.positive(f"weight of stream {k!r}", w) for k, w in stream.items()}
    total = math.fsum(weights.values())
    return tuple((k, w / total) for k, w in weights.items())


_CURVES: OrderedDict[tuple[str, str, tuple[float, ...]], tuple[np.ndarray | None, bool]] = OrderedDict()
_CURVES_KEPT = 4096


@contextlib.contextmanager
def _orders_dropped_quietly() -> Iterator[None]:
    """dp_accounting logs a warning block for every fractional RDP order whose series does not converge (it
    then drops that order, which leaves a valid bound over the others): silenced, as every accountant builds
    RDP curves (for the shares of streams) whichever accountant prices the run."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _rdp_curve(
    event: dpa.DpEvent, neighbouring: str, orders: tuple[float, ...]
) -> tuple[np.ndarray | None, bool]:
    """RDP of one release over ``orders``, and whether it is exact (else a proxy used only for shares).

    A pure function of its arguments, cached for the process: every accountant (a restored one, each run of
    an audit) prices a release it has seen before for free. A sampled-without-replacement curve otherwise
    costs a quarter of a second. The cached arrays are read-only."""
    key = (repr(event), neighbouring, orders)
    if key in _CURVES:
        _CURVES.move_to_end(key)
        return _CURVES[key]
    exact_event = RDP.rewrite(event, neighbouring)
    acc = RDP.make(neighbouring, orders=orders)
    if acc.supports(exact_event):
        with _orders_dropped_quietly():
            curve, exact = acc.compose(exact_event).rdp, True
    else:
        # Only reachable with an accountant that prices what RDP cannot (Poisson sampling under replace-one,
        # random allocation): shares are measured on an RDP stand-in (backends.RdpBackend.proxy).
        proxy = RDP.proxy(event, neighbouring)
        curve, exact = None, False
        if proxy is not None:
            proxy_event, relation = proxy
            proxy_event = RDP.rewrite(proxy_event, relation)
            stand_in = RDP.make(relation, orders=orders)
            curve = stand_in.compose(proxy_event).rdp if stand_in.supports(proxy_event) else None
    if curve is not None:
        curve = np.array(curve, dtype=float)
        curve.setflags(write=False)
    _CURVES[key] = (curve, exact)
    if len(_CURVES) > _CURVES_KEPT:
        _CURVES.popitem(last=False)
    return curve, exact


class Accountant:
    """Records the releases of a running algorithm and converts them to ``(epsilon, delta)``.

    ``accountant`` is ``"rdp"`` (dp_accounting's RDP accountant; fast, supports every dpvr event except
    Poisson sampling under replace-one) or ``"pld"`` (its privacy-loss-distribution accountant; tighter,
    slower, no RDP curves; a Gaussian on a batch drawn without replacement is priced by dpvr's own PLD,
    :mod:`dpvr.privacy.subsampling`), or any accountant registered with
    :func:`~dpvr.privacy.relations.register_accountant` (its backend composes the ledger). ``neighbouring``
    is ``"replace-one"`` (as in the papers) or ``"add-remove"``.

    Noise multipliers follow dpvr's convention (:mod:`dpvr.privacy.relations`): noise std over the L2 bound
    on one record's contribution to the released sum. Under replace-one that record can move the sum by
    twice the bound, and the accountant prices it so.

    Args:
        accountant: ``"rdp"``, ``"pld"`` or a registered accountant's name.
        neighbouring: ``"replace-one"`` or ``"add-remove"``.
        orders: the RDP orders (all above 1); default a fixed grid.

    Raises:
        ValueError: an unknown accountant or neighbouring relation, or orders that are empty or not above 1.

    Guarantee:
        :meth:`report` and :meth:`epsilon` bound the privacy loss of the adaptive composition of everything
        recorded, under ``neighbouring``, given the assumptions recorded with it (:attr:`assumptions`).
    """

    def __init__(
        self,
        accountant: str = "rdp",
        neighbouring: str = REPLACE_ONE,
        orders: Sequence[float] | None = None,
    ) -> None:
        self._configure(accountant, neighbouring, orders)

    def _configure(self, accountant: str, neighbouring: str, orders: Sequence[float] | None) -> None:
        self._backend = accountant_backend(accountant)
        self._kind = accountant
        self._neighbouring = check_neighbouring(neighbouring)
        orders = tuple(float(a) for a in (orders if orders is not None else DEFAULT_ORDERS))
        if not orders or min(orders) <= 1:
            raise ValueError(f"orders must be a non-empty sequence of RDP orders > 1, got {orders!r}")
        self._orders = orders
        self._ledger: list[_Entry] = []
        self._assumptions: list[str] = []
        self._failure = 0.0
        self._stream_rdp: dict[str, np.ndarray] = {}
        self._total = np.zeros(len(self._orders))
        self._composed: Composition | None = None  # the ledger composed by the backend, until it changes
        self._runs = 0  # record_mechanism's next run number

    # -- recording ---------------------------------------------------------------------------------------

    @property
    def accountant(self) -> str:
        return self._kind

    @property
    def neighbouring(self) -> str:
        return self._neighbouring

    @property
    def orders(self) -> tuple[float, ...]:
        return self._orders

    @property
    def streams(self) -> tuple[str, ...]:
        """Names of the streams recorded so far, in order of first appearance."""
        return tuple(self._stream_rdp)

    @property
    def assumptions(self) -> list[str]:
        return list(self._assumptions)

    @property
    def failure_probability(self) -> float:
        return self._failure

    def record(
        self,
        stream: StreamSpec,
        event: dpa.DpEvent,
        count: int = 1,
        *,
        replace: bool = False,
        run: str = "",
    ) -> None:
        """Record ``count`` releases of ``event`` for ``stream``.

        ``stream`` is a name, or a mapping of names to weights when one release serves several streams (a
        shared batch; see :meth:`Mechanism.step`). ``replace=True`` makes ``event`` the stream's whole cost
        so far in ``run``, for bounds that cover a whole trajectory (the last-iterate bound after ``t``
        steps). ``run`` names the run (or the segment of a run between re-runs) the release belongs to:
        releases whose joint cost depends on sharing one allocation — random allocation's epochs, counted
        ``ceil(count / t)`` — are grouped by it, so two runs are never priced as one. The default ``""`` is
        the accountant's implicit run, the one an algorithm records into step by step.

        Raises ``ValueError`` if the event cannot be accounted by this accountant under its relation.
        """
        if not isinstance(event, dpa.DpEvent):
            raise TypeError(f"event must be a dp_accounting DpEvent, got {type(event).__name__}")
        if not isinstance(run, str):
            raise TypeError(f"run must be a string naming the run, got {type(run).__name__}")
        parts = _parts(stream)
        count = _checks.count("count", count)
        require_supported(event, self._kind, self._neighbouring)
        if replace:
            if len(parts) != 1:
                raise ValueError("replace=True needs a single stream name")
            name = parts[0][0]
            if any(len(e.parts) > 1 and name in dict(e.parts) for e in self._ledger):
                raise ValueError(f"stream {name!r} shares releases with other streams; it cannot be replaced")
            self._ledger = [e for e in self._ledger if e.parts != parts or e.run != run]
            self._rebuild()
        if count == 0:
            return
        last = self._ledger[-1] if self._ledger else None
        if last is not None and last.parts == parts and last.event == event and last.run == run:
            last.count += count
        else:
            self._ledger.append(_Entry(parts, event, count, run))
        self._add(parts, event, count)

    def record_mechanism(self, mechanism: Mechanism, *, run: str | None = None) -> str:
        """Record a whole run (all releases of every stream) with its assumptions and failure probability.

        The run is ``run``, by default a fresh one that no other release shares (``"mechanism-<k>"``, an
        unused name): two recorded mechanisms are two runs. Returns the run's name."""
        if mechanism.neighbouring != self._neighbouring:
            raise ValueError(
                f"mechanism was built for neighbouring={mechanism.neighbouring!r}, "
                f"the accountant uses {self._neighbouring!r}"
            )
        # Check every release first, so that a refused run records nothing.
        for release in mechanism.releases:
            require_supported(release.step_event(), self._kind, self._neighbouring)
        if run is None:
            used = {e.run for e in self._ledger}
            while f"mechanism-{self._runs}" in used:
                self._runs += 1
            run = f"mechanism-{self._runs}"
            self._runs += 1
        for release in mechanism.releases:
            self.record(dict(release.parts), release.step_event(), release.count, run=run)
        for text in mechanism.assumptions:
            self.assume(text)
        if mechanism.failure_probability:
            self.add_failure_probability(mechanism.failure_probability)
        return run

    def assume(self, text: str) -> None:
        """State an assumption the guarantee rests on (listed in every report)."""
        if text not in self._assumptions:
            self._assumptions.append(text)

    def add_failure_probability(self, probability: float) -> None:
        """Add the probability that a sensitivity bound fails; it is added to every delta."""
        probability = _checks.non_negative("probability", probability)
        if self._failure + probability >= 1:
            raise ValueError(
                f"total failure probability must stay below 1, got {self._failure + probability}"
            )
        self._failure += probability

    def _curve(self, event: dpa.DpEvent) -> tuple[np.ndarray | None, bool]:
        """RDP of one release over the orders, and whether it is exact (else a proxy used only for shares)."""
        return _rdp_curve(event, self._neighbouring, self._orders)

    def _add(self, parts: tuple[tuple[str, float], ...], event: dpa.DpEvent, count: int) -> None:
        self._composed = None
        curve, _ = self._curve(event)
        for name, weight in parts:
            self._stream_rdp.setdefault(name, np.zeros(len(self._orders)))
            if curve is not None:
                self._stream_rdp[name] = self._stream_rdp[name] + weight * count * curve
        if curve is not None:
            self._total = self._total + count * curve

    def _rebuild(self) -> None:
        self._composed = None
        self._stream_rdp = {}
        self._total = np.zeros(len(self._orders))
        for entry in self._ledger:
            self._add(entry.parts, entry.event, entry.count)

    # -- answers -----------------------------------------------------------------------------------------

    def _mechanism_delta(self, delta: float) -> float:
        delta = _checks.delta(delta)
        if delta <= self._failure:
            raise ValueError(
                f"delta ({delta}) must exceed the recorded failure probability ({self._failure})"
            )
        return delta - self._failure

    def _composition(self) -> Composition:
        """The ledger composed by the accountant's backend (kept until something is recorded)."""
        if self._composed is None:
            total = self._total
            self._composed = self._backend.compose(
                Ledger(tuple(self._ledger), self._neighbouring, self._orders, lambda: total)
            )
        return self._composed

    def _epsilon_and_order(self, delta: float) -> tuple[float, float | None]:
        mechanism_delta = self._mechanism_delta(delta)
        eps, order = self._composition().epsilon(mechanism_delta)
        return float(eps), None if order is None else float(order)

    def epsilon(self, delta: float) -> float:
        """Smallest epsilon such that everything recorded is ``(epsilon, delta)``-DP."""
        return self._epsilon_and_order(delta)[0]

    def delta(self, epsilon: float) -> float:
        """Smallest delta such that everything recorded is ``(epsilon, delta)``-DP."""
        epsilon = _checks.non_negative("epsilon", epsilon)
        spent = float(self._composition().delta(epsilon))
        return min(1.0, spent + self._failure)

    def would_exceed(
        self,
        stream: StreamSpec,
        event: dpa.DpEvent,
        epsilon_budget: float,
        delta: float,
        count: int = 1,
        *,
        run: str = "",
    ) -> bool:
        """Whether recording ``count`` more releases of ``event`` (of ``run``) would take epsilon above the
        budget: exactly the epsilon :meth:`epsilon` reports once they are recorded (the PLD ledger is composed
        as a multiset, and the composition is cached for that report)."""
        budget = _checks.positive("epsilon_budget", epsilon_budget)
        parts = _parts(stream)
        count = _checks.count("count", count)
        require_supported(event, self._kind, self._neighbouring)
        entries = (*self._ledger, _Entry(parts, event, count, run))

        def total() -> np.ndarray:  # the RDP curve with the new releases, computed only if the backend asks
            return self._total + count * self._curve(event)[0]

        composed = self._backend.compose(Ledger(entries, self._neighbouring, self._orders, total))
        return float(composed.epsilon(self._mechanism_delta(delta))[0]) > budget

    def shares(self, order: float) -> dict[str, float]:
        """Each stream's fraction of the total RDP at ``order`` (an order of this accountant)."""
        i = self._orders.index(float(order))
        total = math.fsum(v[i] for v in self._stream_rdp.values())
        if not (total > 0 and math.isfinite(total)):
            return {name: 0.0 for name in self._stream_rdp}
        return {name: float(v[i] / total) for name, v in self._stream_rdp.items()}

    def report(self, delta: float, *, compare: bool = True) -> PrivacyReport:
        """epsilon at ``delta``, the reporting order, each stream's share, and every stated assumption; under
        RDP with ``compare``, also what the PLD accountant would report (``PrivacyReport.pld_epsilon``)."""
        epsilon, order = self._epsilon_and_order(delta)
        assumptions = [_RELATION_NOTES[self._neighbouring], *self._assumptions]
        share_order = order
        if share_order is None:
            total = sum(self._stream_rdp.values(), np.zeros(len(self._orders)))
            share_order = float(
                rdp_privacy_accountant.compute_epsilon(self._orders, total, self._mechanism_delta(delta))[1]
            )
            if not all(self._curve(e.event)[1] for e in self._ledger):
                assumptions.append(
                    "stream shares measured on an RDP proxy: add/remove at twice the sensitivity for "
                    "Poisson-sampled replace-one releases, Poisson sampling at rate 1/t for random allocation"
                )
        composition = self._composition()
        assumptions.extend(composition.notes())
        if self._failure:
            assumptions.append(
                f"sensitivity bounds fail with probability <= {self._failure:g}, included in delta"
            )
        return PrivacyReport(
            epsilon=epsilon,
            delta=float(delta),
            accountant=self._kind,
            neighbouring=self._neighbouring,
            order=order,
            shares=self.shares(share_order) if self._stream_rdp else {},
            assumptions=assumptions,
            pld_grid=composition.interval if isinstance(composition, _ComposedPLD) else None,
            pld_epsilon=self._pld_epsilon(delta) if compare and self._kind == RDP.name else None,
        )

    def _pld_epsilon(self, delta: float) -> float | None:
        """epsilon at ``delta`` of the ledger by the PLD accountant (``None`` if it cannot price an entry):
        the same releases, composed as an accountant ``"pld"`` composes them."""
        if not self._ledger or any(
            PLD.unsupported_reason(e.event, self._neighbouring) is not None for e in self._ledger
        ):
            return None
        return _ComposedPLD.of(self._ledger, self._neighbouring).get_epsilon(self._mechanism_delta(delta))

    # -- checkpointing -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: a JSON-serialisable dict."""
        return {
            "format": _FORMAT,
            "accountant": self._kind,
            "neighbouring": self._neighbouring,
            "orders": list(self._orders),
            "failure_probability": self._failure,
            "assumptions": list(self._assumptions),
            "ledger": [
                {"streams": dict(e.parts), "count": e.count, "event": event_to_dict(e.event), "run": e.run}
                for e in self._ledger
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by :meth:`state_dict` (replacing everything recorded so far).

        A state of the previous format (``dpvr.privacy.Accountant/1``) may lack the run of its entries. Only
        random allocation's price depends on runs; such an entry is then charged as a run of its own, which
        charges at least the epochs of whatever runs it belonged to, and the report says so."""
        if state.get("format") not in (_FORMAT, _UNTAGGED_FORMAT):
            raise ValueError(f"state is not a {_FORMAT} state dict (format={state.get('format')!r})")
        self._configure(state["accountant"], state["neighbouring"], state["orders"])
        untagged = False
        for index, entry in enumerate(state["ledger"]):
            event = event_from_dict(entry["event"])
            run = entry.get("run")
            if run is None:
                allocated = any(is_random_allocation(e) for e in walk(event))
                run, untagged = (f"untagged-{index}", True) if allocated else ("", untagged)
            self.record(entry["streams"], event, entry["count"], run=run)
        if untagged:
            self.assume(_UNTAGGED_NOTE)
        for text in state["assumptions"]:
            self.assume(text)
        if state["failure_probability"]:
            self.add_failure_probability(state["failure_probability"])

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> Accountant:
        acc = cls()
        acc.load_state_dict(state)
        return acc


def account(mechanism: Mechanism, delta: float, accountant: str = "rdp") -> PrivacyReport:
    """Report for a whole run: a fresh accountant that records ``mechanism`` and reports at ``delta``.

    Args:
        mechanism: the run's releases (a plan's ``mechanism(noise)``).
        delta: the target ``delta``.
        accountant: ``"rdp"`` or ``"pld"``.

    Returns:
        The :class:`PrivacyReport`: the run is ``(report.epsilon, delta)``-DP under the mechanism's
        neighbouring relation.

    Raises:
        ValueError: an invalid ``delta``, or an accountant that cannot price one of the mechanism's releases
            (e.g. Poisson sampling under replace-one with RDP, random allocation without PLD).
    """
    acc = Accountant(accountant, mechanism.neighbouring)
    acc.record_mechanism(mechanism)
    return acc.report(delta)


def spend_curves(
    plan: Any, noise: Mapping[str, float], delta: float, steps: Sequence[int], accountant: str = "rdp"
) -> dict[str, list[float]]:
    """Epsilon at ``delta`` after each number of ``steps`` of ``plan``'s run with ``noise``, per bound that
    accounts it (:meth:`dpvr.privacy.events.Plan.cut`: one curve, or the last-iterate bound beside
    composition); a length the plan refuses (e.g. not a whole number of rounds) is left out as ``nan``."""
    cuts = []
    for k in steps:
        try:
            cuts.append(plan.cut(int(k)))
        except ValueError:
            cuts.append({})
    labels = dict.fromkeys(label for runs in cuts for label in runs)
    return {
        label: [_epsilon(_mechanism(runs[label], noise), delta, accountant) if label in runs else math.nan
                for runs in cuts]
        for label in labels
    }


def _epsilon(mechanism: Mechanism, delta: float, accountant: str) -> float:
    """:func:`account`'s epsilon, without the report's comparison with PLD."""
    acc = Accountant(accountant, mechanism.neighbouring)
    acc.record_mechanism(mechanism)
    return acc.epsilon(delta)


def _mechanism(plan: Any, noise: Mapping[str, float]) -> Mechanism:
    """A cut run's mechanism: the streams it has releases of (a short run may have no difference round)."""
    return plan.mechanism({stream: noise[stream] for stream in plan.streams})


__all__ = [
    "Accountant",
    "PrivacyReport",
    "account",
    "spend_curves",
    "event_from_dict",
    "event_to_dict",
]


#: The most points a privacy-loss distribution may hold on its grid, one release's or a composition's: 8 MB
#: per direction, and FFT compositions of a few times that.
_MAX_PLD_POINTS = 1 << 20
#: A release's PMF may span this many times as many points while it is built, before composition truncates
#: its tails (dp_accounting's tail mass 1e-15) to at most ``_MAX_PLD_POINTS``.
_BUILD_FACTOR = 4
#: What the caches of PLDs may hold in all, in grid points.
_CACHED_POINTS = 1 << 24
_TAIL_MASS = 1e-15  # dp_accounting's tail truncation in a self-composition (its default)
_WIDTH_SDS = 12.0  # a release's loss range: this many standard deviations either side, and its mean


class _ComposedPLD:
    """The privacy loss distribution of a ledger, on the loss grid of width ``interval``.

    The ledger is read as a multiset of releases (:func:`_groups`): compositions are flattened, unsampled
    Gaussians merged into one, random-allocation steps counted in epochs per run and stream; each distinct
    release's PLD is built once per process (:func:`_event_pld`), self-composed by its count, and the results
    composed in a canonical order, so the same multiset always gives the same distribution."""

    def __init__(self, pld: Any | None, interval: float, *, overflow: bool = False) -> None:
        self._pld = pld  # None: something recorded is not differentially private (a release without noise)
        self.interval = interval
        self.overflow = overflow  # the losses exceed floating point (see _compose): epsilon inf

    @classmethod
    def of(
        cls, entries: Sequence[_Entry], neighbouring: str, interval: float = PLD_DISCRETIZATION
    ) -> _ComposedPLD:
        """The ledger ``entries`` composed on the loss grid of width ``interval`` (the accountant's own grid
        unless a calibration searches on a coarser one), or on the coarsest power-of-two multiple of it that
        a release with little noise needs (:func:`_compose`)."""
        return _compose(_groups(entries), neighbouring, interval)

    def get_epsilon(self, delta: float) -> float:
        return math.inf if self._pld is None else pld_numerics.epsilon_for_delta(self._pld, delta)

    def get_delta(self, epsilon: float) -> float:
        return 1.0 if self._pld is None else float(self._pld.get_delta_for_epsilon(epsilon))

    # The ledger composition of the PLD backend (relations.Composition).

    def epsilon(self, delta: float) -> tuple[float, float | None]:
        return self.get_epsilon(delta), None

    def delta(self, epsilon: float) -> float:
        return self.get_delta(epsilon)

    def notes(self) -> list[str]:
        if self.overflow:
            return ["a release's privacy loss exceeds floating point (a noise multiplier near 0): epsilon is "
                    "unbounded, reported as inf"]
        if self.interval <= PLD_DISCRETIZATION:
            return []
        return [
            f"privacy-loss grid of width {self.interval:g}, coarser than "
            f"dp_accounting's {PLD_DISCRETIZATION:g}, to bound the memory and time of a release with "
            "little noise; the discretisation stays pessimistic (epsilon is an upper bound)"
        ]


def _leaves(event: dpa.DpEvent, count: int):
    """``(event, count)`` for every release in ``event`` repeated ``count`` times: compositions flattened."""
    if isinstance(event, dpa.SelfComposedDpEvent):
        yield from _leaves(event.event, count * event.count)
    elif isinstance(event, dpa.ComposedDpEvent):
        for part in event.events:
            yield from _leaves(part, count)
    elif count:
        yield event, count


def _key(event: dpa.DpEvent) -> str:
    return json.dumps(event_to_dict(event), sort_keys=True)


def _groups(entries: Sequence[_Entry]) -> tuple[tuple[str, int], ...]:
    """The ledger as ``(release key, count)`` pairs, sorted: what its PLD depends on, and nothing else.

    - A random-allocation step is priced by epoch, per run and stream: the releases of one run that serve the
      same streams are counted together (two runs', or two streams', epochs are independent allocations)
      and charged ``ceil(count / t)`` epochs (a partial epoch is a prefix of a full one).
    - Unsampled Gaussian releases compose exactly into one Gaussian, ``1/z^2 = sum_i count_i / z_i^2``, under
      either relation (the adaptive composition of Gaussian mechanisms is the Gaussian with
      ``mu^2 = sum_i mu_i^2``, attained: Dong, Roth and Su's Gaussian differential privacy): its
      discretisation is then paid once, however many releases it holds.
    """
    gaussians: dict[float, int] = {}
    epochs_of: dict[tuple[str, str], int] = {}
    counts: dict[str, int] = {}
    for entry in entries:
        for leaf, count in _leaves(entry.event, entry.count):
            if isinstance(leaf, dpa.GaussianDpEvent) and leaf.noise_multiplier > 0:
                gaussians[leaf.noise_multiplier] = gaussians.get(leaf.noise_multiplier, 0) + count
            elif is_random_allocation(leaf):
                owner = json.dumps([entry.run, entry.parts])
                epochs_of[owner, _key(leaf)] = epochs_of.get((owner, _key(leaf)), 0) + count
            else:
                counts[_key(leaf)] = counts.get(_key(leaf), 0) + count
    for (_, key), count in epochs_of.items():
        counts[key] = counts.get(key, 0) + epochs(count, json.loads(key)["num_steps"])
    if gaussians:
        if len(gaussians) == 1:  # dp_accounting's own form for a self-composed Gaussian
            ((noise, count),) = gaussians.items()
            merged = noise / math.sqrt(count)
        else:
            merged = math.fsum(c / z**2 for z, c in sorted(gaussians.items())) ** -0.5
        key = _key(dpa.GaussianDpEvent(merged))
        counts[key] = counts.get(key, 0) + 1
    return tuple(sorted(counts.items()))


def _loss_width(event: dpa.DpEvent, neighbouring: str) -> float:
    """The width of the loss range of ``event``'s PLD where it is known cheaply, else 0 (the PLD is then built
    first and measured, :func:`_compose`): a Gaussian, plain or sampled at rate ``q``, spans dp_accounting's
    connect-the-dots bounds exactly (its tails cut at ``e^-50``); under random allocation a bound,
    ``mu^2 + 2 * 12 mu + log 1e9`` for ``mu = 1 / z``; a Laplace spans ``[-1/b, 1/b]``."""
    rate = 1.0
    if isinstance(event, dpa.PoissonSampledDpEvent):
        rate = event.sampling_probability
    elif isinstance(event, dpa.SampledWithoutReplacementDpEvent) and event.source_dataset_size > 0:
        rate = event.sample_size / event.source_dataset_size
    allocated = isinstance(event, RandomAllocationDpEvent)
    while isinstance(
        event, (dpa.PoissonSampledDpEvent, dpa.SampledWithoutReplacementDpEvent, RandomAllocationDpEvent)
    ):
        event = event.event
    if isinstance(event, dpa.GaussianDpEvent) and event.noise_multiplier > 0:
        sensitivity = 2.0 if neighbouring == REPLACE_ONE else 1.0
        if allocated:
            mu = sensitivity / event.noise_multiplier
            return mu * mu + 2 * _WIDTH_SDS * mu + math.log(1e9)  # + log t for random allocation's sums
        return gaussian_loss_width(event.noise_multiplier, sensitivity, min(rate, 1.0)) if rate > 0 else 0.0
    if isinstance(event, dpa.LaplaceDpEvent) and event.noise_multiplier > 0:
        return 2.0 / event.noise_multiplier  # losses in [-1/b, 1/b]
    if isinstance(event, dp_event.DiscreteLaplaceDpEvent) and event.noise_parameter > 0:
        return 2.0 * event.noise_parameter * event.sensitivity
    return 0.0


def _points(pld: Any, count: int = 1) -> int:
    """Grid points of ``pld`` self-composed ``count`` times, as dp_accounting will allocate them (after its
    Chernoff truncation of the tails, sparse PMFs included), in its larger direction."""
    return max(pld_numerics.composed_points(pmf, count, _TAIL_MASS) for pmf in pld_numerics.pmfs(pld))


class _PLDCache:
    """Least-recently-used PLDs, bounded by their total number of grid points (one PLD of a release with
    little noise holds up to ``_MAX_PLD_POINTS``); ``pld_of`` finds the PLD in a cached value."""

    def __init__(self, points: int, pld_of: Any = lambda value: value) -> None:
        self._items: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self._budget, self._held, self._pld_of = points, 0, pld_of

    def get(self, key: Any, build: Any) -> Any:
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key][0]
        value = build()
        pld = self._pld_of(value)
        size = 0 if pld is None else max(pld_numerics.dense_parts(p)[1].size for p in pld_numerics.pmfs(pld))
        self._items[key] = (value, size)
        self._held += size
        while self._held > self._budget and len(self._items) > 1:
            _, (_, dropped) = self._items.popitem(last=False)
            self._held -= dropped
        return value


_EVENT_PLDS = _PLDCache(_CACHED_POINTS)
_COMPOSED = _PLDCache(_CACHED_POINTS, lambda composed: composed._pld)  # noqa: SLF001


def _compose(groups: tuple[tuple[str, int], ...], neighbouring: str, interval: float) -> _ComposedPLD:
    """The composition of ``groups`` (:func:`_groups`) on the loss grid of width ``interval``, or of
    ``interval * 2^k`` for the least ``k`` at which no release's PLD nor any composition needs more than
    ``_MAX_PLD_POINTS`` points. A coarser grid is still pessimistic (dp_accounting's connect-the-dots
    discretisation is an upper bound on any grid); it only costs precision where the losses are spread over
    thousands of units, i.e. where epsilon is large. Cached: a budget check and the report after it compose
    the same multiset."""

    def build() -> _ComposedPLD:
        grid = interval
        events = [event_from_dict(json.loads(key)) for key, _ in groups]
        width = max((_loss_width(event, neighbouring) for event in events), default=0.0)
        if width > _BUILD_FACTOR * _MAX_PLD_POINTS * grid:  # a release's PMF is built before truncation
            grid *= 2.0 ** math.ceil(math.log2(width / (_BUILD_FACTOR * _MAX_PLD_POINTS * grid)))
        while True:
            plds = [(_event_pld(key, neighbouring, grid), count) for key, count in groups]
            if any(pld is None for pld, _ in plds):
                return _ComposedPLD(None, grid)
            points = sum(_points(pld, count) for pld, count in plds)
            if points <= _MAX_PLD_POINTS:
                break
            grid *= 2.0 ** math.ceil(math.log2(points / _MAX_PLD_POINTS))
        total = privacy_loss_distribution.identity(grid)  # nothing released
        for event, (pld, count) in zip(events, plds):
            # As dp_accounting's accountant: a release is self-composed by its count even when that is 1
            # (which truncates its tails into the infinity mass), except the Gaussians merged into one.
            merged = isinstance(event, dpa.GaussianDpEvent)
            total = total.compose(pld if merged else pld_numerics.self_compose(pld, count, _TAIL_MASS))
        return _ComposedPLD(total, grid)

    def bounded() -> _ComposedPLD:
        # A release with almost no noise (multiplier ~1e-6) has privacy losses of ~1e12 units; the grid wide
        # enough to hold them makes dp_accounting's exp(grid) overflow. Its epsilon is unbounded for any use:
        # reported as inf (an upper bound), not raised from privacy_spent() or a budget check.
        try:
            return build()
        except OverflowError:
            return _ComposedPLD(None, interval, overflow=True)

    composed = _COMPOSED.get((groups, neighbouring, interval), bounded)
    return composed


def pld_epsilon(mechanism: Mechanism, delta: float, interval: float = PLD_DISCRETIZATION) -> float:
    """epsilon at ``delta`` of a whole run by the PLD accountant, composed exactly as :class:`Accountant`
    composes a ledger (so that a calibration to epsilon is one the budget guard accepts).

    ``interval`` is the width of the privacy-loss grid; the default is the accountant's. A coarser grid is
    much cheaper and still pessimistic, and its epsilon differs from the accountant's by a margin that shrinks
    about as ``interval**2`` (dp_accounting's connect-the-dots discretisation): calibration searches on it
    and confirms on the accountant's grid."""
    entries = [_Entry(_parts(dict(r.parts)), r.step_event(), r.count) for r in mechanism.releases]
    return _ComposedPLD.of(entries, mechanism.neighbouring, interval).get_epsilon(delta)


def _event_pld(event_key: str, neighbouring: str, interval: float) -> Any | None:
    """The PLD of one release of the event ``event_key`` (its JSON form) on the loss grid of width
    ``interval``; ``None`` if it is not DP. Built once per process (:data:`_EVENT_PLDS`)."""
    return _EVENT_PLDS.get(
        (event_key, neighbouring, interval),
        lambda: _build_pld(event_from_dict(json.loads(event_key)), neighbouring, interval),
    )


def _dpvr_priced(event: dpa.DpEvent, neighbouring: str) -> bool:
    """Whether ``event`` is one dpvr prices itself (dp_accounting cannot)."""
    return (neighbouring == REPLACE_ONE and is_wor_gaussian(event)) or is_random_allocation(event)


def _build_pld(event: dpa.DpEvent, neighbouring: str, interval: float) -> Any | None:
    """dp_accounting's PLD of ``event``, except for what dp_accounting cannot price: a Gaussian on a batch
    drawn without replacement gets dpvr's tight PLD (:func:`~dpvr.privacy.subsampling.wor_gaussian_pld`), a
    random-allocation step an epoch of
    :func:`~dpvr.privacy.random_allocation.random_allocation_gaussian_pld` (``c`` self-composed steps:
    ``ceil(c / t)`` epochs); compositions holding them are composed here, on the loss grid of width
    ``interval``. A Gaussian, or a Poisson-sampled one under add/remove, gets dp_accounting's PLD built by
    :func:`~dpvr.privacy.subsampling.gaussian_pld` (vectorised: a grid of 10^6 points costs a fraction of a
    second). ``None`` if ``event`` is not DP (dp_accounting flags a noiseless release instead of putting it in
    the PLD)."""
    sensitivity = 2.0 if neighbouring == REPLACE_ONE else 1.0
    if isinstance(event, dpa.GaussianDpEvent):
        noise = event.noise_multiplier
        return gaussian_pld(noise, sensitivity, 1.0, interval) if noise > 0 else None
    if (
        neighbouring != REPLACE_ONE
        and isinstance(event, dpa.PoissonSampledDpEvent)
        and isinstance(event.event, dpa.GaussianDpEvent)
        and event.event.noise_multiplier > 0
        and event.sampling_probability > 0
    ):
        return gaussian_pld(event.event.noise_multiplier, 1.0, event.sampling_probability, interval)
    if any(_dpvr_priced(e, neighbouring) for e in walk(event)):
        if is_random_allocation(event):
            noise = event.event.noise_multiplier
            if noise <= 0:
                return None
            return random_allocation_gaussian_pld(noise, event.num_steps, interval)
        if is_wor_gaussian(event):
            noise, n, b = event.event.noise_multiplier, event.source_dataset_size, event.sample_size
            return wor_gaussian_pld(noise, n, b, interval) if noise > 0 or b == 0 else None
        if isinstance(event, dpa.SelfComposedDpEvent):
            inner = _build_pld(event.event, neighbouring, interval)
            count = event.count
            if is_random_allocation(event.event):
                count = epochs(count, event.event.num_steps)
            if count == 0 or inner is None:
                return privacy_loss_distribution.identity(interval) if count == 0 else None
            return pld_numerics.self_compose(inner, count, _TAIL_MASS) if count > 1 else inner
        if isinstance(event, dpa.ComposedDpEvent):
            total = privacy_loss_distribution.identity(interval)
            for part in event.events:
                pld = _build_pld(part, neighbouring, interval)
                if pld is None:
                    return None
                total = total.compose(pld)
            return total
    accountant = PLD.make(neighbouring, interval=interval)
    accountant.compose(event)
    if accountant._contains_non_dp_event:  # noqa: SLF001
        return None
    return accountant._pld  # noqa: SLF001 - dp_accounting exposes no public accessor for the composed PLD
