"""Independence of the trials of a private search, checked before each trial runs.

The random-stopping theorem (Papernot and Steinke, ICLR 2022) bounds the best of ``K`` *independent* runs of
one mechanism. A ``build`` that hands two trials the same model, optimizer, buffer or noise source chains
them instead: the second trial starts where the first stopped (and the released "best" trial may be
overwritten by a later one): a composition of runs the search was not accounted for, whose real delta at the
claimed epsilon can exceed the claimed one by orders of magnitude.

:class:`Independence` compares a trial's state with every earlier trial's:

- objects by identity: the algorithm, its model, its optimizer and its noise generator;
- tensors by storage (device and ``untyped_storage().data_ptr()``): every parameter and buffer of the model,
  every parameter and state tensor of the optimizer and the algorithm's own state tensors. An earlier tensor
  that is still alive and has the same storage is shared, exactly. An earlier tensor that is gone may have
  freed its address for a fresh allocation, so there a match counts only if the earlier trial changed the
  tensor and the new one holds exactly the values that trial left (a SHA-256 digest): state carried over
  through an alias the build kept, which a fresh allocation reproduces only by an exact coincidence;
- seeds: the noise generator's seed and the sampler seed, which make two runs' noise or batches equal.

Nothing here reads anything but the trials' own state, and no trial is kept alive for the check (weak
references), so a search holds in memory what it held before: the best trial and the current one.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..optim import PrivateAlgorithm


@dataclass
class _Seen:
    """One tensor of a trial: where its storage lives, and its values when the trial started and ended."""

    ref: weakref.ReferenceType[torch.Tensor]
    address: tuple[str, int]
    what: str
    trial: str
    start: str | None
    end: str | None = None


@dataclass
class Started:
    """A trial admitted by :meth:`Independence.admit`, to hand back to :meth:`Independence.finish`."""

    trial: str
    algorithm: PrivateAlgorithm
    seen: dict[int, _Seen]  # id(tensor) -> its record


class Independence:
    """Refuses a trial that shares state with an earlier one (see the module documentation)."""

    def __init__(self) -> None:
        self._objects: list[tuple[Callable[[], Any], str, str]] = []  # (object, what, trial)
        self._tensors: dict[tuple[str, int], list[_Seen]] = {}
        self._seeds: dict[tuple[str, int], str] = {}

    def admit(self, algorithm: PrivateAlgorithm, trial: str) -> Started:
        """Checks ``algorithm`` (constructed, not yet run) against the earlier trials; raises ``ValueError``
        naming what it shares and with which trial. Then records its objects, seeds and tensors."""
        objects, seeds = list(_objects(algorithm)), list(_seeds(algorithm))
        tensors = [(t, what, _address(t)) for t, what in _tensors(algorithm)]
        for obj, what in objects:
            for ref, seen_what, seen_trial in self._objects:
                if ref() is obj:
                    _refuse(trial, f"its {what}", seen_trial, f"its {seen_what}")
        for kind, seed in seeds:
            if (kind, seed) in self._seeds:
                _refuse(trial, f"its {kind} ({seed})", self._seeds[(kind, seed)], "")
        digests: dict[int, str] = {}
        for tensor, what, address in tensors:
            if address is None:
                continue
            for seen in self._tensors.get(address, ()):
                earlier = seen.ref()
                if earlier is not None and _address(earlier) == address:  # both alive: one storage, shared
                    _refuse(trial, what, seen.trial, seen.what)
                if seen.end is not None and seen.end != seen.start:
                    if id(tensor) not in digests:
                        digests[id(tensor)] = _digest(tensor)
                    if digests[id(tensor)] == seen.end:
                        raise ValueError(
                            f"tune: {trial} holds what {seen.trial} left in its {seen.what} ({what} is "
                            f"storage {seen.trial} trained, kept by the build): trials must be independent "
                            "runs; " + _ADVICE
                        )
        self._objects += [(_reference(obj), what, trial) for obj, what in objects]
        self._seeds.update(dict.fromkeys(seeds, trial))
        records: dict[int, _Seen] = {}
        for tensor, what, address in tensors:
            if address is not None and id(tensor) not in records:
                start = digests[id(tensor)] if id(tensor) in digests else _digest(tensor)
                records[id(tensor)] = _Seen(weakref.ref(tensor), address, what, trial, start)
                self._tensors.setdefault(address, []).append(records[id(tensor)])
        return Started(trial, algorithm, records)

    def finish(self, started: Started) -> None:
        """Records what a trial that has run (trained and scored) left in its tensors, for the later trials'
        checks; tensors it created (optimizer state) count as changed."""
        for tensor, what in _tensors(started.algorithm):
            address = _address(tensor)
            if address is None:
                continue
            seen = started.seen.get(id(tensor))
            if seen is None or seen.ref() is not tensor or seen.address != address:  # new, or moved
                seen = _Seen(weakref.ref(tensor), address, what, started.trial, None)
                started.seen[id(tensor)] = seen
                self._tensors.setdefault(address, []).append(seen)
            seen.end = _digest(tensor)
        # Forget what can no longer match: gone, and not changed by its trial (or never finished).
        for address, entries in list(self._tensors.items()):
            kept = [e for e in entries if e.ref() is not None or (e.end is not None and e.end != e.start)]
            if kept:
                self._tensors[address] = kept
            else:
                del self._tensors[address]


_ADVICE = (
    "build must construct a fresh model (e.g. copy.deepcopy of a template), optimizer and noise generator "
    "in every call, and reuse no seed"
)


def _refuse(trial: str, what: str, earlier: str, earlier_what: str) -> None:
    where = f" ({earlier_what})" if earlier_what and earlier_what != what else ""
    raise ValueError(
        f"tune: {trial} shares {what} with {earlier}{where}: the search's guarantee is for independent runs, "
        f"and shared state chains the trials (the released one then depends on the others); " + _ADVICE
    )


def _reference(obj: Any) -> Callable[[], Any]:
    """A weak reference where the object allows one (a strong one otherwise: it is then kept alive)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _objects(algorithm: PrivateAlgorithm) -> Iterator[tuple[Any, str]]:
    yield algorithm, "algorithm"
    yield algorithm.model, "model"
    if getattr(algorithm, "optimizer", None) is not None:
        yield algorithm.optimizer, "optimizer"
    if getattr(algorithm, "generator", None) is not None:
        yield algorithm.generator, "noise generator"


