"""Plans: what an algorithm releases, stream by stream, as the accountant prices it.

Each algorithm has a *plan*, which lives in its home (``dpvr/algorithms/<name>/plan.py``; exported from
:mod:`dpvr.algorithms`): a frozen description of a run (sizes, counts, sampling, neighbouring relation),
built on :class:`Plan` and the builders here (:func:`released_stream`, :func:`check_relation`,
:data:`PER_SAMPLE`, ...). A plan is a mechanism factory: ``plan(noise)`` maps the noise multiplier of each
stream to the whole-run :class:`~dpvr.privacy.mechanism.Mechanism` (used by ``account`` and ``calibrate``),
and ``plan.step(name, noise)`` gives ``(attribution, event)`` for one release of a stream, which a running
algorithm hands to ``Accountant.record`` as it goes. ``plan.paper_noise(epsilon, delta)`` returns the paper's
closed-form noise where the paper has one. ``plan.exposures()``, ``plan.stream_vector(stream)`` and
``plan.stream_scale(stream)`` describe the algorithm's estimator to the error proxy that ``shares="auto"``
minimises (:mod:`dpvr.privacy.allocation`), so that everything known about an algorithm's releases is in its
plan.

Conventions (see :mod:`dpvr.privacy.relations`): a noise multiplier is the noise std divided by the L2 bound
on one record's contribution to the released *sum*; for a mean over a batch of ``b`` per-sample terms clipped
at ``C`` with noise std ``sigma * C`` on the mean (the papers' convention), it is ``sigma * b``. Under
replace-one a record moves that mean by up to ``2C/b``; under add/remove, by ``C/b`` provided the mean is
normalised by a public count. Each plan's ``noise_multiplier``/``sigma`` helpers convert from and to the
paper's own units.

Every difference round (DIFF2, PrivateDiff, the SPIDER estimators) clips the per-sample difference at an
iterate-dependent radius ``C_r`` computed from released iterates only, and scales its noise std with the same
radius; conditioned on the past, each such round is therefore a Gaussian release with a fixed noise
multiplier, whatever ``C_r`` is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields, replace
from typing import ClassVar, Union

import dp_accounting as dpa

from . import _checks
from .mechanism import FULL_BATCH, Mechanism, Sampling, Stream, noise_dict
from .relations import ADD_REMOVE, REPLACE_ONE, check_neighbouring

Noise = Union[Mapping[str, float], float]

PER_SAMPLE = (
    "per-sample clipping; the noise std on the released mean is noise_multiplier * C / batch size, "
    "C the clip radius (for difference rounds, the iterate-dependent radius from released iterates)"
)
SAME_SAMPLE = "each gradient difference evaluates the same sample at both points"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def paper_rdp_order(epsilon: float, delta: float) -> int:
    """The order the papers' single-order RDP proofs use: 1 + ceil(2 log(1/delta) / epsilon)."""
    return 1 + math.ceil(2 * math.log(1 / delta) / epsilon)


