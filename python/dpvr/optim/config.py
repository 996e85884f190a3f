"""The two settings groups every algorithm shares: how it is accounted and how it runs.

Each algorithm's own settings (learning rates, steps, restart period, batch sizes, ``clip={stream: C}``,
``noise={stream: z}``) are keyword arguments of its constructor, named alike across algorithms; these two
groups are what is left over, declared once here instead of in every constructor.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ..ops import NoiseGenerator, PredictableNoiseError, check_nonfinite
from ..privacy.relations import ACCOUNTANTS, ADD_REMOVE, REPLACE_ONE, check_neighbouring
from .gradients import MODES, ClippedGradients

CALIBRATIONS = ("tight", "paper")


@dataclass(frozen=True)
class PrivacyConfig:
    """The privacy target and how it is accounted.

    Attributes:
        epsilon: the budget. With ``noise`` not given, the algorithm calibrates its noise so that the planned
            run spends exactly this; in every case a release that would exceed it raises
            :class:`~dpvr.optim.BudgetExhaustedError` before it happens. ``None`` (default): no budget
            (``noise`` required).
        delta: the target delta of every report and of the budget; default ``1e-5``.
        accountant: ``"rdp"`` or ``"pld"`` (dp_accounting's, with dpvr's PLDs for fixed-size batches and
            random allocation), the one that records and calibrates the run; ``None`` (default): the tightest
            the run's plan supports: PLD when it prices every release (Gaussians on Poisson,
            fixed-size-without-replacement, random-allocation and full batches), else RDP (e.g. the
            last-iterate bounds' RDP curves, a fixed-size batch of a non-Gaussian release). For fixed-size
            batches RDP needs about twice PLD's noise; ``"rdp"`` stays available, and is faster to calibrate
            (milliseconds against a few tenths of a second).
        calibration: ``"tight"`` (default: the accountant's smallest noise for ``epsilon``) or ``"paper"``
            (the paper's closed form, where the algorithm has one).
        shares: how a multi-stream calibration splits the budget (``{stream: weight}``); ``None`` (default):
            equal; ``"auto"``: the split that minimises the error proxy of :mod:`dpvr.privacy.allocation`
            (public inputs).
        neighbouring: ``"replace-one"`` or ``"add-remove"``; ``None`` (default) takes the algorithm's default:
            the relation its paper states; for Poisson DP-SGD add/remove when ``public_dataset_size`` is
            given, else replace-one (see below); random allocation is accounted under add/remove only.
        public_dataset_size: the dataset size ``N`` that is *public*: every quantity that shapes a release
            under add/remove (the sampling rate ``b / N``, random allocation's epoch ``round(N / b)`` and
            divisor, the steps an ``epochs`` count makes, the calibrated noise, theorem-derived defaults)
            reads ``N``, never the size of the data, which add/remove adjacency makes private (one record
            more or less must not change the shape of any release). Giving it asserts that ``N`` is known
            to everyone without looking at the data (a published dataset size, a size fixed by design), and
            the guarantee then holds for every dataset, of any size, the run is given. Under replace-one the
            size is public by definition (neighbours have the same size): there it must equal the data's.
            ``None`` (default): no public size; Poisson DP-SGD is then accounted under replace-one (where
            ``n`` is public), which needs more noise at the same epsilon (e.g. 2.84 against 1.83 at noise
            multiplier 1, rate 0.01, 1000 steps, delta 1e-5), and add/remove is refused.
        paper_options: the constants of ``calibration="paper"``'s closed form, e.g. DIFF2's ``{"u": 1.25}``;
            default none.

    Raises:
        ValueError: ``epsilon <= 0``, ``delta`` outside ``(0, 1)``, an unknown ``accountant``,
            ``calibration`` or ``neighbouring``, or ``public_dataset_size`` not a whole number >= 1.
    """

    epsilon: float | None = None
    delta: float = 1e-5
    accountant: str | None = None
    calibration: str = "tight"
    shares: Mapping[str, float] | Literal["auto"] | None = None
    neighbouring: str | None = None
    public_dataset_size: int | None = None
    paper_options: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.epsilon is not None and not self.epsilon > 0:
            raise ValueError(f"epsilon: must be > 0, got {self.epsilon}")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta: must be in (0, 1), got {self.delta}")
        if self.accountant is not None and self.accountant not in ACCOUNTANTS:
            raise ValueError(f"accountant: must be one of {ACCOUNTANTS}, got {self.accountant!r}")
        if self.calibration not in CALIBRATIONS:
            raise ValueError(f"calibration: must be one of {CALIBRATIONS}, got {self.calibration!r}")
        if self.neighbouring is not None:
            check_neighbouring(self.neighbouring)
        size = self.public_dataset_size
        whole = isinstance(size, numbers.Integral) and not isinstance(size, bool)
        if size is not None and not (whole and size >= 1):
            raise ValueError(f"public_dataset_size: must be a whole number >= 1, got {size!r}")

    def require_replace_one(self, name: str) -> None:
        """Refuses ``neighbouring="add-remove"`` for algorithm ``name``, whose batch sizes, sampling rates and
        divisors read the size of the data, which add/remove adjacency makes private (a neighbour's one
        record more would change the shape of every release). Under replace-one, the papers' relation and
        the default, the size is public by definition."""
        if self.neighbouring not in (None, REPLACE_ONE):
            raise ValueError(
                f"privacy: {name} is accounted under neighbouring='replace-one' only, got "
                f"neighbouring={self.neighbouring!r}: its sampling rates and divisors read the size of the "
                "data, which add/remove adjacency makes private"
            )

    def relation_and_size(
        self, records: int, *, default: str, sampling: str | None = None
    ) -> tuple[str, int]:
        """The neighbouring relation in force and the dataset size every release's shape reads, for a run
        over ``records`` records whose plan defaults to the relation ``default`` (for ``sampling``).

        Under replace-one the size is public by definition: the data's own ``records`` (a
        ``public_dataset_size`` that differs is refused). Under add/remove it is ``public_dataset_size``,
        never ``records``; without one, a plan that defaults to add/remove is accounted under replace-one
        where it can be (Poisson sampling) and refused where it cannot (random allocation), and an explicit
        ``neighbouring="add-remove"`` is refused.

        Raises:
            ValueError: as above, each with the fix.
        """
        stated = self.public_dataset_size
        relation = self.neighbouring or default
        if relation == ADD_REMOVE and sampling == "full":
            raise ValueError(
                "sampling='full' with neighbouring='add-remove': the full-batch mean divides by the dataset "
                "size, which is private under add/remove (it moves the mean by ~2C/n and changes the noise "
                "std); use neighbouring='replace-one' (n is public) or sampling='poisson'"
            )
        if relation == ADD_REMOVE and stated is None:
            if self.neighbouring is None and sampling != "random-allocation":
                if self.accountant == "rdp":
                    raise ValueError(
                        f"accountant='rdp' prices sampling={sampling!r} only under add/remove, where the "
                        "dataset size is private: state it public with public_dataset_size=N, or use "
                        "accountant='pld' (replace-one, the data's size public by definition)"
                    )
                relation = REPLACE_ONE
            else:
                what = f"sampling={sampling!r}" if self.neighbouring is None else "neighbouring='add-remove'"
                raise ValueError(
                    f"{what}: under add/remove adjacency the dataset size is private, and every release's "
                    "shape (sampling rate, epoch length, divisor, steps, noise) would read it; state the "
                    "size as public with PrivacyConfig(public_dataset_size=N) (make_private("
                    "public_dataset_size=N)), which asserts N is known without the data"
                    + ("" if sampling == "random-allocation" else ", or account under replace-one")
                )
        if relation == REPLACE_ONE:
            if stated is not None and stated != records:
                raise ValueError(
                    f"public_dataset_size={stated}: under replace-one the dataset size is public by "
                    f"definition and is the data's own ({records} records); neighbouring='add-remove' is the "
                    "relation in which a public size may differ from the data's"
                )
            return relation, records
        return relation, stated


@dataclass(frozen=True)
class RuntimeConfig:
    """How the algorithm computes; none of it changes the privacy guarantee, unless a seed is fixed.

    Attributes:
        grad_mode: ``"auto"`` (default: ghost clipping where the model allows, materialised per-sample
            gradients for the rest), ``"ghost"`` or ``"materialised"``.
        chunk_size: the physical batch, in records: every clipped sum is formed this many records at a time,
            in every gradient mode (ghost included), so that a step's peak memory is a micro-batch's whatever
            the logical (accounted) batch; the clipped sums add up over micro-batches and each logical step
            is still one release. ``None`` (default): the whole batch at once.
        generator: the noise source (:class:`~dpvr.NoiseGenerator`); ``None`` (default): seeded from the
            operating system. The algorithm binds it to its run, so give each algorithm its own.
        sampler_seed: fixes the batch sampling for reproducibility; ``None`` (default): seeded from the
            operating system. Sampling is part of the mechanism: anyone who knows the seed knows every
            batch, which voids amplification by sampling as a known noise seed voids the Gaussian
            mechanism. So it takes the same opt-in: it is accepted only with a reproducible ``generator``
            (``NoiseGenerator(seed, reproducible=True)``), which makes the whole run reproducible and
            predictable to whoever holds the seeds (keep them as confidential as the data).
        nonfinite: a record whose contribution is not finite contributes zero (``"zero"``, default: keeps
            every sensitivity bound) or raises :class:`dpvr.ops.NonFiniteError` (``"raise"``: for debugging
            only).
        all_reduce: under data parallelism, wraps each clipped-gradient engine the algorithm builds
            (:func:`dpvr.optim.gradients.clipped_gradients`) so that its sums are the whole batch's, every
            process holding a share of the records; set by :func:`dpvr.make_private` under a process group.
            ``None`` (default): one process. It changes where the terms of a sum are computed, not the sum
            (its rounding aside), so it is not bound in checkpoints.

    Raises:
        ValueError: an unknown ``grad_mode`` or ``nonfinite`` policy, or ``chunk_size < 1``.
        TypeError: ``generator`` is not a :class:`~dpvr.NoiseGenerator`.
        PredictableNoiseError: ``sampler_seed`` without a reproducible ``generator``.
    """

    grad_mode: str = "auto"
    chunk_size: int | None = None
    generator: NoiseGenerator | None = None
    sampler_seed: int | None = None
    nonfinite: str = "zero"
    all_reduce: Callable[[Any], Any] | None = None

    def __post_init__(self) -> None:
        if self.grad_mode not in MODES:
            raise ValueError(f"grad_mode: must be one of {MODES}, got {self.grad_mode!r}")
        if self.chunk_size is not None and not self.chunk_size >= 1:
            raise ValueError(f"chunk_size: must be >= 1, got {self.chunk_size}")
        if self.generator is not None and not isinstance(self.generator, NoiseGenerator):
            raise TypeError(f"generator: expected a dpvr NoiseGenerator, got {type(self.generator).__name__}")
        if self.sampler_seed is not None and not (self.generator is not None and self.generator.reproducible):
            raise PredictableNoiseError(
                "sampler_seed: a fixed sampler seed makes the batches predictable to anyone who knows it, "
                "which voids amplification by sampling; pass generator=NoiseGenerator(seed, "
                "reproducible=True) to opt into a reproducible run, or no sampler_seed for private sampling"
            )
        check_nonfinite(self.nonfinite)

    def clipped_gradients(self, model: Any, loss_fn: Any, **options: Any) -> Any:
        """The clipped-gradient engine (:class:`~dpvr.optim.gradients.ClippedGradients`) an algorithm
        computes its clipped sums with, in this config's ``grad_mode``, ``chunk_size`` and ``nonfinite``
        policy (``options``: the engine's other arguments), wrapped by :attr:`all_reduce` under data
        parallelism. Every algorithm builds its engines here, so a data-parallel run reaches each of them
        at construction."""
        engine = ClippedGradients(model, loss_fn, mode=self.grad_mode, chunk_size=self.chunk_size,
                                  nonfinite=self.nonfinite, **options)
        return engine if self.all_reduce is None else self.all_reduce(engine)

    def sampler_seed_for(self, k: int) -> int | None:
        """The seed of an algorithm's ``k``-th sampler (one per stream or client)."""
        return None if self.sampler_seed is None else self.sampler_seed + k


def bound_fields(config: PrivacyConfig | RuntimeConfig) -> dict[str, Any]:
    """The fields of a config that shape what a run releases (the checkpoint binding's share of it).

    Unbound: the budget and how noise was calibrated (the noise multipliers are bound themselves), the
    accountant, the noise source and sampler seeds (restored from the state). The neighbouring relation and
    the public dataset size are bound through the plan."""
    unbound = {"epsilon", "delta", "accountant", "calibration", "shares", "paper_options", "neighbouring",
               "public_dataset_size", "generator", "sampler_seed", "all_reduce"}
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name not in unbound}


def stream_clips(
    clip: Mapping[str, float | Sequence[float]], streams: Sequence[str], *, pairs: Sequence[str] = ()
) -> dict[str, Any]:
    """``clip={stream: C}`` checked against the streams an algorithm clips: exactly those keys, each a number
    > 0, or for the streams in ``pairs`` a pair of numbers >= 0 (a difference radius with two constants, as
    the algorithm documents), not both zero."""
    if not isinstance(clip, Mapping):
        raise TypeError(f"clip: expected {{stream: radius}} for the streams {list(streams)}, got {clip!r}")
    if set(clip) != set(streams):
        raise ValueError(f"clip: needs exactly the streams {sorted(streams)}, got {sorted(clip)}")
    checked: dict[str, Any] = {}
    for stream in streams:
        value = clip[stream]
        if stream in pairs:
            pair = tuple(float(c) for c in value)
            if len(pair) != 2 or not all(c >= 0 for c in pair) or not any(c > 0 for c in pair):
                raise ValueError(f"clip[{stream!r}]: two numbers >= 0, not both 0; got {value!r}")
            checked[stream] = pair
        else:
            if not float(value) > 0:
                raise ValueError(f"clip[{stream!r}]: must be > 0, got {value!r}")
            checked[stream] = float(value)
    return checked
