"""What an algorithm releases: noise streams, how each release samples its records, and the DpEvents.

A :class:`Stream` is one named noise source of an algorithm (DIFF2's restart rounds, PrivateDiff's y
steps, ...): ``count`` identical releases, each a Gaussian mechanism with noise multiplier
``noise_multiplier`` (dpvr's convention: noise std over the L2 bound on one record's contribution to the
released sum; see :mod:`dpvr.privacy.relations`) on a batch drawn by its :class:`Sampling`. Streams with the
same ``group`` are released on *one* shared batch in the same step (DP-SGDA's x and y updates): their
releases form one Gaussian on the concatenated vector, with ``1/z**2 = sum_i 1/z_i**2``. Accounting them as
independently sampled releases would under-count. A stream with ``zcdp_unit`` set is an RDP curve linear in
the order (the last-iterate bounds): each release costs ``rho * alpha`` with
``rho = zcdp_unit / noise_multiplier**2``.

A :class:`Mechanism` is the whole run: its streams, the neighbouring relation they were derived under, the
assumptions the guarantee rests on, and an optional failure probability added to delta (a sensitivity
bound that holds only with high probability).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction

import dp_accounting as dpa

from . import _checks
from .random_allocation import RandomAllocationDpEvent
from .relations import ADD_REMOVE, REPLACE_ONE, check_neighbouring

SCHEMES = ("poisson", "wor", "full", "random-allocation")


@dataclass(frozen=True)
class Sampling:
    """How the records of one release are drawn.

    ``"poisson"``: each record independently with probability ``rate``; ``"wor"``: a uniformly random
    subset of ``batch_size = rate * dataset_size`` records without replacement (accounted under replace-one
    only: the dataset size is public); ``"full"``: every record (``rate`` = 1); ``"random-allocation"``:
    epochs of ``t = 1 / rate`` steps in which every record is used in exactly one step, chosen uniformly at
    random (balls-in-bins; accounted under add/remove only, by epoch:
    :mod:`dpvr.privacy.random_allocation`).
    """

    scheme: str = "full"
    rate: float = 1.0
    dataset_size: int | None = None

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"sampling must be one of {SCHEMES}, got {self.scheme!r}")
        _checks.rate("sample_rate", self.rate)
        if self.scheme == "full" and self.rate != 1.0:
            raise ValueError(f"sample_rate must be 1 for full-batch sampling, got {self.rate!r}")
        if self.scheme == "wor":
            n = _checks.count("dataset_size", self.dataset_size, minimum=1)
            batch = self.rate * n
            if abs(batch - round(batch)) > 1e-9 * n:
                raise ValueError(f"sample_rate * dataset_size must be an integer batch size, got {batch!r}")
        steps = 1 / self.rate
        if self.scheme == "random-allocation" and abs(steps - round(steps)) > 1e-9 * steps:
            raise ValueError(f"sample_rate must be 1/t for t steps per epoch, got {self.rate!r}")

    @classmethod
    def make(
        cls,
        scheme: str,
        *,
        sample_rate: float | None = None,
        batch_size: int | None = None,
        dataset_size: int | None = None,
    ) -> Sampling:
        """Build from whichever of rate / batch size / dataset size the caller has.

        For ``"wor"`` without a dataset size, the rate is written as an exact fraction ``b/n`` (dp_accounting
        only uses ``b/n``). For ``"random-allocation"`` an epoch has ``t = round(n / b)`` steps (expected
        batch ``n / t``), or ``t = 1 / sample_rate``.
        """
        if scheme == "full":
            if batch_size is not None and dataset_size is not None and batch_size != dataset_size:
                raise ValueError(
                    f"full-batch sampling uses every record: batch_size ({batch_size}) must equal "
                    f"dataset_size ({dataset_size})"
                )
            return cls("full")
        if batch_size is not None:
            batch_size = _checks.count("batch_size", batch_size, minimum=1)
            dataset_size = _checks.count("dataset_size", dataset_size, minimum=batch_size)
            if scheme == "random-allocation":
                return cls(scheme, 1 / max(1, round(dataset_size / batch_size)))
            return cls(scheme, batch_size / dataset_size, dataset_size if scheme == "wor" else None)
        if sample_rate is None:
            raise ValueError(
                f"sample_rate (or batch_size and dataset_size) is required for {scheme!r} sampling"
            )
        q = _checks.rate("sample_rate", sample_rate)
        if scheme == "wor" and dataset_size is None:
            dataset_size = Fraction(q).limit_denominator(10**9).denominator
        return cls(scheme, q, dataset_size if scheme == "wor" else None)

    @property
    def batch_size(self) -> int | None:
        """The fixed batch size for ``"wor"``, else ``None``."""
        return round(self.rate * self.dataset_size) if self.scheme == "wor" else None

    @property
    def steps_per_epoch(self) -> int | None:
        """``t`` for ``"random-allocation"``, else ``None``."""
        return round(1 / self.rate) if self.scheme == "random-allocation" else None

    def check(self, neighbouring: str) -> None:
        """Refuse a relation this sampling scheme cannot be accounted under."""
        if self.scheme == "wor" and check_neighbouring(neighbouring) == ADD_REMOVE:
            raise ValueError(
                "sampling='wor' (fixed-size, without replacement) is accounted only under "
                "neighbouring='replace-one'; use sampling='poisson' for add/remove"
            )
        if self.scheme == "random-allocation" and check_neighbouring(neighbouring) == REPLACE_ONE:
            raise ValueError(
                "sampling='random-allocation' is accounted only under neighbouring='add-remove' (a replaced "
                "record's two values share one random step, for which no dominating pair is known)"
            )

    def wrap(self, event: dpa.DpEvent) -> dpa.DpEvent:
        """``event`` applied to a batch drawn by this scheme."""
        if self.scheme == "poisson":
            return dpa.PoissonSampledDpEvent(self.rate, event)
        if self.scheme == "wor":
            return dpa.SampledWithoutReplacementDpEvent(self.dataset_size, self.batch_size, event)
        if self.scheme == "random-allocation":
            return RandomAllocationDpEvent(self.steps_per_epoch, event)
        return event

    def describe(self) -> str:
        if self.scheme == "poisson":
            return f"Poisson sampling, rate {self.rate:g}"
        if self.scheme == "wor":
            return f"fixed batches of {self.batch_size} of {self.dataset_size} without replacement"
        if self.scheme == "random-allocation":
            return f"random allocation: each record in one random step of every {self.steps_per_epoch}"
        return "full batch"


FULL_BATCH = Sampling()


@dataclass(frozen=True)
class Stream:
    """One noise stream: ``count`` releases with noise multiplier ``noise_multiplier`` (see module doc)."""

    name: str
    noise_multiplier: float
    count: int
    sampling: Sampling = FULL_BATCH
    group: str | None = None
    zcdp_unit: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("stream name must be non-empty")
        _checks.positive(f"noise multiplier of stream {self.name!r}", self.noise_multiplier)
        _checks.count(f"count of stream {self.name!r}", self.count)
        if self.zcdp_unit is not None:
            _checks.non_negative(f"zcdp_unit of stream {self.name!r}", self.zcdp_unit)
            if self.sampling.scheme != "full" or self.group is not None:
                raise ValueError(f"stream {self.name!r}: an RDP-curve stream takes no sampling or group")


@dataclass(frozen=True)
class Release:
    """The releases of one stream, or of one group of streams sharing a batch, as one DpEvent source.

    ``parts`` attributes the release's cost to stream names: by the precision ``1/z_i**2`` of each member
    (which is exact for full-batch Gaussians, where the RDP is linear in ``1/z**2``).
    """

    parts: tuple[tuple[str, float], ...]
    noise_multiplier: float
    count: int
    sampling: Sampling = FULL_BATCH
    zcdp_unit: float | None = None

    def step_event(self, noise_multiplier: float | None = None) -> dpa.DpEvent:
        """One release, with this release's noise multiplier or the one given."""
        z = self.noise_multiplier if noise_multiplier is None else noise_multiplier
        if self.zcdp_unit is not None:
            return dpa.ZCDpEvent(rho=self.zcdp_unit / z**2)
        return self.sampling.wrap(dpa.GaussianDpEvent(z))

    @property
    def event(self) -> dpa.DpEvent:
        """All ``count`` releases."""
        return dpa.SelfComposedDpEvent(self.step_event(), self.count)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.parts)