def _seeds(algorithm: PrivateAlgorithm) -> Iterator[tuple[str, int]]:
    generator = getattr(algorithm, "generator", None)
    if generator is not None:
        yield "noise seed", int(generator.seed)
    runtime = getattr(algorithm, "runtime", None)
    if runtime is not None and runtime.sampler_seed is not None:
        yield "sampler seed", int(runtime.sampler_seed)


def _tensors(algorithm: PrivateAlgorithm) -> Iterator[tuple[torch.Tensor, str]]:
    """Every tensor a trial's run reads and writes: model parameters and buffers, optimizer parameters and
    state, the algorithm's own state."""
    model = algorithm.model
    for name, p in model.named_parameters():
        yield p, f"parameter {name!r}"
    for name, b in model.named_buffers():
        yield b, f"buffer {name!r}"
    optimizer = getattr(algorithm, "optimizer", None)
    if optimizer is not None:
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                yield p, f"optimizer parameter {i} of group {g}"
        for i, state in enumerate(optimizer.state.values()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    yield value, f"optimizer state {key!r} of parameter {i}"
    for name, tensors in algorithm._buffers().items():
        for i, t in enumerate(tensors):
            yield t, f"algorithm state {name!r}[{i}]"


def _address(tensor: torch.Tensor) -> tuple[str, int] | None:
    """The tensor's storage: device and base address (``None`` for an empty storage, which holds nothing)."""
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0 or storage.data_ptr() == 0:
        return None
    return str(tensor.device), storage.data_ptr()


def _digest(tensor: torch.Tensor) -> str:
    t = tensor.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    t = t.cpu().contiguous()
    h = hashlib.sha256(f"{tuple(t.shape)} {t.dtype};".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
