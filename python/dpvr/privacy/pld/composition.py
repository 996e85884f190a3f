"""The PLD accountant's composition of a ledger: the multiset of releases, their PLDs, cached, composed.

With the PLD accountant the ledger is composed as a multiset of releases, in a canonical order, so that a run
recorded release by release, its budget guard and its calibration as one mechanism all compose identically.
Unsampled Gaussian releases are composed in closed form first (a composition of Gaussians with noise
multipliers ``z_i`` is exactly one with ``z = (sum_i 1/z_i^2)^(-1/2)``), so that their rounding to the loss
grid is paid once, not once per release. The loss grid is dp_accounting's ``1e-4`` unless a distribution
would then need more than ``_MAX_PLD_POINTS`` points after dp_accounting's truncation of its tails (a
release with little noise); it is then coarsened by the least power of two that fits, which keeps the bound
pessimistic, and the report says so (``PrivacyReport.pld_grid``).

Each release's PLD is dp_accounting's, except what dp_accounting cannot price: a Gaussian on a batch drawn
without replacement under replace-one (:mod:`dpvr.privacy.pld.subsampling`) and random allocation
(:mod:`dpvr.privacy.pld.random_allocation`); dp_accounting's per-point loops run vectorised
(:mod:`dpvr.privacy.pld.numerics`).
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import dp_accounting as dpa
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant, privacy_loss_distribution

from ..ledger import Entry, event_from_dict, event_to_dict, stream_parts
from ..mechanism import Mechanism
from ..random_allocation import RandomAllocationDpEvent, epochs, is_random_allocation
from ..relations import REPLACE_ONE, is_wor_gaussian, relation, walk
from . import adapter, numerics
from .random_allocation import random_allocation_gaussian_pld
from .subsampling import PLD_DISCRETIZATION, gaussian_loss_width, gaussian_pld, wor_gaussian_pld

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


class ComposedPLD:
    """The privacy loss distribution of a ledger, on the loss grid of width ``interval``.

    The ledger is read as a multiset of releases (:func:`_groups`): compositions are flattened, unsampled
    Gaussians merged into one, random-allocation steps counted in epochs per run and stream; each distinct
    release's PLD is built once per process (:func:`_event_pld`), self-composed by its count, and the results
    composed in a canonical order, so the same multiset always gives the same distribution."""

    def __init__(self, pld: Any | None, interval: float, *, overflow: bool = False) -> None:
        self.pld = pld  # None: something recorded is not differentially private (a release without noise)
        self.interval = interval
        self.overflow = overflow  # the losses exceed floating point (see _compose): epsilon inf

    @classmethod
    def of(
        cls, entries: Sequence[Entry], neighbouring: str, interval: float = PLD_DISCRETIZATION
    ) -> ComposedPLD:
        """The ledger ``entries`` composed on the loss grid of width ``interval`` (the accountant's own grid
        unless a calibration searches on a coarser one), or on the coarsest power-of-two multiple of it that
        a release with little noise needs (:func:`_compose`)."""
        return _compose(_groups(entries), neighbouring, interval)

    def get_epsilon(self, delta: float) -> float:
        return math.inf if self.pld is None else numerics.epsilon_for_delta(self.pld, delta)

    def get_delta(self, epsilon: float) -> float:
        return 1.0 if self.pld is None else float(self.pld.get_delta_for_epsilon(epsilon))

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


def _groups(entries: Sequence[Entry]) -> tuple[tuple[str, int], ...]:
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
    return max(numerics.composed_points(pmf, count, _TAIL_MASS) for pmf in adapter.pmfs(pld))


class _PLDCache:
    """Least-recently-used PLDs, bounded by their total number of grid points (one PLD of a release with
    little noise holds up to ``_MAX_PLD_POINTS``); ``pld_of`` finds the PLD in a cached value."""

    def __init__(self, points: int, pld_of: Any = lambda value: value) -> None:
        self._items: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self._budget, self._held, self.pld_of = points, 0, pld_of

    def get(self, key: Any, build: Any) -> Any:
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key][0]
        value = build()
        pld = self.pld_of(value)
        size = 0 if pld is None else max(adapter.dense_parts(p)[1].size for p in adapter.pmfs(pld))
        self._items[key] = (value, size)
        self._held += size
        while self._held > self._budget and len(self._items) > 1:
            _, (_, dropped) = self._items.popitem(last=False)
            self._held -= dropped
        return value


_EVENT_PLDS = _PLDCache(_CACHED_POINTS)
_COMPOSED = _PLDCache(_CACHED_POINTS, lambda composed: composed.pld)


def _compose(groups: tuple[tuple[str, int], ...], neighbouring: str, interval: float) -> ComposedPLD:
    """The composition of ``groups`` (:func:`_groups`) on the loss grid of width ``interval``, or of
    ``interval * 2^k`` for the least ``k`` at which no release's PLD nor any composition needs more than
    ``_MAX_PLD_POINTS`` points. A coarser grid is still pessimistic (dp_accounting's connect-the-dots
    discretisation is an upper bound on any grid); it only costs precision where the losses are spread over
    thousands of units, i.e. where epsilon is large. Cached: a budget check and the report after it compose
    the same multiset."""

    def build() -> ComposedPLD:
        grid = interval
        events = [event_from_dict(json.loads(key)) for key, _ in groups]
        width = max((_loss_width(event, neighbouring) for event in events), default=0.0)
        if width > _BUILD_FACTOR * _MAX_PLD_POINTS * grid:  # a release's PMF is built before truncation
            grid *= 2.0 ** math.ceil(math.log2(width / (_BUILD_FACTOR * _MAX_PLD_POINTS * grid)))
        while True:
            plds = [(_event_pld(key, neighbouring, grid), count) for key, count in groups]
            if any(pld is None for pld, _ in plds):
                return ComposedPLD(None, grid)
            points = sum(_points(pld, count) for pld, count in plds)
            if points <= _MAX_PLD_POINTS:
                break
            grid *= 2.0 ** math.ceil(math.log2(points / _MAX_PLD_POINTS))
        total = privacy_loss_distribution.identity(grid)  # nothing released
        for event, (pld, count) in zip(events, plds):
            # As dp_accounting's accountant: a release is self-composed by its count even when that is 1
            # (which truncates its tails into the infinity mass), except the Gaussians merged into one.
            merged = isinstance(event, dpa.GaussianDpEvent)
            total = total.compose(pld if merged else numerics.self_compose(pld, count, _TAIL_MASS))
        return ComposedPLD(total, grid)

    def bounded() -> ComposedPLD:
        # A release with almost no noise (multiplier ~1e-6) has privacy losses of ~1e12 units; the grid wide
        # enough to hold them makes dp_accounting's exp(grid) overflow. Its epsilon is unbounded for any use:
        # reported as inf (an upper bound), not raised from privacy_spent() or a budget check.
        try:
            return build()
        except OverflowError:
            return ComposedPLD(None, interval, overflow=True)

    composed = _COMPOSED.get((groups, neighbouring, interval), bounded)
    return composed


def pld_epsilon(mechanism: Mechanism, delta: float, interval: float = PLD_DISCRETIZATION) -> float:
    """epsilon at ``delta`` of a whole run by the PLD accountant, composed exactly as :class:`Accountant`
    composes a ledger (so that a calibration to epsilon is one the budget guard accepts).

    ``interval`` is the width of the privacy-loss grid; the default is the accountant's. A coarser grid is
    much cheaper and still pessimistic, and its epsilon differs from the accountant's by a margin that shrinks
    about as ``interval**2`` (dp_accounting's connect-the-dots discretisation): calibration searches on it
    and confirms on the accountant's grid."""
    entries = [Entry(stream_parts(dict(r.parts)), r.step_event(), r.count) for r in mechanism.releases]
    return ComposedPLD.of(entries, mechanism.neighbouring, interval).get_epsilon(delta)


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
    drawn without replacement gets dpvr's tight PLD
    (:func:`~dpvr.privacy.pld.subsampling.wor_gaussian_pld`), a random-allocation step an epoch of
    :func:`~dpvr.privacy.pld.random_allocation.random_allocation_gaussian_pld` (``c`` self-composed steps:
    ``ceil(c / t)`` epochs); compositions holding them are composed here, on the loss grid of width
    ``interval``. A Gaussian, or a Poisson-sampled one under add/remove, gets dp_accounting's PLD built by
    :func:`~dpvr.privacy.pld.subsampling.gaussian_pld` (vectorised: a grid of 10^6 points costs a fraction
    of a second). ``None`` if ``event`` is not DP (dp_accounting flags a noiseless release instead of putting
    it in the PLD)."""
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
            return numerics.self_compose(inner, count, _TAIL_MASS) if count > 1 else inner
        if isinstance(event, dpa.ComposedDpEvent):
            total = privacy_loss_distribution.identity(interval)
            for part in event.events:
                pld = _build_pld(part, neighbouring, interval)
                if pld is None:
                    return None
                total = total.compose(pld)
            return total
    accountant = pld_accountant(neighbouring, interval)
    accountant.compose(event)
    return adapter.accountant_pld(accountant)  # dp_accounting has no public accessor for the composed PLD


def pld_accountant(
    neighbouring: str, interval: float = PLD_DISCRETIZATION
) -> pld_privacy_accountant.PLDAccountant:
    """A fresh dp_accounting ``PLDAccountant`` under ``neighbouring``, on the loss grid of width
    ``interval``."""
    return pld_privacy_accountant.PLDAccountant(
        neighboring_relation=relation(neighbouring), value_discretization_interval=interval
    )


__all__ = ["PLD_DISCRETIZATION", "ComposedPLD", "pld_accountant", "pld_epsilon"]
