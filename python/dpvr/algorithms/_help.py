"""Help texts several algorithms' settings share."""

from __future__ import annotations

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
