"""Event builders: what each dpvr algorithm releases, stream by stream.

Each algorithm has a *plan*: a frozen description of a run (sizes, counts, sampling, neighbouring
relation). A plan is a mechanism factory: ``plan(noise)`` maps the noise multiplier of each stream to the
whole-run :class:`~dpvr.privacy.mechanism.Mechanism` (used by ``account`` and ``calibrate``), and
``plan.step(name, noise)`` gives ``(attribution, event)`` for one release of a stream, which a running
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
from dataclasses import dataclass, fields, replace
from typing import ClassVar, Union

import dp_accounting as dpa

from . import _checks
from .mechanism import FULL_BATCH, Mechanism, Sampling, Stream, noise_dict
from .relations import ADD_REMOVE, REPLACE_ONE, check_neighbouring

Noise = Union[Mapping[str, float], float]

_PER_SAMPLE = (
    "per-sample clipping; the noise std on the released mean is noise_multiplier * C / batch size, "
    "C the clip radius (for difference rounds, the iterate-dependent radius from released iterates)"
)
_SAME_SAMPLE = "each gradient difference evaluates the same sample at both points"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _alpha(epsilon: float, delta: float) -> int:
    """The order the papers' single-order RDP proofs use: 1 + ceil(2 log(1/delta) / epsilon)."""
    return 1 + math.ceil(2 * math.log(1 / delta) / epsilon)


