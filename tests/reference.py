"""float64 references for the native kernels, written as plainly as possible."""

from __future__ import annotations

import numpy as np


def flatten(arrays, batch):
    return np.concatenate([np.asarray(a, dtype=np.float64).reshape(batch, -1) for a in arrays], axis=1)


def clip_accumulate(grads, clip, weights=None, grads_prev=None, a=None, b=None):
    """Returns (clipped sum split per tensor, per-sample norms)."""
    batch = np.asarray(grads[0]).shape[0]
    u = flatten(grads, batch)
    if grads_prev is not None:
        av = np.ones(batch) if a is None else np.asarray(a, np.float64)
        bv = np.ones(batch) if b is None else np.asarray(b, np.float64)
        u = av[:, None] * u - bv[:, None] * flatten(grads_prev, batch)
    elif weights is not None:
        u = np.asarray(weights, np.float64)[:, None] * u
    norms = np.linalg.norm(u, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        factor = np.where(norms > clip, clip / norms, 1.0)
    finite = np.isfinite(u).all(axis=1)
    total = (np.where(finite, factor, 0.0)[:, None] * np.where(finite[:, None], u, 0.0)).sum(axis=0)
    sizes = [int(np.prod(np.asarray(g).shape[1:])) for g in grads]
    return np.split(total, np.cumsum(sizes)[:-1]), np.where(finite, norms, np.nan)