@dataclass(frozen=True)
class Mechanism:
    """A whole run: its noise streams and the conditions its guarantee rests on."""

    streams: tuple[Stream, ...]
    neighbouring: str = "replace-one"
    assumptions: tuple[str, ...] = ()
    failure_probability: float = 0.0
    _releases: tuple[Release, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_neighbouring(self.neighbouring)
        names = [s.name for s in self.streams]
        if len(set(names)) != len(names):
            raise ValueError(f"stream names must be unique, got {names}")
        if not 0 <= self.failure_probability < 1:
            raise ValueError(f"failure_probability must lie in [0, 1), got {self.failure_probability!r}")
        for stream in self.streams:
            stream.sampling.check(self.neighbouring)
        object.__setattr__(self, "_releases", tuple(self._group()))

    def _group(self):
        groups: dict[str, list[Stream]] = {}
        for stream in self.streams:
            if stream.group is None:
                yield Release(
                    ((stream.name, 1.0),),
                    stream.noise_multiplier,
                    stream.count,
                    stream.sampling,
                    stream.zcdp_unit,
                )
            else:
                groups.setdefault(stream.group, []).append(stream)
        for label, members in groups.items():
            first = members[0]
            if any(m.count != first.count or m.sampling != first.sampling for m in members):
                raise ValueError(f"streams of group {label!r} must share their count and sampling")
            precision = [m.noise_multiplier**-2 for m in members]
            total = math.fsum(precision)
            yield Release(
                tuple((m.name, p / total) for m, p in zip(members, precision)),
                total**-0.5,
                first.count,
                first.sampling,
            )

    @property
    def releases(self) -> tuple[Release, ...]:
        """Independent releases (a group of streams sharing a batch is one release)."""
        return self._releases

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.streams)

    @property
    def noise(self) -> dict[str, float]:
        """Noise multiplier of each stream."""
        return {s.name: s.noise_multiplier for s in self.streams}

    @property
    def event(self) -> dpa.DpEvent:
        """The whole run as one dp_accounting event (dpvr's noise-multiplier convention)."""
        return dpa.ComposedDpEvent([r.event for r in self.releases])

    def step(self, name: str) -> tuple[dict[str, float], dpa.DpEvent]:
        """``(attribution, event)`` of one release of stream ``name``, for ``Accountant.record``.

        For a stream in a group the release is the group's shared-batch release: record it once per step,
        not once per member.
        """
        for release in self.releases:
            if name in release.names:
                return dict(release.parts), release.step_event()
        raise ValueError(f"unknown stream {name!r}; streams are {self.names}")


def noise_dict(names: tuple[str, ...], noise: Mapping[str, float] | float) -> dict[str, float]:
    """Normalise a user's noise argument: a mapping with exactly ``names``, or one number for one stream."""
    if not isinstance(noise, Mapping):
        if len(names) != 1:
            raise ValueError(f"noise must map each of the streams {names} to a noise multiplier")
        noise = {names[0]: noise}
    missing = [n for n in names if n not in noise]
    unknown = [n for n in noise if n not in names]
    if missing or unknown:
        raise ValueError(f"noise must give exactly the streams {names}; missing {missing}, unknown {unknown}")
    return {n: _checks.positive(f"noise multiplier of stream {n!r}", noise[n]) for n in names}
