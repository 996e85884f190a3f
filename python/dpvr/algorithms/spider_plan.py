"""What the SPIDER plans share: refresh-every-``q`` estimators with one noise stream per estimator and phase
(torch-free: the entries import it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from ..privacy import _checks
from ..privacy.events import (
    PER_SAMPLE,
    SAME_SAMPLE,
    Plan,
    accumulated_differences,
    ceil_div,
    check_relation,
    released_stream,
)
from ..privacy.mechanism import FULL_BATCH, Sampling
from ..privacy.relations import REPLACE_ONE


@dataclass(frozen=True)
class SpiderPlan(Plan):
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
        check_relation(self.neighbouring, *(self._sampling(b) for _, b in self.batch_sizes))
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
        difference = accumulated_differences(self.steps, self.restart)
        carried = {"refresh": 1.0, "difference": difference, "every": 1.0}
        return {s: carried[phase[s]] for s in self.streams}

    def stream_scale(self, stream: str) -> float:
        # the noise multipliers are per record: the released mean divides the noise std by the batch size
        return 1.0 / self.batch_size(stream)

    def _streams(self, noise):
        refreshes = ceil_div(self.steps, self.restart)
        counts = {"refresh": refreshes, "difference": self.steps - refreshes, "every": self.steps}
        streams = []
        for name, phase in self._layout:
            streams += released_stream(noise, name, counts[phase], self.stream_sampling(name))
        return streams

    def _assumptions(self):
        batches = ", ".join(f"{name}: {self.stream_sampling(name).describe()}" for name, _ in self._layout)
        return (
            PER_SAMPLE,
            SAME_SAMPLE,
            f"refresh at steps t with t mod {self.restart} = 0",
            batches,
            "all streams composed in one accountant (the paper calibrates each to the full budget)",
        )


__all__ = ["SpiderPlan"]
