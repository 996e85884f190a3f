"""What several algorithms' settings share: help texts, and the SPIDERs' settings schema."""

from __future__ import annotations

from dataclasses import dataclass

from ..registry import setting

_SCHEMES = {
    "poisson": "poisson (each record with rate q)",
    "wor": "wor (fixed size, without replacement)",
    "full": "full",
    "random-allocation": "random-allocation (each record in one random step of every n/b; add-remove, pld)",
}

DATASET_SIZE = "number of records n"
STEPS = "number of steps T"
BATCH_SIZE = "batch size m (expected, for Poisson sampling)"
NOISE_MULTIPLIER = "noise std on the sum of clipped gradients, over the clip norm C"


def sampling(choices: tuple[str, ...]) -> str:
    """The help of a ``sampling`` setting that takes ``choices``."""
    return f"batch sampling: {', '.join(_SCHEMES[c] for c in choices)}"


_SPIDER_SAMPLING = ("wor", "poisson")


@dataclass(frozen=True)
class SpiderSettings:
    """The settings of a SPIDER plan (:class:`dpvr.algorithms.DoubleSpiderPlan`, ``RecursiveSpiderPlan``):
    each algorithm's schema derives from it, naming its own batch sizes (the field keeps its place)."""

    dataset_size: int = setting(DATASET_SIZE)
    steps: int = setting(STEPS)
    restart: int = setting("refresh period q: refreshes at the steps t with t mod q = 0")
    batch_sizes: tuple[int, ...] = setting("the batch size of each stream in the paper's order")
    sampling: str = setting(sampling(_SPIDER_SAMPLING), "wor", choices=_SPIDER_SAMPLING)