def _accumulated(rounds: int, period: int) -> float:
    """Difference draws an estimator carries per round when a reset comes every ``period`` of ``rounds``
    rounds: a period of ``L`` rounds carries ``0 + 1 + ... + (L - 1)`` of them (see
    :mod:`dpvr.privacy.allocation`)."""
    lengths = [period] * (rounds // period) + ([rounds % period] if rounds % period else [])
    return math.fsum(n * (n - 1) / 2 for n in lengths) / rounds


def _paper_regime(name: str, epsilon: float, delta: float, n: int) -> None:
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


def _stream(
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


def _check_relation(neighbouring: str, *samplings: Sampling) -> None:
    check_neighbouring(neighbouring)
    for sampling in samplings:
        sampling.check(neighbouring)


def _public_size(plan: Plan) -> tuple[str, ...]:
    """The assumption that the dataset size a plan reads is public, in the words of its relation."""
    size = getattr(plan, "dataset_size", None)
    if size is None:
        return ()
    if plan.neighbouring == ADD_REMOVE:
        return (f"the dataset size N = {size} is public (stated): the sampling rate, epoch, divisor and "
                "steps read N, never the size of the data, which add/remove adjacency makes private",)
    return (f"replace-one: the dataset size n = {size} is public by definition (neighbours have one size)",)


@dataclass(frozen=True)
class DPSGDPlan(Plan):
    """DP-SGD / DP-GD: ``steps`` noisy gradient steps, one stream ``"gradient"``.

    Each step releases the sum of per-sample gradients clipped at ``C`` plus ``N(0, (z C)^2 I)`` (Opacus'
    convention; the step divides by a public batch size). Sampling: ``"poisson"`` (``sample_rate``),
    ``"wor"`` (fixed batches without replacement; replace-one only), ``"full"`` (DP-GD),
    ``"random-allocation"`` (epochs of ``t = round(n / batch_size)`` steps, each record in one random step of
    each; add/remove only; priced by epoch, a partial last epoch as a whole one). ``neighbouring``
    defaults to :meth:`default_neighbouring` of the sampling, as :class:`dpvr.algorithms.DPSGD` does.

    Guarantee: the composition of ``steps`` (sampled) Gaussian mechanisms with noise multiplier ``z``.
    """

    steps: int
    sampling: str = "poisson"
    sample_rate: float | None = None
    batch_size: int | None = None
    dataset_size: int | None = None
    neighbouring: str | None = None

    def __post_init__(self) -> None:
        _checks.count("steps", self.steps)
        if self.neighbouring is None:
            object.__setattr__(self, "neighbouring", self.default_neighbouring(self.sampling))
        _check_relation(self.neighbouring, self.batch_sampling)
        self._refuse_private_size()

    @classmethod
    def default_neighbouring(cls, sampling: str | None = None) -> str:
        """Add/remove for Poisson sampling (Abadi et al., Opacus) and random allocation (accounted only under
        add/remove), else replace-one: fixed-size batches are accounted only under replace-one, and a full
        batch divides by ``n``, public only under replace-one."""
        return ADD_REMOVE if sampling in ("poisson", "random-allocation") else REPLACE_ONE

    @property
    def batch_sampling(self) -> Sampling:
        return Sampling.make(
            self.sampling,
            sample_rate=self.sample_rate,
            batch_size=self.batch_size,
            dataset_size=self.dataset_size,
        )

    def _streams(self, noise):
        return _stream(noise, "gradient", self.steps, self.batch_sampling)

    def _assumptions(self):
        return (_PER_SAMPLE, f"gradient: {self.batch_sampling.describe()}", *_public_size(self))

    def exposures(self) -> dict[str, float]:
        return {"gradient": 1.0}  # each step's gradient is fresh


@dataclass(frozen=True)
class AdaptiveClipDPSGDPlan(DPSGDPlan):
    """DP-SGD with private adaptive clipping (Andrew et al. 2021; :class:`dpvr.algorithms.DPSGD` with
    ``clipping="adaptive"``): each step releases the noisy clipped gradient sum (stream ``"gradient"``) and,
    on the same batch, the noisy shifted count ``sum_i (1[||g_i|| <= C] - 1/2) + N(0, sigma_b^2)`` (stream
    ``"clip-count"``, noise multiplier ``2 sigma_b``): one record moves the shifted count by at most ``1/2``
    under add/remove and ``1`` under replace-one, dpvr's unit and twice it, as for a clipped gradient
    (unshifted, the count would move by 1 under both relations: worse under add/remove).

    The two streams form one group: one Gaussian on the concatenated release per step, with
    ``1/z**2 = 1/z_gradient**2 + 1/z_count**2`` (the record that moves one part moves the other, so the
    parts are not priced as independent releases, and the group is not priced as two sampled releases).

    Guarantee: the composition of ``steps`` (sampled) Gaussian mechanisms with the group's noise multiplier.
    """

    _vectors: ClassVar = {"clip-count": "scalar"}

    def _streams(self, noise):
        return (_stream(noise, "gradient", self.steps, self.batch_sampling, "step")
                + _stream(noise, "clip-count", self.steps, self.batch_sampling, "step"))

    def exposures(self) -> dict[str, float]:
        return {"gradient": 1.0, "clip-count": 1.0}


@dataclass(frozen=True)
class DIFF2Plan(Plan):
    """DIFF2 (Murata & Suzuki 2023) with GD or BVR-L-SGD routine, record-level DP w.r.t. each client.

    ``dataset_size`` is the smallest local dataset size ``n_min`` (the per-client record count), ``clients``
    is ``P``, ``steps`` (communication rounds) is ``R`` and ``restart`` is ``T``. Streams:

    - ``"restart"``: the ``ceil(R/T)`` restart rounds; the server adds ``N(0, sigma1^2 C1^2 I)`` to the
      average over clients of full-batch clipped client means (sensitivity ``2 C1/(n P)`` under
      replace-one), so ``z = sigma1 * n * P``;
    - ``"difference"``: the other ``R - ceil(R/T)`` rounds, likewise with ``sigma2`` (radius
      ``C2 ||x_{r-1} - x_{r-2}||``);
    - ``"local"`` (BVR-L-SGD, ``local_steps = K > 1``): steps ``k = 2..K`` of the client chosen round-robin,
      on ``local_batch = b`` records drawn without replacement from its ``n`` records, noise
      ``sigma3 C3`` on the mean: ``z = sigma3 * b``. A record's client runs them in at most ``ceil(R/P)``
      rounds: ``(K - 1) ceil(R/P)`` releases (Proposition E.2 counts ``K ceil(R/P)``).

    Guarantee: adaptive composition of these Gaussian releases (Lemma C.1, Lemma E.1 and Proposition 4.1 /
    E.2 of the paper), conditioned on released iterates. Replace-one only: the server rounds are full-batch
    means divided by the shard sizes, which add/remove adjacency makes private (refused).
    """

    _all_streams: ClassVar = ("restart", "difference", "local")

    dataset_size: int
    clients: int
    steps: int
    restart: int
    local_steps: int = 1
    local_batch: int | None = None
    neighbouring: str = REPLACE_ONE

    def __post_init__(self) -> None:
        _checks.count("dataset_size", self.dataset_size, minimum=1)
        _checks.count("clients", self.clients, minimum=1)
        _checks.count("steps", self.steps)
        _checks.count("restart", self.restart, minimum=1)
        _checks.count("local_steps", self.local_steps, minimum=1)
        if self.local_steps > 1:
            _checks.count("local_batch", self.local_batch, minimum=1)
        check_neighbouring(self.neighbouring)
        self._refuse_private_size()  # first: the server rounds refuse add/remove whatever the local steps
        if self.local_steps > 1:
            _check_relation(self.neighbouring, self.local_sampling)

    @property
    def restarts(self) -> int:
        return _ceil_div(self.steps, self.restart)

    @property
    def local_sampling(self) -> Sampling:
        return Sampling.make("wor", batch_size=self.local_batch, dataset_size=self.dataset_size)

    def _streams(self, noise):
        streams = _stream(noise, "restart", self.restarts) + _stream(
            noise, "difference", self.steps - self.restarts
        )
        if self.local_steps > 1:
            count = (self.local_steps - 1) * _ceil_div(self.steps, self.clients)
            streams += _stream(noise, "local", count, self.local_sampling)
        return streams

    def _assumptions(self):
        notes = [
            _PER_SAMPLE,
            _SAME_SAMPLE,
            f"record-level DP w.r.t. each client's data; n_min = {self.dataset_size}, {self.clients} clients",
        ]
        if self.local_steps > 1:
            notes.append(f"local: {self.local_sampling.describe()}; clients chosen round-robin")
        return tuple(notes)

    def _unit(self, stream: str) -> float:
        # sigma times the clip radius is the noise std on a mean over n P records (local: over b records).
        return float(self.local_batch if stream == "local" else self.dataset_size * self.clients)

    def exposures(self) -> dict[str, float]:
        # a restart is carried until the next; differences accumulate; a local step's draws last its round
        carried = {
            "restart": 1.0,
            "difference": _accumulated(self.steps, self.restart),
            "local": (self.local_steps - 1) / 2,
        }
        return {s: carried[s] for s in self.streams}

    def paper_noise(
        self, epsilon: float, delta: float, *, u: float = 1.25, u1: float = 3.0, u2: float = 3.0
    ) -> dict[str, float]:
        """Proposition 4.1 (GD; budget split ``u``) or Proposition E.2 (BVR-L-SGD; ``u1``, ``u2``).

        With ``alpha = 1 + ceil(2 log(1/delta)/epsilon)``, ``N = n P`` and ``R1 = ceil(R/T)``:

        - GD: ``sigma1^2 = 4 u alpha R1 / (N^2 eps)``, ``sigma2^2 = 4u/(u-1) alpha (R - R1) / (N^2 eps)``
          (``u = 1`` with ``T = 1`` is the paper's DP-GD);
        - BVR-L-SGD: ``sigma1^2 = 4 u1 alpha R1 / (N^2 eps)``, ``sigma2^2 = 4 u2 alpha (R - R1) / (N^2 eps)``
          and the explicit
          ``sigma3^2 = max((8/3)(4+e) alpha^2/(alpha-1) c K ceil(R/P) / (n^2 eps), 6 alpha / b^2)``
          with ``c = 2/(1 - 1/u1 - 1/u2)`` (``c = 6`` for the paper's ``u1 = u2 = 3``), valid for
          ``b <= min(n/(2 e alpha), (4 n/(alpha sigma3^2))^(1/3))``.
        """
        epsilon = _checks.positive("epsilon", epsilon)
        delta = _checks.delta(delta)
        alpha = _alpha(epsilon, delta)
        big_n2 = (self.dataset_size * self.clients) ** 2
        rest, diff = self.restarts, self.steps - self.restarts
        if self.local_steps == 1:
            # u > 1 splits the budget; with no difference rounds (T = 1: DP-GD) the paper takes u -> 1.
            if not (u > 1 or (u == 1 and diff == 0)):
                raise ValueError(f"u must be > 1 (or 1 when restart = 1), got {u}")
            sigma2 = {"restart": 4 * u * alpha * rest / (big_n2 * epsilon)}
            if diff:
                sigma2["difference"] = 4 * u / (u - 1) * alpha * diff / (big_n2 * epsilon)
        else:
            spare = 1 - 1 / u1 - 1 / u2
            if not (u1 > 1 and u2 > 1 and spare > 0):
                raise ValueError(f"u1, u2 must exceed 1 with 1 - 1/u1 - 1/u2 > 0, got u1={u1}, u2={u2}")
            n, k_rounds = self.dataset_size, self.local_steps * _ceil_div(self.steps, self.clients)
            local = max(
                8 / 3 * (4 + math.e) * alpha**2 / (alpha - 1) * (2 / spare) * k_rounds / (n**2 * epsilon),
                6 * alpha / self.local_batch**2,
            )
            limit = min(n / (2 * math.e * alpha), (4 * n / (alpha * local)) ** (1 / 3))
            if self.local_batch > limit:
                raise ValueError(
                    f"Proposition E.2's closed form needs local_batch <= {limit:.4g}, got {self.local_batch}"
                )
            sigma2 = {
                "restart": 4 * u1 * alpha * rest / (big_n2 * epsilon),
                "difference": 4 * u2 * alpha * diff / (big_n2 * epsilon),
                "local": local,
            }
        return {name: self.noise_multiplier(math.sqrt(sigma2[name]), name) for name in self.streams}


@dataclass(frozen=True)
class DPSGDAPlan(Plan):
    """DP-SGDA (Yang et al. 2022, as restated by the PrivateDiff paper): streams ``"x"`` and ``"y"``.

    Each of ``steps`` steps draws one batch of ``batch_size`` records and releases the clipped x-gradient
    mean plus ``N(0, sigma_x^2 C1^2 I)`` and the clipped y-gradient mean plus ``N(0, sigma_y^2 C2^2 I)``:
    ``z = sigma * batch_size`` for each. On a shared batch (``shared_batch=True``, as in the paper) the two
    are one release with ``1/z^2 = 1/z_x^2 + 1/z_y^2``.

    Guarantee: composition of ``steps`` sampled Gaussian releases.
    """

    _vectors: ClassVar = {"y": "y"}

    dataset_size: int
    batch_size: int
    steps: int
    sampling: str = "wor"
    shared_batch: bool = True
    neighbouring: str = REPLACE_ONE

    def __post_init__(self) -> None:
        _checks.count("steps", self.steps)
        _check_relation(self.neighbouring, self.batch_sampling)
        self._refuse_private_size()

    @property
    def batch_sampling(self) -> Sampling:
        return Sampling.make(self.sampling, batch_size=self.batch_size, dataset_size=self.dataset_size)

    def _streams(self, noise):
        group = "xy" if self.shared_batch else None
        return _stream(noise, "x", self.steps, self.batch_sampling, group) + _stream(
            noise, "y", self.steps, self.batch_sampling, group
        )

    def _assumptions(self):
        batches = "one shared batch per step" if self.shared_batch else "independent batches for x and y"
        return (_PER_SAMPLE, f"x, y: {self.batch_sampling.describe()}; {batches}")

    def _unit(self, stream: str) -> float:
        # sigma times the clip norm is the noise std on the batch mean.
        return float(self.batch_size)

    def exposures(self) -> dict[str, float]:
        return {"x": 1.0, "y": 1.0}  # one-step releases

    def paper_noise(self, epsilon: float, delta: float) -> dict[str, float]:
        """The practical constants: ``sigma_x = sigma_y = 8 sqrt(T log(1/delta)) / (n epsilon)``.

        Stated for ``epsilon <= 1``, ``delta <= 1/n^2`` and ``m = max(1, n sqrt(epsilon/(4T)))``; ``T`` is
        taken as ``steps``.
        """
        epsilon = _checks.positive("epsilon", epsilon)
        delta = _checks.delta(delta)
        _paper_regime("DP-SGDA", epsilon, delta, self.dataset_size)
        sigma = 8 * math.sqrt(self.steps * math.log(1 / delta)) / (self.dataset_size * epsilon)
        return {name: self.noise_multiplier(sigma, name) for name in self.streams}


@dataclass(frozen=True)
class PrivateDiffPlan(Plan):
    """PrivateDiff Minimax (Zhang et al.): streams ``"checkpoint"``, ``"difference"`` and ``"y"``.

    ``steps`` outer rounds ``R`` with checkpoints every ``restart = T`` rounds; each x-release is a clipped
    mean over a batch of ``batch_size = m`` plus ``N(0, sigma_x^2 C^2 I)`` (``z = sigma_x * m``).

    The ascent output ``y_{r+1}`` feeds the next x-gradients, so it must be private. ``y_release``:

    - ``"ascent"`` (dpvr's choice): ``y_steps = T2`` noisy clipped ascent steps per round, each a sampled
      Gaussian release on ``m`` records (``z = sigma_y * m`` with noise ``sigma_y C0`` on the mean);
    - ``"output"`` (the paper's form): one Gaussian output perturbation of ``y_{r+1}`` per round, unsampled,
      with ``z`` relative to a *worst-case* replace-one sensitivity of ``y_{r+1}`` (see
      :func:`output_perturbation_multiplier`; the paper's uniform-stability bound is an expectation, so
      dpvr's algorithm solves the inner problem over all ``n`` records to a certified tolerance ``tau`` and
      uses ``gradient_range / (n mu) + 2 tau``). ``y_steps`` then only caps the solver's iterations.

    Guarantee: adaptive composition of all three streams.
    """

    _all_streams: ClassVar = ("checkpoint", "difference", "y")
    _vectors: ClassVar = {"y": "y"}

    dataset_size: int
    batch_size: int
    steps: int
    restart: int
    y_steps: int = 1
    sampling: str = "wor"
    y_release: str = "ascent"
    neighbouring: str = REPLACE_ONE

    def __post_init__(self) -> None:
        _checks.count("steps", self.steps)
        _checks.count("restart", self.restart, minimum=1)
        _checks.count("y_steps", self.y_steps, minimum=1)
        if self.y_release not in ("ascent", "output"):
            raise ValueError(f"y_release must be 'ascent' or 'output', got {self.y_release!r}")
        _check_relation(self.neighbouring, self.batch_sampling)
        self._refuse_private_size()

    @property
    def batch_sampling(self) -> Sampling:
        return Sampling.make(self.sampling, batch_size=self.batch_size, dataset_size=self.dataset_size)

    @property
    def checkpoints(self) -> int:
        return _ceil_div(self.steps, self.restart)

    def _streams(self, noise):
        streams = _stream(noise, "checkpoint", self.checkpoints, self.batch_sampling) + _stream(
            noise, "difference", self.steps - self.checkpoints, self.batch_sampling
        )
        if self.y_release == "ascent":
            return streams + _stream(noise, "y", self.steps * self.y_steps, self.batch_sampling)
        return streams + _stream(noise, "y", self.steps)

    def _assumptions(self):
        y = (
            f"y: {self.y_steps} noisy clipped ascent steps per round, {self.batch_sampling.describe()}"
            if self.y_release == "ascent"
            else "y: one output perturbation per round of y solved over all records; noise multiplier "
            "relative to a worst-case sensitivity"
        )
        return (_PER_SAMPLE, _SAME_SAMPLE, f"x: {self.batch_sampling.describe()}", y)

    def _unit(self, stream: str) -> float:
        # x (and ascent y): sigma times the clip radius is the noise std on the batch mean; output y: sigma is
        # the noise std over y's replace-one sensitivity, twice dpvr's unit.
        if stream == "y" and self.y_release == "output":
            return output_perturbation_multiplier(1.0, 1.0, self.neighbouring)
        return float(self.batch_size)

    def exposures(self) -> dict[str, float]:
        # Lemma 12: T2 ascent steps carry their noise into y's error over T2; an output perturbation, once
        carried = {
            "checkpoint": 1.0,
            "difference": _accumulated(self.steps, self.restart),
            "y": 1.0 / self.y_steps if self.y_release == "ascent" else 1.0,
        }
        return {s: carried[s] for s in self.streams}

    def paper_noise(self, epsilon: float, delta: float) -> dict[str, float]:
        """Remark 5.1, with ``L = log(1/delta)``: ``sigma_x1 = 4 sqrt((R/T) L) / (n eps)``,
        ``sigma_x2 = 4 sqrt(R L) / (n eps)``, ``sigma_y = 4 (2 C0^2 + beta M) sqrt(R L) / (mu n eps)``, i.e.
        ``4 sqrt(R L) / eps`` times the y-output sensitivity ``(2 C0^2 + beta M)/(mu n)``.

        Stated for ``epsilon <= 1``, ``delta <= 1/n^2`` and ``m = max(1, n sqrt(epsilon/(8T)))``. Remark 5.1
        prices y as one output perturbation per round, so it applies only with ``y_release="output"``.
        """
        epsilon = _checks.positive("epsilon", epsilon)
        delta = _checks.delta(delta)
        if self.y_release != "output":
            raise ValueError(
                "Remark 5.1 prices y as one output perturbation per round; with y_release='ascent' "
                "there is no closed form (use calibration='tight' or y_release='output')"
            )
        _paper_regime("PrivateDiff (Remark 5.1)", epsilon, delta, self.dataset_size)
        log_term = math.log(1 / delta)
        n, r = self.dataset_size, self.steps
        sigma = {
            "checkpoint": 4 * math.sqrt(r / self.restart * log_term) / (n * epsilon),
            "difference": 4 * math.sqrt(r * log_term) / (n * epsilon),
        }
        sigma["y"] = 4 * math.sqrt(r * log_term) / epsilon
        return {k: self.noise_multiplier(v, k) for k, v in sigma.items() if k in self.streams}


@dataclass(frozen=True)
class _SpiderPlan(Plan):
    """Refresh-every-``q`` SPIDER estimators with one noise stream per estimator and per phase.

    ``restart`` is ``q``, the period of the refresh steps (``t mod q = 0``); ``steps`` is ``T``. A stream
    whose batch is the whole dataset is a full-batch mean divided by ``n``: replace-one only.

    ``batch_sizes`` maps each stream of the layout to its batch size; a sequence is read in the paper's order
    (``N1..N4`` / ``b1..b4``) and stored keyed by stream name, so a stream with no releases (``q = 1`` has no
    difference rounds) never shifts another stream's batch size.
    """

    dataset_size: int
    steps: int
    restart: int
    batch_sizes: Mapping[str, int] | tuple[int, ...]
    sampling: str = "wor"
    neighbouring: str = REPLACE_ONE

    _layout: ClassVar[tuple[tuple[str, str], ...]] = ()  # (stream, "refresh" | "difference" | "every")
    _fixed_batches: ClassVar[Mapping[str, int]] = {}  # streams whose batch size the algorithm fixes

    def __post_init__(self) -> None:
        _checks.count("dataset_size", self.dataset_size, minimum=1)
        _checks.count("steps", self.steps)
        _checks.count("restart", self.restart, minimum=1)
        object.__setattr__(self, "batch_sizes", self._keyed(self.batch_sizes))
        _check_relation(self.neighbouring, *(self._sampling(b) for _, b in self.batch_sizes))
        self._refuse_private_size()

    def _keyed(self, given: Mapping[str, int] | tuple[int, ...]) -> tuple[tuple[str, int], ...]:
        names = [name for name, _ in self._layout if name not in self._fixed_batches]
        plan = type(self).__name__
        if isinstance(given, Mapping):
            sizes = dict(given)
        elif given and all(isinstance(item, tuple) for item in given):
            sizes = dict(given)  # already keyed (a plan rebuilt from its own fields)
        else:
            given = tuple(given)
            if len(given) != len(names):
                raise ValueError(
                    f"{plan} needs {len(names)} batch sizes ({', '.join(names)}), got {len(given)}"
                )
            sizes = dict(zip(names, given))
        sizes = {k: v for k, v in sizes.items() if k not in self._fixed_batches}
        if set(sizes) != set(names):
            raise ValueError(f"{plan}: batch_sizes must name the streams {names}, got {sorted(sizes)}")
        for name in names:
            _checks.count(f"batch size of stream {name!r}", sizes[name], minimum=1)
            if sizes[name] > self.dataset_size:
                raise ValueError(
                    f"batch size of stream {name!r} ({sizes[name]}) exceeds dataset_size "
                    f"({self.dataset_size})"
                )
        sizes.update(self._fixed_batches)
        return tuple((name, int(sizes[name])) for name, _ in self._layout)

    @property
    def stream_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self._layout)

    def batch_size(self, stream: str) -> int:
        """The batch size every release of ``stream`` draws."""
        return dict(self.batch_sizes)[stream]

    def stream_sampling(self, stream: str) -> Sampling:
        """How every release of ``stream`` draws its records (the whole dataset is a full batch)."""
        return self._sampling(self.batch_size(stream))

    def _sampling(self, batch: int) -> Sampling:
        if batch == self.dataset_size:
            return FULL_BATCH
        return Sampling.make(self.sampling, batch_size=batch, dataset_size=self.dataset_size)

    def exposures(self) -> dict[str, float]:
        phase = dict(self._layout)
        carried = {"refresh": 1.0, "difference": _accumulated(self.steps, self.restart), "every": 1.0}
        return {s: carried[phase[s]] for s in self.streams}

    def stream_scale(self, stream: str) -> float:
        # the noise multipliers are per record: the released mean divides the noise std by the batch size
        return 1.0 / self.batch_size(stream)

    def _streams(self, noise):
        refreshes = _ceil_div(self.steps, self.restart)
        counts = {"refresh": refreshes, "difference": self.steps - refreshes, "every": self.steps}
        streams = []
        for name, phase in self._layout:
            streams += _stream(noise, name, counts[phase], self.stream_sampling(name))
        return streams

    def _assumptions(self):
        batches = ", ".join(f"{name}: {self.stream_sampling(name).describe()}" for name, _ in self._layout)
        return (
            _PER_SAMPLE,
            _SAME_SAMPLE,
            f"refresh at steps t with t mod {self.restart} = 0",
            batches,
            "all streams composed in one accountant (the paper calibrates each to the full budget)",
        )


@dataclass(frozen=True)
class DoubleSpiderPlan(_SpiderPlan):
    """DP Double-SPIDER (DRO, general psi-divergence): four streams.

    ``"eta-refresh"``/``"eta-difference"`` (the dual variable's estimator, batches ``N1``/``N2``) and
    ``"x-refresh"``/``"x-difference"`` (the model's, ``N3``/``N4``); refreshes at ``ceil(T/q)`` steps,
    differences at the others; a batch equal to the dataset size is a full batch. Clipping is per sample
    (the printed Algorithm 2 clips the batch mean, which is not DP).

    Guarantee: composition of all four streams' sampled Gaussian releases in one accountant.
    """

    _layout: ClassVar = (
        ("eta-refresh", "refresh"),
        ("eta-difference", "difference"),
        ("x-refresh", "refresh"),
        ("x-difference", "difference"),
    )
    _vectors: ClassVar = {"eta-refresh": "scalar", "eta-difference": "scalar"}  # the dual eta


@dataclass(frozen=True)
class RecursiveSpiderPlan(_SpiderPlan):
    """DP Recursive-SPIDER (KL-DRO, compositional form): five streams.

    ``"v-refresh"``/``"v-difference"`` (the x-gradient of the inner function, batches ``b1``/``b2``),
    ``"u-refresh"``/``"u-difference"`` (its lambda-gradient, ``b3``/``b4``) and ``"s"`` (the STORM estimate of
    the inner function value from one record per step).

    For ``"s"`` the released value is one record's STORM term ``Clip(g(w_t)) - (1 - beta) Clip(g(w_{t-1}))``
    with ``0 <= Clip(g) <= C5``: it lies in ``[-(1 - beta) C5, C5]``, so replacing the record moves it by at
    most the range ``(2 - beta) C5``. In dpvr's convention (the replace-one accountant charges twice the
    unit) the unit is half of that, ``(2 - beta) C5 / 2``: noise std ``z (2 - beta) C5 / 2``. Under
    add/remove (a plan for accounting only: the algorithm is replace-one) adding a record moves the sum by
    its term, at most ``C5`` in absolute value, which is then the unit.

    Guarantee: composition of all five streams' sampled Gaussian releases in one accountant.
    """

    _layout: ClassVar = (
        ("v-refresh", "refresh"),
        ("v-difference", "difference"),
        ("u-refresh", "refresh"),
        ("u-difference", "difference"),
        ("s", "every"),
    )
    _fixed_batches: ClassVar = {"s": 1}
    _vectors: ClassVar = {"u-refresh": "scalar", "u-difference": "scalar", "s": "scalar"}  # u, s: of lambda


_PHASED = {  # setting -> (streams, budget share of each release, share of delta per release)
    "sc": (("x",), 1.0, 0.5),
    "c": (("x",), 1.0, 0.5),
    "c-sc": (("x",), 1.0, 0.5),
    "sc-sc": (("x", "y"), 0.5, 0.25),
    "c-c": (("x", "y"), 0.5, 0.25),
}


@dataclass(frozen=True)
class PhasedPlan(Plan):
    """The phased output-perturbation framework of "bring your own algorithm" (Zhang, Thekumparampil, Oh, He).

    ``setting``: ``"sc"`` (Algorithm 1), ``"c"`` (Algorithm 2, phases on disjoint chunks), ``"sc-sc"``
    (Algorithm 3: x and y), ``"c-c"`` (Algorithms 4 and 5, each on all the data, each phased) or ``"c-sc"``.
    Each stream is one Gaussian output perturbation ``x + N(0, sigma^2 I)`` whose noise multiplier is
    relative to the replace-one sensitivity of the base solver's output (``4L/(mu n)`` for Algorithm 1,
    ``4L/(n sqrt(mu_x mu))`` for Algorithm 3, per phase with ``mu_k`` and ``n/K`` in the phased ones); use
    :func:`output_perturbation_multiplier`. The phases of one run touch disjoint chunks, so by parallel
    composition a run costs one release whatever ``K`` is.

    The sensitivity holds only if the base solver reached its accuracy target: with a certificate (dpvr's
    default) it holds surely; otherwise pass the paper's ``failure_probability`` (added to delta).
    """

    _vectors: ClassVar = {"y": "y"}

    setting: str
    failure_probability: float = 0.0
    neighbouring: str = REPLACE_ONE

    def __post_init__(self) -> None:
        if self.setting not in _PHASED:
            raise ValueError(f"setting must be one of {tuple(_PHASED)}, got {self.setting!r}")
        if not 0 <= self.failure_probability < 1:
            raise ValueError(f"failure_probability must lie in [0, 1), got {self.failure_probability!r}")
        if check_neighbouring(self.neighbouring) != REPLACE_ONE:
            raise ValueError(
                "the phased framework's sensitivities are replace-one stability bounds; "
                "neighbouring must be 'replace-one'"
            )

    def _streams(self, noise):
        return [Stream(name, noise.get(name, 1.0), 1) for name in _PHASED[self.setting][0]]

    def _failure_probability(self) -> float:
        return self.failure_probability

    def exposures(self) -> dict[str, float]:
        return dict.fromkeys(self.streams, 1.0)  # one output perturbation per stream

    def _unit(self, stream: str) -> float:
        # sigma is the noise std over the replace-one sensitivity, twice dpvr's unit.
        return output_perturbation_multiplier(1.0, 1.0, self.neighbouring)

    def _assumptions(self):
        notes = [
            "the base solver's output is within its accuracy target of the regularised optimum "
            "(certified, or with the stated failure probability)"
        ]
        if self.setting in ("c", "c-c", "c-sc"):
            notes.append("phases use disjoint chunks of the data (parallel composition)")
        return tuple(notes)

    def paper_noise(self, epsilon: float, delta: float, *, gaussian: str = "classic") -> dict[str, float]:
        """The paper's noise: each release gets ``(epsilon', delta') = (epsilon, delta/2)`` (one release) or
        ``(epsilon/2, delta/4)`` (x and y); the rest of delta covers the solver's failure probability.

        ``gaussian="classic"`` is the paper's ``sigma/Delta = sqrt(2 log(1.25/delta'))/epsilon'`` (stated for
        ``epsilon < 1``); ``"analytic"`` is Balle and Wang's exact Gaussian mechanism at the same split
        (dp_accounting's ``get_sigma_gaussian``).
        """
        epsilon = _checks.positive("epsilon", epsilon)
        delta = _checks.delta(delta)
        names, eps_share, delta_share = _PHASED[self.setting]
        eps_r, delta_r = epsilon * eps_share, delta * delta_share
        if gaussian == "classic":
            if epsilon >= 1:
                raise ValueError(
                    f"the classic Gaussian mechanism is stated for epsilon < 1, got {epsilon}; "
                    "use gaussian='analytic'"
                )
            ratio = math.sqrt(2 * math.log(1.25 / delta_r)) / eps_r
        elif gaussian == "analytic":
            ratio = dpa.get_sigma_gaussian(eps_r, delta_r)
        else:
            raise ValueError(f"gaussian must be 'classic' or 'analytic', got {gaussian!r}")
        return {name: self.noise_multiplier(ratio, name) for name in names}


__all__ = [
    "DIFF2Plan",
    "DPSGDPlan",
    "DPSGDAPlan",
    "DoubleSpiderPlan",
    "PhasedPlan",
    "Plan",
    "PrivateDiffPlan",
    "RecursiveSpiderPlan",
    "output_perturbation_multiplier",
]
