"""The privacy guard every algorithm composes, and the calibration that comes before construction.

:class:`PrivacyGuard` is the privacy side of one run: the :class:`~dpvr.privacy.Accountant` that records
its releases, the budget check made before each release, the run's ledger
(:class:`~dpvr.optim.ledger.RunLedger`: every release is written into it before it is made, and the noise
generator's keys are named after its entry) and, on a resume, the charging of what the run released after
the loaded state. :class:`~dpvr.optim.PrivateAlgorithm` and the phased framework
(:class:`~dpvr.algorithms.phased.PhasedOutputPerturbation`) both hold one; they differ only in how a release
is charged:

- *sequential* (the default): every release is recorded when it completes; while every stream has made no
  more releases than the plan counts, a release is admitted without recomputing epsilon (the run so far is
  then a sub-run of the plan, which was priced once within the budget);
- *parallel* (``parallel=True``, the phased framework): the releases of one stream in one segment of the
  run read disjoint chunks of the data, so by parallel composition they cost one release, recorded at the
  first of them; a later one is only written into the ledger.

:func:`resolve_noise` turns the ``noise=`` an algorithm is given (or ``privacy.epsilon``) into one noise
multiplier per stream of its plan, from its arguments alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import dp_accounting as dpa

from ..ops import NoiseGenerator
from ..privacy import Accountant
from ..privacy.calibration import calibrate
from ..privacy.events import PaperSigmas, Plan
from ..privacy.mechanism import noise_dict
from ..privacy.relations import tightest_accountant as tightest
from .config import PrivacyConfig
from .ledger import Release, RunLedger


class BudgetExhaustedError(RuntimeError):
    """The next release would take the privacy loss above the budget; nothing was released."""


def tightest_accountant(plan: Plan) -> str:
    """``"pld"`` where the PLD accountant can price every release of ``plan``, else ``"rdp"``
    (:func:`dpvr.privacy.relations.tightest_accountant`)."""
    return tightest(plan.mechanism(dict.fromkeys(plan.streams, 1.0)).event, plan.neighbouring)


class EveryStream(float):
    """One noise multiplier for every stream of the plan (``make_private(noise_multiplier=z)``): a plain
    number stays refused for a plan with several streams, where it would be ambiguous to a reader of
    ``noise=``."""


def resolve_noise(
    plan: Plan,
    noise: Mapping[str, float] | float | PaperSigmas | None,
    privacy: PrivacyConfig,
    *,
    dimensions: Mapping[str, int] | None = None,
    units: Mapping[str, float] | None = None,
) -> dict[str, float]:
    """The noise multiplier of every stream of ``plan``, in the accountant's convention.

    ``noise``: ``{stream: z}`` (or one number for a one-stream plan), :class:`~dpvr.PaperSigmas` to convert
    a paper's sigmas, or ``None`` to calibrate every stream jointly to ``privacy.epsilon`` (with
    ``privacy.shares="auto"``, from the public ``dimensions`` of the streams' released vectors,
    :func:`dpvr.privacy.allocation.stream_dimensions`, and the ``units`` each stream's multiplier is
    relative to, ``None`` for equal ones)."""
    if noise is None:
        if privacy.epsilon is None:
            raise ValueError(
                "give noise={stream: noise multiplier}, or privacy=PrivacyConfig(epsilon=...) to calibrate it"
            )
        auto = privacy.shares == "auto"
        noise = calibrate(
            plan,
            privacy.epsilon,
            privacy.delta,
            accountant=privacy.accountant or tightest_accountant(plan),
            calibration=privacy.calibration,
            shares=privacy.shares,
            dimensions=dict(dimensions) if auto and dimensions is not None else None,
            units=dict(units) if auto and units is not None else None,
            **(privacy.paper_options if privacy.calibration == "paper" else {}),
        )
    elif isinstance(noise, EveryStream):
        noise = dict.fromkeys(plan.streams, float(noise))
    elif isinstance(noise, PaperSigmas):
        noise = plan.noise_from_paper(noise)
    elif isinstance(noise, Mapping):
        noise = plan.streams_of_run(noise)
    return noise_dict(plan.streams, noise)


Refusal = Callable[[float], str]  # the refusal's message, given the epsilon spent so far


class PrivacyGuard:
    """The privacy ledger of one run (see the module documentation): accountant, budget, run ledger.

    Args:
        accountant: records the releases (replaced by a loaded state's, see :meth:`install`).
        generator: the run's noise source; each admitted release names its keys after its ledger entry.
        epsilon, delta: the budget every release is admitted against (``epsilon=None``: no budget).
        planned: releases per stream the plan counts, for the within-plan fast path (sequential only).
        within_plan: whether the whole planned run was priced within ``epsilon``.
        parallel: charge the releases of one stream in one segment once (see the module documentation).
    """

    def __init__(
        self,
        accountant: Accountant,
        generator: NoiseGenerator,
        *,
        epsilon: float | None,
        delta: float,
        planned: Mapping[str, int] | None = None,
        within_plan: bool = False,
        parallel: bool = False,
    ) -> None:
        self.accountant, self.generator = accountant, generator
        self.epsilon, self.delta = epsilon, delta
        self.planned = dict(planned or {})
        self.within_plan = within_plan
        self.parallel = parallel
        self.released: dict[str, int] = {}  # sequential: releases per stream admitted so far
        self.charged: set[tuple[str, str]] = set()  # parallel: (segment, stream) recorded once
        self.charged_on_resume = 0  # releases of discarded branches charged by resume(), for refusals to name
        self.ledger = RunLedger()

    # ---- the budget ----------------------------------------------------------------------------------
    def spent(self) -> float:
        """Epsilon at ``delta`` of what the accountant holds (0 before any release)."""
        return self.accountant.epsilon(self.delta) if self.accountant.streams else 0.0

    def would_exceed(self, parts: Any, event: dpa.DpEvent) -> bool:
        """Whether recording ``event`` (for ``parts``) in the current segment would exceed the budget."""
        return self.epsilon is not None and self.accountant.would_exceed(
            parts, event, self.epsilon, self.delta, run=self.ledger.segment
        )

    def refuse_beyond(self, parts: Any, event: dpa.DpEvent, refusal: Refusal) -> None:
        """Raises :class:`BudgetExhaustedError` (``refusal(spent)``) if ``event`` would exceed the budget."""
        if self.would_exceed(parts, event):
            message = refusal(self.spent())
            if self.charged_on_resume:
                count = self.charged_on_resume
                message += (
                    f"; the spend includes {count} release(s) made after the checkpoint this run resumed "
                    "from (a branch the resume discarded), charged from the run's ledger: they were "
                    "released, so they count"
                )
            raise BudgetExhaustedError(message)

    def fits_plan(self, releases: Mapping[str, int]) -> bool:
        """Whether ``{stream: count}`` more releases keep every stream within the (affordable) plan."""
        return self.within_plan and all(
            self.released.get(s, 0) + c <= self.planned.get(s, 0) for s, c in releases.items()
        )

    # ---- releases ------------------------------------------------------------------------------------
    def admit(self, stream: str, parts: Any, event: dpa.DpEvent, refusal: Refusal) -> tuple[Any, Any]:
        """Admits one release of ``stream`` (sequential): checked against the budget unless within the
        plan, written into the ledger before it happens and counted (a release that then fails still
        counts, and is charged on resume: conservative). Returns ``(parts, event)`` for :meth:`record`."""
        if not self.fits_plan({stream: 1}):
            self.refuse_beyond(parts, event, refusal)
        self.write_ahead(parts, event)
        self.released[stream] = self.released.get(stream, 0) + 1
        return parts, event

    def admit_round(self, events: Mapping[str, tuple[int, dpa.DpEvent]], refusal: Refusal) -> None:
        """Refuses, before any of them happens, a round of releases (``{stream: (count, event of one)}``)
        that would not fit the budget as a whole; each is then admitted and recorded as usual."""
        counts = {s: c for s, (c, _) in events.items()}
        if self.epsilon is None or not events or self.fits_plan(counts):
            return
        composed = dpa.ComposedDpEvent(
            [e for e in (dpa.SelfComposedDpEvent(event, c) for c, event in events.values()) if e.count]
        )
        self.refuse_beyond(next(iter(events)), composed, refusal)

    def admit_parallel(self, stream: str, parts: Any, event: dpa.DpEvent, refusal: Refusal) -> bool:
        """Admits one release of ``stream`` (parallel): written into the ledger; recorded if it is the
        first of its stream in this segment (then returns ``True``). Only a re-run's first release is
        checked against the budget: the first segment's releases were priced when the noise was."""
        first = (self.ledger.segment, stream) not in self.charged
        rerun = any(segment != self.ledger.segment for segment, _ in self.charged)
        if first and rerun:
            self.refuse_beyond(parts, event, refusal)
        self.write_ahead(parts, event)
        if first:
            self.charged.add((self.ledger.segment, stream))
            self.record(parts, event)
        return first

    def write_ahead(self, parts: Any, event: dpa.DpEvent, *, replace: bool = False) -> Release:
        """Writes an admitted release into the run's ledger and names its noise keys after the entry."""
        release = self.ledger.admit(parts, event, replace=replace)
        self.generator.for_release(self.ledger.noise_context())
        return release

    def record(self, parts: Any, event: dpa.DpEvent, *, replace: bool = False) -> None:
        """Records a completed release in the accountant, under the current segment."""
        self.accountant.record(parts, event, run=self.ledger.segment, replace=replace)

    # ---- resuming ------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """What a state keeps of the guard: accountant, ledger position and the per-stream counts
        (``released``, sequential) or charges (``charged``, parallel)."""
        counts: dict[str, Any] = (
            {"charged": sorted(list(c) for c in self.charged)}
            if self.parallel
            else {"released": dict(self.released)}
        )
        return {"accountant": self.accountant.state_dict(), "ledger": self.ledger.state(), **counts}

    @staticmethod
    def parse_counts(state: Mapping[str, Any], parallel: bool) -> Any:
        """The per-stream counts (or charges) of a :meth:`state`; raises ``KeyError``/``TypeError``/
        ``AttributeError``/``ValueError`` on a malformed one."""
        if parallel:
            return {(str(s), str(n)) for s, n in state["charged"]}
        return {str(k): int(v) for k, v in state["released"].items()}

    def install(
        self, accountant: Accountant, generator: NoiseGenerator, ledger: RunLedger, counts: Any
    ) -> None:
        """Installs a loaded state's accountant, generator, ledger position and counts (no charging)."""
        self.accountant, self.generator, self.ledger = accountant, generator, ledger
        if self.parallel:
            self.charged = set(counts)
        else:
            self.released = dict(counts)

    def ledger_of(self, position: Mapping[str, Any], checkpoint: Any = None) -> RunLedger:
        """The ledger of the run a state at ``position`` belongs to, with every release the run made after
        it: its file (named in the state, or beside ``checkpoint``), else, for a state taken in memory
        before the run had a file, the lineage of ledgers that made its releases, if it is alive in this
        process (this guard's own, or another algorithm object's). Raises
        :class:`~dpvr.optim.ledger.LedgerError` if neither can be found, changing nothing: such a state's
        later releases cannot be charged (it names the way that does: checkpoint files)."""
        if position.get("path") is not None or checkpoint is not None:
            return RunLedger.of_checkpoint(position, checkpoint or position["path"])
        return RunLedger.of_state(position)

    def resume(self, ledger: RunLedger, after: list[Release], *, rerun: bool, seed: int | None) -> None:
        """Charges the releases ``after`` a loaded state (once per segment and stream in parallel mode),
        then continues ``ledger`` (a new segment if ``rerun``) as this run's."""
        for release in after:
            if self.parallel:
                name = release.parts if isinstance(release.parts, str) else next(iter(release.parts))
                if (release.segment, name) in self.charged:
                    continue
                self.charged.add((release.segment, name))
            self.accountant.record(release.parts, release.event, run=release.segment, replace=release.replace)
            self.charged_on_resume += 1
        if after:  # charged on top of the plan's: check every release from now on
            self.within_plan = False
        ledger.resumed(rerun, seed)
        self.ledger = ledger


__all__ = ["BudgetExhaustedError", "EveryStream", "PrivacyGuard", "resolve_noise", "tightest_accountant"]


class Guarded:
    """For what holds a :class:`PrivacyGuard` as ``self.guard``: its accountant, noise generator and run
    ledger as attributes of the holder (an algorithm, the phased framework)."""

    guard: PrivacyGuard

    @property
    def accountant(self) -> Accountant:
        return self.guard.accountant

    @property
    def generator(self) -> NoiseGenerator:
        return self.guard.generator

    @generator.setter
    def generator(self, generator: NoiseGenerator) -> None:
        self.guard.generator = generator

    @property
    def ledger(self) -> RunLedger:
        return self.guard.ledger
