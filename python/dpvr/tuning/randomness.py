"""The random draws of a private search, and why each must be secret.

The random-stopping theorem (Papernot and Steinke, ICLR 2022) prices the best of ``K`` runs for an observer
who sees the best trial's output and nothing else. Three draws of :func:`dpvr.tuning.tune` are then secret:

- ``K``, the number of trials. An observer who knows it sees the best of ``K`` *known* runs, which costs
  the composition of ``K`` runs, not the search's epsilon.
- the noise added to a score that reads private data. Known, it is subtracted, and the "noisy" score is
  the exact one: a release priced as a Gaussian mechanism that is not.
- each trial's candidate. The candidates may be *public* as a set (a grid, a sampler), but not as a
  sequence: the released best candidate first occurs at some index of a known sequence, so ``K`` is at
  least that index, and the best of ``K`` given ``K >= j`` costs about ``j`` runs' composition (with a
  sampler whose draws never repeat, the index is exact). Whoever wants public candidates passes them as a
  grid (which they may have drawn with any seed); the tuner picks among them secretly.

Each draw has a stream of its own, so how much of its stream a candidate sampler consumes never moves
``K`` or the score noise. By default each stream is seeded with fresh entropy from the operating system's
CSPRNG (128 bits, through ``numpy.random.SeedSequence()``), independently of the others and of numpy's and
torch's global seeds, so nothing the search releases (the best candidate is one draw of its stream) says
anything about the other streams. A fixed ``seed`` derives all three from it, which makes the search
reproducible and every secret draw known to whoever knows the seed: it is accepted only with
``reproducible=True``, as :class:`dpvr.ops.NoiseGenerator` accepts a fixed seed, and refused with its error,
:class:`dpvr.ops.PredictableNoiseError`, otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ops import PredictableNoiseError

# The streams' positions among a fixed seed's children: part of what a seed reproduces, never reorder.
_STREAMS = ("count", "candidates", "score noise")


@dataclass(frozen=True)
class SearchRandomness:
    """The search's three generators (see the module documentation): ``count`` draws ``K``, ``candidates``
    is the one a candidate sampler receives, ``score_noise`` draws the noise of a score on private data.
    ``seed`` is ``None`` unless the caller fixed it (with ``reproducible=True``)."""

    count: np.random.Generator
    candidates: np.random.Generator
    score_noise: np.random.Generator
    seed: int | None

    @classmethod
    def make(cls, seed: int | None = None, *, reproducible: bool = False) -> SearchRandomness:
        """Secret streams from the operating system by default; from ``seed`` only with
        ``reproducible=True`` (:class:`~dpvr.ops.PredictableNoiseError` otherwise)."""
        if seed is None:
            # SeedSequence() reads fresh OS entropy on every call: the streams are independent secrets.
            roots = [np.random.SeedSequence() for _ in _STREAMS]
        else:
            if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
                raise ValueError(f"seed: must be an integer >= 0, got {seed!r}")
            if not reproducible:
                raise PredictableNoiseError(
                    "seed: a fixed seed makes the search's secret draws (the number of trials, each trial's "
                    "candidate and the score noise) predictable to anyone who knows it; pass "
                    "reproducible=True to opt into a reproducible search, or no seed for secret draws"
                )
            seed = int(seed)
            roots = np.random.SeedSequence(seed).spawn(len(_STREAMS))
        count, candidates, score_noise = (np.random.default_rng(root) for root in roots)
        return cls(count, candidates, score_noise, seed)