def accumulated_differences(rounds: int, period: int) -> float:
    """Difference draws an estimator carries per round when a reset comes every ``period`` of ``rounds``
    rounds: a period of ``L`` rounds carries ``0 + 1 + ... + (L - 1)`` of them (see
    :mod:`dpvr.privacy.allocation`)."""
    lengths = [period] * (rounds // period) + ([rounds % period] if rounds % period else [])
    return math.fsum(n * (n - 1) / 2 for n in lengths) / rounds


def check_paper_regime(name: str, epsilon: float, delta: float, n: int) -> None:
    """The regime of the minimax papers' practical constants: epsilon <= 1 and delta <= 1/n^2."""
    if epsilon > 1:
        raise ValueError(f"{name}'s closed-form noise is stated for epsilon <= 1, got epsilon={epsilon}")
    if delta > 1 / n**2:
        raise ValueError(
            f"{name}'s closed-form noise is stated for delta <= 1/n**2 = {1 / n**2:g}, got {delta}"
        )


def output_perturbation_multiplier(std: float, sensitivity: float, neighbouring: str = REPLACE_ONE) -> float:
    """Noise multiplier of ``x + N(0, std^2 I)`` when ``x`` has L2 ``sensitivity`` under ``neighbouring``.

    dpvr's unit is the add/remove bound; a replace-one sensitivity is twice that unit.
    """
    _checks.positive("std", std)
    _checks.positive("sensitivity", sensitivity)
    return std / sensitivity * (2.0 if check_neighbouring(neighbouring) == REPLACE_ONE else 1.0)


class PaperSigmas(dict):
    """Noise in a paper's own units, per stream: ``noise=PaperSigmas(restart=0.5, difference=1.0)``.

    dpvr's algorithms take noise multipliers per stream in the accountant's convention; this marker is the
    one explicit way to give the papers' sigmas instead (e.g. DIFF2's sigma on the averaged mean, a multiple
    of the clip radius): the algorithm converts each with :meth:`Plan.noise_from_paper`.

    A ``dict`` of ``{stream: sigma}``; it changes the unit of the noise, not the guarantee, which is always
    the accountant's price of the converted noise multipliers.
    """


class Plan:
    """Base of the per-algorithm plans (see the module documentation).

    A plan is a frozen dataclass of the run's public sizes that implements :meth:`_streams`; it overrides, as
    its algorithm needs, :meth:`_unit` (the paper's noise units), :meth:`_assumptions`,
    :meth:`default_neighbouring`, :meth:`paper_noise` and, for ``shares="auto"``, :meth:`exposures`,
    :meth:`stream_scale` and ``_vectors`` (read by :meth:`stream_vector`).
    """

    neighbouring: str

    _all_streams: ClassVar[tuple[str, ...]] = ()
    _vectors: ClassVar[Mapping[str, str]] = {}  # stream -> "y" | "scalar" where not "parameters"

    @classmethod
    def default_neighbouring(cls, sampling: str | None = None) -> str:
        """The relation the algorithm is accounted under unless told otherwise: the papers' replace-one."""
        return REPLACE_ONE

    @property
    def streams(self) -> tuple[str, ...]:
        """Names of the noise streams with releases in this run, i.e. the keys ``noise`` must have."""
        return tuple(s.name for s in self._streams({}))

    def stream_sampling(self, stream: str) -> Sampling:
        """How every release of ``stream`` draws its records: what the accountant charges, and what the
        algorithm's sampler of that stream is built from (``BatchSampler.for_stream`` in dpvr.optim)."""
        for planned in self._streams(dict.fromkeys(self.stream_names, 1.0)):
            if planned.name == stream:
                return planned.sampling
        raise ValueError(f"stream: {stream!r} has no releases in this plan (streams: {list(self.streams)})")

    @property
    def stream_names(self) -> tuple[str, ...]:
        """Every stream the algorithm has, including those this run's schedule leaves without releases."""
        return self._all_streams or self.streams

    def _streams(self, noise: Mapping[str, float]) -> list[Stream]:
        """The streams, with noise taken from ``noise`` (1.0 where absent, for discovering the layout)."""
        raise NotImplementedError

    def _assumptions(self) -> tuple[str, ...]:
        return ()

    def _failure_probability(self) -> float:
        return 0.0

    def _unit(self, stream: str) -> float:
        """Noise multiplier per unit of the paper's noise parameter of ``stream``."""
        return 1.0

    def _stream_name(self, stream: str | None) -> str:
        if stream is None and len(self.streams) == 1:
            return self.streams[0]
        if stream not in self.streams:
            raise ValueError(f"stream must be one of {self.streams}, got {stream!r}")
        return stream

    def noise_multiplier(self, sigma: float, stream: str | None = None) -> float:
        """The paper's noise parameter of ``stream`` (e.g. DIFF2's sigma, a multiple of the clip radius on the
        averaged mean) as a noise multiplier; ``stream`` may be omitted when there is only one."""
        return _checks.positive("sigma", sigma) * self._unit(self._stream_name(stream))

    def streams_of_run(self, given: Mapping[str, float]) -> dict[str, float]:
        """``given`` (per-stream settings) restricted to the streams with releases in this run; a name that
        is no stream of the algorithm is refused."""
        unknown = sorted(set(given) - set(self.stream_names))
        if unknown:
            raise ValueError(f"noise: {unknown} are not streams of this plan ({list(self.stream_names)})")
        return {name: value for name, value in given.items() if name in self.streams}

    def noise_from_paper(self, sigmas: Mapping[str, float]) -> dict[str, float]:
        """Noise multipliers per stream from the paper's sigmas (see :class:`PaperSigmas`)."""
        return {name: self.noise_multiplier(s, name) for name, s in self.streams_of_run(sigmas).items()}

    def sigma(self, noise_multiplier: float, stream: str | None = None) -> float:
        """Inverse of :meth:`noise_multiplier`."""
        return _checks.positive("noise_multiplier", noise_multiplier) / self._unit(self._stream_name(stream))

    def mechanism(self, noise: Noise) -> Mechanism:
        """The whole run with the given noise multipliers."""
        noise = noise_dict(self.streams, noise)
        streams = tuple(self._streams(noise))
        self._refuse_private_size(streams)  # again here, for plans defined outside dpvr
        return Mechanism(streams, self.neighbouring, self._assumptions(), self._failure_probability())

    __call__ = mechanism

    def _normalised_by_size(self, stream: Stream) -> bool:
        """Whether a release of ``stream`` reads the dataset size: a full-batch mean divides by it (and its
        noise std is set on that mean), and an output perturbation of a solution over all records has a
        sensitivity that shrinks with it. A plan whose full-batch stream does not read the size overrides
        this; the last-iterate bounds' RDP curves (``zcdp_unit``) are priced as a whole, not as batches."""
        return stream.sampling.scheme == "full" and stream.zcdp_unit is None

    def _refuse_private_size(self, streams: tuple[Stream, ...] | None = None) -> None:
        """Refuses add/remove adjacency for a plan with a release that reads the dataset size.

        Under add/remove the size is private: a neighbour has one record more or less, so a mean divided by
        the data's own size moves by up to ``2C/(n + 1)`` (its record's ``C/(n + 1)`` and every other
        record's share shrinking), not the ``C/n`` the relation prices, and a noise std set on that mean
        differs between neighbours. Such a plan is accounted under replace-one only, where the size is
        public by definition (or drawn by a sampled scheme at a rate of a public size)."""
        if self.neighbouring != ADD_REMOVE:
            return
        if streams is None:
            streams = tuple(self._streams(dict.fromkeys(self.stream_names, 1.0)))
        sized = [s.name for s in streams if self._normalised_by_size(s)]
        if sized:
            raise ValueError(
                f"neighbouring='add-remove': {type(self).__name__}'s stream(s) {sized} read the whole "
                "dataset and are normalised by its size, which add/remove adjacency makes private (adding a "
                "record moves such a mean by up to 2C/(n+1), not the C/n priced, and changes its noise "
                "std); use neighbouring='replace-one', where the size is public by definition, or a sampled "
                "scheme (e.g. sampling='poisson') where the algorithm has one"
            )

    def step(self, name: str, noise: Noise) -> tuple[dict[str, float], dpa.DpEvent]:
        """``(attribution, event)`` of one release of stream ``name``, for ``Accountant.record``."""
        return self.mechanism(noise).step(name)

    def cut(self, steps: int) -> dict[str, Plan]:
        """This run stopped after ``steps`` steps, under each bound that accounts it, by curve label (the
        spend curves of :func:`dpvr.privacy.spend_curves`); a plan without steps is its whole run."""
        if "steps" not in {f.name for f in fields(self)}:
            return {"epsilon": self}
        return {"epsilon": replace(self, steps=steps)}

    def paper_noise(self, epsilon: float, delta: float, **options: float) -> dict[str, float]:
        """The paper's closed-form noise multipliers for a target ``(epsilon, delta)``."""
        raise ValueError(
            f"{type(self).__name__} has no closed-form noise in its paper; use calibration='tight'"
        )

    # ---- the error proxy of shares="auto" (dpvr.privacy.allocation) ---------------------------------------
    def exposures(self) -> dict[str, float]:
        """Per stream with releases: how many of its noise draws the algorithm's estimator carries per step,
        averaged over the run (``exposure_s`` of :mod:`dpvr.privacy.allocation`'s error proxy). A plan that
        does not override it has no error proxy, so ``shares="auto"`` refuses it."""
        raise ValueError(f"shares='auto' has no error proxy for {type(self).__name__}")

    def stream_vector(self, stream: str) -> str:
        """The vector a release of ``stream`` is a noisy copy of, which gives its length to the error proxy:
        ``"parameters"`` (the model's trainable parameters: the default), ``"y"`` (a minimax problem's
        ``y``) or ``"scalar"`` (a DRO dual: one number)."""
        if stream not in self.stream_names:
            raise ValueError(f"stream: {stream!r} is not a stream of this plan ({list(self.stream_names)})")
        return self._vectors.get(stream, "parameters")

    def stream_scale(self, stream: str) -> float:
        """The noise std on the released vector per unit clip radius at noise multiplier 1 (``scale_s`` of
        the error proxy): :meth:`sigma` of 1, the paper's sigma being the std per unit radius."""
        return self.sigma(1.0, stream)


def released_stream(
    noise: Mapping[str, float],
    name: str,
    count: int,
    sampling: Sampling = FULL_BATCH,
    group: str | None = None,
) -> list[Stream]:
    """A one-element list with the stream, or an empty list when it has no releases."""
    if count == 0:
        return []
    return [Stream(name, noise.get(name, 1.0), count, sampling, group)]


def check_relation(neighbouring: str, *samplings: Sampling) -> None:
    check_neighbouring(neighbouring)
    for sampling in samplings:
        sampling.check(neighbouring)


def public_size_assumption(plan: Plan) -> tuple[str, ...]:
    """The assumption that the dataset size a plan reads is public, in the words of its relation."""
    size = getattr(plan, "dataset_size", None)
    if size is None:
        return ()
    if plan.neighbouring == ADD_REMOVE:
        return (f"the dataset size N = {size} is public (stated): the sampling rate, epoch, divisor and "
                "steps read N, never the size of the data, which add/remove adjacency makes private",)
    return (f"replace-one: the dataset size n = {size} is public by definition (neighbours have one size)",)






















__all__ = [
    "Noise",
    "PER_SAMPLE",
    "PaperSigmas",
    "Plan",
    "SAME_SAMPLE",
    "accumulated_differences",
    "ceil_div",
    "check_paper_regime",
    "check_relation",
    "output_perturbation_multiplier",
    "paper_rdp_order",
    "public_size_assumption",
    "released_stream",
]
