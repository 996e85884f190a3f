"""What an accountant's ledger holds, and its JSON form: one entry per run of identical releases.

An entry is ``count`` releases of one dp_accounting event, serving one or several noise streams with weights
(``parts``), within a run; :func:`event_to_dict`/:func:`event_from_dict` are the events' JSON form (used by
checkpoints, and as the key under which the PLD accountant caches a release's distribution). Every backend
composes entries of this shape (:class:`~dpvr.privacy.relations.Ledger`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

import attr
import dp_accounting as dpa
from dp_accounting import dp_event

from . import _checks
from .random_allocation import RandomAllocationDpEvent

StreamSpec = Union[str, Mapping[str, float]]


def event_to_dict(event: dpa.DpEvent) -> dict[str, Any]:
    """A JSON-serialisable description of a dp_accounting event (nested events included)."""
    out: dict[str, Any] = {"type": type(event).__name__}
    for a in attr.fields(type(event)):
        out[a.name] = _encode(getattr(event, a.name))
    return out


def _encode(value: Any) -> Any:
    if isinstance(value, dpa.DpEvent):
        return event_to_dict(value)
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    return value


_DPVR_EVENTS = {RandomAllocationDpEvent.__name__: RandomAllocationDpEvent}


def event_from_dict(data: Mapping[str, Any]) -> dpa.DpEvent:
    """Inverse of :func:`event_to_dict`; only dp_accounting's own event classes and dpvr's
    :class:`~dpvr.privacy.random_allocation.RandomAllocationDpEvent` are accepted."""
    cls = _DPVR_EVENTS.get(str(data.get("type"))) or getattr(dp_event, str(data.get("type")), None)
    if not (isinstance(cls, type) and issubclass(cls, dpa.DpEvent)):
        raise ValueError(f"unknown DpEvent type {data.get('type')!r}")
    return cls(**{k: _decode(v) for k, v in data.items() if k != "type"})


def _decode(value: Any) -> Any:
    if isinstance(value, Mapping) and "type" in value:
        return event_from_dict(value)
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value


@dataclass
class Entry:
    """``count`` releases of ``event`` in ``run``, serving the streams of ``parts`` (name, weight; weights sum
    to one)."""

    parts: tuple[tuple[str, float], ...]
    event: dpa.DpEvent
    count: int
    run: str = ""  # releases of one run (or segment of a run): random allocation's epochs are counted per run


def stream_parts(stream: StreamSpec) -> tuple[tuple[str, float], ...]:
    """A stream name, or a mapping of names to positive weights, as ``((name, weight), ...)`` with the
    weights normalised to sum to one."""
    if isinstance(stream, str):
        if not stream:
            raise ValueError("stream must be a non-empty name")
        return ((stream, 1.0),)
    if not isinstance(stream, Mapping) or not stream:
        raise ValueError(f"stream must be a name or a mapping of names to weights, got {stream!r}")
    weights = {str(k): _checks.positive(f"weight of stream {k!r}", w) for k, w in stream.items()}
    total = math.fsum(weights.values())
    return tuple((k, w / total) for k, w in weights.items())


__all__ = ["Entry", "StreamSpec", "event_from_dict", "event_to_dict", "stream_parts"]
