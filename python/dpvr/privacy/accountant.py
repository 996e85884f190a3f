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
recorded release by release, its budget guard and its calibration as one mechanism all compose identically
(:mod:`dpvr.privacy.pld.composition`).

A stream's *share* is its part of the total RDP at the reporting order (the optimal order of the RDP
conversion). RDP composes additively at a fixed order, so the shares of all streams sum to one. With the
PLD accountant the shares are still measured on the RDP curves, because a privacy-loss distribution has no
additive per-stream decomposition at a given delta.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import dp_accounting as dpa
import numpy as np
from dp_accounting.rdp import rdp_privacy_accountant

from . import _checks
from .backends import PLD, RDP
from .ledger import Entry as _Entry
from .ledger import StreamSpec, event_from_dict, event_to_dict
from .ledger import stream_parts as _parts
from .mechanism import Mechanism
from .pld import ComposedPLD
from .random_allocation import is_random_allocation
from .relations import (
    ADD_REMOVE,
    DEFAULT_ORDERS,
    REPLACE_ONE,
    Composition,
    Ledger,
    accountant_backend,
    check_neighbouring,
    require_supported,
    walk,
)

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
        # random allocation): shares are measured on an RDP stand-in (rdp.RdpBackend.proxy).
        proxy = RDP.proxy(event, neighbouring)
        curve, exact = None, False
        if proxy is not None:
            proxy_event, relation = proxy
            proxy_event = RDP.rewrite(proxy_event, relation)
            stand_in = RDP.make(relation, orders=orders)
            if stand_in.supports(proxy_event):
                with _orders_dropped_quietly():
                    curve = stand_in.compose(proxy_event).rdp
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
    :mod:`dpvr.privacy.pld.subsampling`), or any accountant registered with
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
            pld_grid=composition.interval if isinstance(composition, ComposedPLD) else None,
            pld_epsilon=self._pld_epsilon(delta) if compare and self._kind == RDP.name else None,
        )

    def _pld_epsilon(self, delta: float) -> float | None:
        """epsilon at ``delta`` of the ledger by the PLD accountant (``None`` if it cannot price an entry):
        the same releases, composed as an accountant ``"pld"`` composes them."""
        if not self._ledger or any(
            PLD.unsupported_reason(e.event, self._neighbouring) is not None for e in self._ledger
        ):
            return None
        return ComposedPLD.of(self._ledger, self._neighbouring).get_epsilon(self._mechanism_delta(delta))

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

