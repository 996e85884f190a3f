"""The binding of a run: every setting that shapes what it releases, in a canonical form, and what is derived
from it — the generator's noise keys and the run's identity in its ledger.

Two runs with equal bindings are the same mechanism on the same data: a checkpoint loads only into an
algorithm with an equal binding, and a reproducible run's replay finds its own ledger. Used by every
algorithm (:class:`~dpvr.optim.PrivateAlgorithm` and the phased framework alike).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..ops import NoiseGenerator
from .ledger import RunLedger


def canonical(value: Any, depth: int = 0) -> Any:
    """A JSON-comparable form of a setting: numbers, strings, lists, dicts; arrays and objects by content
    (every attribute, to a nesting depth of 6, so that a problem object's data is part of it)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, (int, float, np.number)):
        return float(value) if math.isfinite(value) else repr(float(value))
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {value.dtype} {data_fingerprint([value])}"
    if isinstance(value, np.ndarray):
        return f"array {value.shape} {value.dtype} {data_fingerprint([torch.from_numpy(np.array(value))])}"
    if depth > 6:
        return type(value).__qualname__
    if isinstance(value, Mapping):
        return {str(k): canonical(v, depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [canonical(v, depth + 1) for v in value]
    if isinstance(value, torch.optim.Optimizer):
        # Its kind and constructor hyper-parameters; not its state, nor the group values a scheduler changes.
        return {"optimizer": type(value).__qualname__, "defaults": canonical(value.defaults, depth + 1)}
    if isinstance(value, nn.Module):
        return {"module": type(value).__qualname__, **canonical(value.state_dict(), depth + 1)}
    if dataclasses.is_dataclass(value):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return {"type": type(value).__qualname__, **canonical(fields, depth + 1)}
    if hasattr(value, "__dict__") and not callable(value):
        return {"type": type(value).__qualname__, **canonical(vars(value), depth + 1)}
    return type(value).__qualname__ if callable(value) else repr(value)


def data_fingerprint(tensors: Sequence[torch.Tensor]) -> str:
    """SHA-256 of the tensors' shapes, dtypes and values."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{tuple(t.shape)} {t.dtype};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def digest(settings: Mapping[str, Any]) -> bytes:
    """SHA-256 of canonical ``settings``: what a generator's noise keys are bound to."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).digest()


def bind_run(generator: NoiseGenerator, settings: Mapping[str, Any], identity: Mapping[str, Any] | None = None
             ) -> RunLedger:
    """Binds ``generator``'s noise keys to a digest of ``settings`` (canonical values) and returns the run's
    ledger: named after ``identity`` (default ``settings``) and the seed when the generator is reproducible,
    so that a replay finds the same run; a fresh run id otherwise."""
    generator.bind(digest(settings))
    if not generator.reproducible:
        return RunLedger()
    run = hashlib.sha256(json.dumps(settings if identity is None else identity, sort_keys=True).encode())
    run.update(generator.seed.to_bytes(8, "little"))
    return RunLedger(run.hexdigest()[:32], run.hexdigest()[32:48])
