"""The private records an algorithm reads: tensors in memory, or a map-style ``Dataset`` loaded per batch.

Every algorithm draws its batches itself, from the scheme its accountant prices (:mod:`dpvr.optim.sampling`),
and asks a :class:`Records` for exactly the records drawn:

- ``records.draw(sampler)``: the next batch of ``sampler`` (its next index set; the full batch for
  ``"full"``), as ``(inputs, targets)`` on the model's device;
- ``records.batch(indices)``: the records ``indices``, loaded now;
- ``records.full()``, ``records.chunks(size)``: every record, at once or chunk by chunk;
- ``records.probe(k)``: the first ``k`` records, for set-up checks;
- ``records.fingerprint()``: what a checkpoint binds of the data.

Two kinds:

- :class:`TensorRecords`: ``(inputs, targets)`` tensors held in memory and indexed (what every algorithm
  did before records existed, bit for bit). Its full batch is the tensors themselves, so a full-batch
  algorithm sees the very same tensors every step (DIFF2's recording reuse depends on it).
- :class:`DatasetRecords`: a user's map-style ``Dataset`` and ``collate_fn``, loaded through a torch
  ``DataLoader`` (workers, pinned memory, prefetching) whose batch sampler yields the accounted index sets:
  each step loads exactly the records drawn (``__getitem__`` runs again at every access, so random
  augmentations are fresh; the collate runs per batch, so it may pad per batch), and set-up reads a fixed
  handful of records whatever the dataset's size.

Prefetching and checkpoints: a :class:`DatasetRecords` loader prefetches by drawing ahead: the index sets it
loads early are drawn from the sampler and kept in the sampler's *pending* queue
(:attr:`~dpvr.optim.sampling.BatchSampler.pending`) until the algorithm consumes them, in draw order. A
sampler's draws depend only on its own state, so drawing ahead does not change which index sets the run uses,
and the sampler's state (saved in every checkpoint) includes the pending ones: a resumed run loads them
first, so no drawn batch is skipped or used twice. With ``num_workers=0`` nothing is drawn ahead.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, TensorDataset
from torch.utils.data.dataloader import default_collate

from ..grads.fields import Fields, cat
from ..grads.fields import leaves as data_leaves
from .binding import data_fingerprint
from .sampling import BatchSampler, batch_rows


class Batch:
    """The records of one draw: ``inputs`` and ``targets`` (unpack it: ``inputs, targets = batch``);
    ``len(batch)`` is the number of records. Either may be :class:`~dpvr.grads.Fields` (several tensors per
    record, e.g. ``input_ids`` and ``attention_mask``)."""

    __slots__ = ("inputs", "targets")

    def __init__(self, inputs: Tensor, targets: Tensor) -> None:
        self.inputs, self.targets = inputs, targets

    def __iter__(self) -> Iterator[Tensor]:
        return iter((self.inputs, self.targets))

    def __len__(self) -> int:
        return len(self.inputs)

    def __repr__(self) -> str:
        shapes = f"inputs {_shape(self.inputs)}, targets {_shape(self.targets)}"
        return f"Batch({len(self)} records: {shapes})"


def _shape(x: Tensor | Fields) -> Any:
    return x if isinstance(x, Fields) else tuple(x.shape)


def _trailing(x: Tensor | Fields) -> list[tuple[int, ...]]:
    """The per-record shape of every tensor of ``x`` (its trailing dimensions)."""
    return [tuple(t.shape[1:]) for t in data_leaves(x)]


PROBE = 16  # records read at set-up for the checks (and returned by probe(k <= PROBE))
FINGERPRINT_RECORDS = 8  # records a DatasetRecords fingerprint reads (spread over the index range)
CHUNK = 1024  # records per loader batch when every record is read (full batch, chunks)


class Records:
    """The records an algorithm reads (see the module documentation). Subclasses implement ``__len__``,
    :meth:`batch` and :meth:`fingerprint`; the others have generic definitions in terms of these."""

    def __len__(self) -> int:
        raise NotImplementedError

    def batch(self, indices: np.ndarray | Sequence[int]) -> Batch:
        """The records ``indices`` (``inputs, targets``), in that order, on the model's device (floating
        tensors in the model's dtype)."""
        raise NotImplementedError

    def fingerprint(self) -> str:
        """A digest of the data that a checkpoint binds (see each class for how much of the data it reads)."""
        raise NotImplementedError

    def draw(self, sampler: BatchSampler) -> Batch:
        """The records of ``sampler``'s next draw (its state advances by one draw); every record for the
        ``"full"`` scheme (:meth:`full`)."""
        if sampler.scheme == "full":
            return self.full()
        return self.batch(sampler.draw())

    def full(self) -> Batch:
        """Every record, in index order."""
        return self.batch(np.arange(len(self)))

    def chunks(self, size: int = CHUNK) -> Iterator[Batch]:
        """Every record, in index order, ``size`` records at a time."""
        n = len(self)
        for start in range(0, n, size):
            yield self.batch(np.arange(start, min(n, start + size)))

    def probe(self, k: int = 1) -> Batch:
        """The first ``min(k, len(self))`` records: what set-up checks (loss shape, separability) read."""
        return self.batch(np.arange(min(k, len(self))))

    def content_fingerprint(self) -> str:
        """SHA-256 of every record's values in index order: the number of records, then ``CHUNK`` records at
        a time each chunk's input and target shapes, dtypes and bytes (as loaded: floating tensors in the
        records' dtype). Unlike :meth:`fingerprint`, which may read a sample of the records, records that
        differ anywhere, in order or in number, digest differently, whatever kind of :class:`Records` holds
        them (a ``TensorDataset`` and a ``Dataset`` of the same records digest alike). One pass over the
        data; what a data-parallel run's processes compare (:mod:`dpvr.trainer.parallel`)."""
        h = hashlib.sha256(f"records n={len(self)};".encode())
        for batch in self._every_chunk():
            for t in data_leaves(*batch):
                t = t.detach().cpu().contiguous()
                h.update(f"{tuple(t.shape)} {t.dtype};".encode())
                h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def _every_chunk(self) -> Iterator[Batch]:
        """Every record in index order, ``CHUNK`` at a time, as :meth:`content_fingerprint` reads them."""
        return self.chunks(CHUNK)

    def close(self) -> None:
        """Releases loader workers, if any (they are also released when the records are collected)."""


def as_records(inputs: Tensor | Records, targets: Tensor | None) -> Records:
    """``inputs`` when it is a :class:`Records` (``targets`` must then be ``None``: the records hold them),
    else :class:`TensorRecords` ``(inputs, targets)``: what the algorithms accept as their data."""
    if isinstance(inputs, Records):
        if targets is not None:
            raise TypeError("targets: give Records alone (they hold the targets), or inputs and targets")
        return inputs
    if targets is None:
        raise TypeError(
            "targets: required with an inputs tensor (or give a dpvr.optim.records.Records as the data)"
        )
    return TensorRecords(inputs, targets)


def _cast(t: Tensor | Fields, dtype: torch.dtype | None) -> Tensor | Fields:
    if isinstance(t, Fields):
        return t.map(lambda u: _cast(u, dtype))
    return t.to(dtype) if dtype is not None and t.is_floating_point() and t.dtype != dtype else t


class TensorRecords(Records):
    """``(inputs, targets)`` tensors in memory, indexed on their own device.

    ``batch(indices)`` is ``inputs[rows]``, ``targets[rows]`` with the rows moved to the data's device as
    :func:`~dpvr.optim.sampling.batch_rows` does, and :meth:`full` returns the tensors themselves: exactly
    what the algorithms did with tensors before. ``dtype``: floating tensors are cast to it per batch (and
    once, kept, for the full batch), so that data in another precision than the model's is not copied whole
    at set-up.

    :meth:`fingerprint`: SHA-256 of every value (of the tensors as cast), the strongest binding.
    """

    def __init__(self, inputs: Tensor, targets: Tensor, *, dtype: torch.dtype | None = None) -> None:
        if len(inputs) != len(targets):
            raise ValueError(f"targets: {len(targets)} rows for {len(inputs)} inputs")
        self.inputs, self.targets, self.dtype = inputs, targets, dtype
        self._full: tuple[tuple[int, int], Batch] | None = None  # the cast full batch, at the versions cast

    def __len__(self) -> int:
        return len(self.inputs)

    def _converts(self) -> bool:
        """Whether ``dtype`` casts either tensor."""
        return self.dtype is not None and any(
            t.is_floating_point() and t.dtype != self.dtype for t in (self.inputs, self.targets)
        )

    def batch(self, indices: np.ndarray | Sequence[int]) -> Batch:
        rows = batch_rows(np.asarray(indices, dtype=np.int64), self.inputs.device)
        return Batch(_cast(self.inputs[rows], self.dtype), _cast(self.targets[rows], self.dtype))

    def full(self) -> Batch:
        """The tensors themselves; cast (and contiguous) copies made once and kept while the tensors are
        unchanged, so that every step sees the same tensors."""
        if not self._converts() and self.inputs.is_contiguous() and self.targets.is_contiguous():
            return Batch(self.inputs, self.targets)
        versions = (self.inputs._version, self.targets._version)
        if self._full is None or self._full[0] != versions:
            x, y = (_cast(t, self.dtype).contiguous() for t in (self.inputs, self.targets))
            self._full = versions, Batch(x, y)
        return self._full[1]

    def chunks(self, size: int = CHUNK) -> Iterator[Batch]:
        for x, y in zip(self.inputs.split(size), self.targets.split(size)):
            yield Batch(_cast(x, self.dtype), _cast(y, self.dtype))

    def probe(self, k: int = 1) -> Batch:
        return Batch(_cast(self.inputs[:k], self.dtype), _cast(self.targets[:k], self.dtype))

    def hash_into(self, h: Any) -> None:
        """Adds the records to the SHA-256 ``h`` as :func:`~dpvr.optim.binding.data_fingerprint` would for
        ``[inputs, targets]`` cast to ``dtype`` (chunk by chunk: no cast copy of the whole data)."""
        for t in (self.inputs, self.targets):
            t = t.detach()
            dtype = self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype
            h.update(f"{tuple(t.shape)} {dtype};".encode())
            for part in t.split(CHUNK * 64) if len(t) else ():
                part = _cast(part, self.dtype).cpu().contiguous()
                h.update(part.reshape(-1).view(torch.uint8).numpy().tobytes())

    def fingerprint(self) -> str:
        if not self._converts():
            return data_fingerprint([self.inputs, self.targets])
        h = hashlib.sha256()
        self.hash_into(h)
        return h.hexdigest()


def records_fingerprint(records: Sequence[Records]) -> str:
    """One fingerprint of several records (e.g. DIFF2's clients): for tensors, the
    :func:`~dpvr.optim.binding.data_fingerprint` of all their tensors in order (what a distributed run's
    aggregator binds), else a digest of each one's fingerprint."""
    if all(isinstance(r, TensorRecords) for r in records):
        h = hashlib.sha256()
        for r in records:
            r.hash_into(h)
        return h.hexdigest()
    return hashlib.sha256(" ".join(r.fingerprint() for r in records).encode()).hexdigest()


class _Feed:
    """The batch sampler of one stream's ``DataLoader``: the sampler's pending draws, then new ones drawn
    ahead (kept pending until the algorithm consumes them), skipping empty draws (which load nothing).

    ``handed``: how many of the sampler's pending draws (from the oldest) it has given the loader."""

    def __init__(self, sampler: BatchSampler) -> None:
        self.sampler = sampler
        self.handed = 0

    def __iter__(self) -> Iterator[list[int]]:
        sampler = self.sampler
        while True:
            while self.handed >= len(sampler.pending):
                sampler.draw_ahead()
            indices = sampler.pending[self.handed]
            self.handed += 1
            if len(indices):
                yield indices.tolist()


class _Stream:
    """One sampler's batches through a ``DataLoader`` that prefetches them (see the module documentation).

    Nothing it holds refers back to it or to its records: records dropped without :meth:`~Records.close`
    are then freed at once by reference counting, which shuts their workers down. In a reference cycle they
    would wait for the garbage collector, whose pass finalises the workers' queues with the cycle, so the
    shutdown's join of each worker runs into its timeout (seconds per worker, at an arbitrary later point).
    """

    def __init__(self, loader: DataLoader, feed: _Feed) -> None:
        self.loader, self.feed, self.sampler = loader, feed, feed.sampler
        self.iterator: Iterator[Any] | None = None
        self.generation: int | None = None

    def _open(self) -> None:
        """A fresh iterator from the sampler's current state (its pending draws first)."""
        self.iterator = None  # a non-persistent loader's old iterator shuts its workers down when collected
        self.feed.handed = 0
        self.iterator = iter(self.loader)
        self.generation = self.sampler.generation

    def next(self) -> tuple[Any, int] | None:
        """The next draw as the loader collated it, with its number of records; None for an empty draw."""
        sampler = self.sampler
        if self.generation != sampler.generation:  # the sampler was restored or restarted
            self._open()
        if not sampler.pending:
            sampler.draw_ahead()
        if len(sampler.pending[0]) == 0:
            sampler.draw()
            self.feed.handed = max(0, self.feed.handed - 1)
            return None
        try:
            raw = next(self.iterator)  # the loader returns batches in the order the feed gave them
        except BaseException:  # e.g. the dataset raised: reopen on the next call, this draw still pending
            self.generation = None
            raise
        indices = sampler.draw()
        self.feed.handed -= 1
        return raw, len(indices)

    def close(self) -> None:
        self.iterator = None


def _check_rows(batch: Batch, records: int) -> Batch:
    """``batch``, refused unless it has one row per record loaded."""
    rows = [len(t) if isinstance(t, Fields) or t.dim() else None for t in batch]
    if rows != [records, records]:
        raise ValueError(
            f"data: {records} records were collated into {rows[0]} input rows and {rows[1]} target rows; "
            "collate_fn must give one row of each per record"
        )
    return batch


class _Jobs:
    """The batch sampler of the loader that serves direct loads: the index lists of the current job."""

    def __init__(self) -> None:
        self.items: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


_LOADER_OPTIONS = (
    "num_workers", "pin_memory", "prefetch_factor", "persistent_workers", "worker_init_fn",
    "multiprocessing_context", "generator", "timeout",
)


class DatasetRecords(Records):
    """A map-style ``dataset`` whose records are loaded when drawn, collated by ``collate_fn``.

    Each record must collate to an ``(input, target)`` pair (checked on the first records at construction),
    where the input may be structured (:meth:`convert`: a dict or tuple of tensors, or a Hugging Face record
    whose ``labels`` field is the target);
    floating-point tensors are cast to ``dtype`` and every batch is moved to ``device`` (through pinned memory
    when ``pin_memory`` and ``device`` is a GPU).

    Loading: :meth:`draw` serves each sampler through its own ``DataLoader`` whose batch sampler yields that
    sampler's index sets, with the loader options given (``num_workers``, ``pin_memory``,
    ``prefetch_factor``, ``persistent_workers``, ``worker_init_fn``, ``multiprocessing_context``,
    ``generator``, ``timeout``; :meth:`from_loader` takes them from a user's ``DataLoader``). With workers,
    the loader prefetches by drawing ahead (module documentation): batches are still consumed in draw order
    and checkpoints neither skip nor repeat one. Each sampler gets its own loader (and workers): an algorithm
    with several sampled streams runs ``num_workers`` workers per stream. Direct loads (:meth:`batch`,
    :meth:`full`, :meth:`chunks`) go through one more loader with the same options, without prefetching.

    A ``TensorDataset`` of two tensors, or a ``Subset`` of one (``random_split``'s parts), with the default
    collate and no workers is indexed instead, one gather per batch: the same rows as the loader's
    (:meth:`_indexable`).

    Set-up reads a fixed number of records (the first ``PROBE`` for the checks, and ``FINGERPRINT_RECORDS``
    spread over the index range for the fingerprint), whatever ``len(dataset)``; host memory does not grow
    with it.

    Full batch: :meth:`full` reads every record, in loader batches of ``chunk`` records spread over the
    workers, concatenated (collated as one batch instead when a per-batch collate gives the chunks different
    shapes), every time, so augmentations are fresh each step; ``cache_full=True`` keeps the first full batch
    and returns the same tensors afterwards (for deterministic data that fits in memory: DIFF2's recording
    reuse then applies).

    :meth:`fingerprint` is weaker than :class:`TensorRecords`': it binds the dataset's size and type, the
    collate function's name and a SHA-256 of ``FINGERPRINT_RECORDS`` records read with torch's, numpy's and
    Python's global random generators seeded to a fixed value (so that an augmentation drawing from them
    gives the same records every time), not every value. A checkpoint is thus refused for a dataset of
    another size or type, or whose fingerprinted records differ, but not for one that differs only
    elsewhere. A dataset whose records are random through a generator of its own fingerprints differently
    each time: give ``fingerprint=`` (a string naming the data, e.g. its version) to bind that instead.
    """

    def __init__(
        self,
        dataset: Dataset,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        timeout: float = 0,
        chunk: int = CHUNK,
        cache_full: bool = False,
        fingerprint: str | None = None,
    ) -> None:
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError(
                "data: a map-style Dataset (with __len__ and __getitem__) is required; an iterable dataset "
                "has no fixed size to sample from, so its privacy cannot be accounted"
            )
        self.n = len(dataset)
        if self.n == 0:
            raise ValueError("data: the dataset is empty")
        if chunk < 1:
            raise ValueError(f"chunk: must be >= 1, got {chunk}")
        self.dataset = dataset
        self.collate_fn = default_collate if collate_fn is None else collate_fn
        self.dtype = dtype
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self.chunk, self.cache_full, self._named = int(chunk), bool(cache_full), fingerprint
        self.num_workers = int(num_workers)
        if generator is None and self.num_workers > 0:
            # The workers' seeds come from this generator: seeded once here from torch's global generator (as
            # a DataLoader iterator would be), so a run seeded with torch.manual_seed is reproducible, and
            # later iterators (a resume) do not draw from the global generator again.
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            generator = torch.Generator().manual_seed(seed)
        self._options: dict[str, Any] = {
            "num_workers": self.num_workers,
            "pin_memory": bool(pin_memory) and self.device.type == "cuda",
            "worker_init_fn": worker_init_fn,
            "multiprocessing_context": multiprocessing_context,
            # with no workers the generator seeds nothing: a private one leaves torch's global one untouched
            "generator": generator if generator is not None else torch.Generator(),
            "timeout": timeout,
        }
        if self.num_workers > 0:
            self._options["prefetch_factor"] = prefetch_factor
            self._options["persistent_workers"] = bool(persistent_workers)
        self._streams: dict[int, _Stream] = {}
        self._jobs: _Jobs | None = None
        self._job_loader: DataLoader | None = None
        self._full: Batch | None = None
        self._fingerprint: str | None = None
        probe = min(PROBE, self.n)
        self._probe = _check_rows(self.convert(self._read(range(probe))), probe)  # checks the record format
        self._empty = tuple(t[:0] for t in self._probe)
        self._rows = self._indexable()

    def _indexable(self) -> tuple[Tensor, Tensor, Tensor | None] | None:
        """``(inputs, targets, rows)`` when loading records ``i`` is indexing two tensors at ``rows[i]``
        (``None``: ``i`` itself): a ``TensorDataset`` of two tensors, or ``Subset`` s of one (what
        ``random_split`` returns), collated by the default collate in this process, unpinned. The loader's
        per-record ``__getitem__`` and ``torch.stack`` then give exactly the rows that one gather gives, in
        the same dtype, so :meth:`batch`, :meth:`draw` and :meth:`_load` gather them (the subsets' indices
        and the dataset's tensors are taken here, once). Anything else (a subclass, another collate, workers,
        pinned memory) loads through the ``DataLoader``."""
        if (self.collate_fn is not default_collate or self.num_workers > 0 or self._options["pin_memory"]
                or self._options["timeout"]):
            return None
        dataset, rows = self.dataset, None
        while type(dataset) is Subset:
            index = torch.as_tensor(dataset.indices, dtype=torch.int64)
            rows = index if rows is None else index[rows]
            dataset = dataset.dataset
        if type(dataset) is not TensorDataset or len(dataset.tensors) != 2:
            return None
        inputs, targets = dataset.tensors
        if rows is not None and len(rows) and not (int(rows.min()) >= 0 and int(rows.max()) < len(inputs)):
            return None  # an index out of range: the loader raises it as torch does, at the record's load
        return inputs, targets, rows

    @classmethod
    def from_loader(cls, loader: DataLoader, **kwargs: Any) -> DatasetRecords:
        """The records of ``loader``'s dataset, collated by its ``collate_fn``, loaded with its workers,
        pinned memory, prefetch factor, persistent workers, worker init function, multiprocessing context,
        generator and timeout (its sampler, batch size, shuffling and ``drop_last`` are not used: the
        accounted sampler replaces them). ``kwargs``: the other arguments of :class:`DatasetRecords`, which
        also override the loader's options."""
        options = {name: getattr(loader, name) for name in _LOADER_OPTIONS if hasattr(loader, name)}
        if options.get("num_workers", 0) == 0:
            options.pop("prefetch_factor", None)
        return cls(loader.dataset, loader.collate_fn, **{**options, **kwargs})

    def __len__(self) -> int:
        return self.n

    # ---- loading ---------------------------------------------------------------------------------------
    def _read(self, indices: Sequence[int]) -> Any:
        """The collated records ``indices``, read in this process (as a DataLoader's fetcher reads them)."""
        indices = [int(i) for i in indices]
        getitems = getattr(self.dataset, "__getitems__", None)
        records = getitems(indices) if getitems else [self.dataset[i] for i in indices]
        return self.collate_fn(records)

    def convert(self, raw: Any) -> Batch:
        """A collated batch as ``(inputs, targets)`` on the device, floating tensors in ``dtype``.

        What a batch of records may collate to:

        - ``(input, target)``: an input tensor, or a structured input (a dict of tensors: the model is
          called with them as keyword arguments, ``model(**input)``; a tuple or list of tensors: as
          positional arguments) as :class:`~dpvr.grads.Fields`; a target tensor (or a dict or tuple of
          tensors, given to the loss as they are);
        - ``(x1, ..., xk, target)`` with ``k >= 2``: the model's positional inputs and the target (a
          ``TensorDataset(input_ids, attention_mask, labels)``);
        - a dict with a ``"labels"`` field (a Hugging Face collator's output): ``labels`` is the target and
          the other fields are the model's keyword inputs. The model never sees the labels, so its own
          ``.loss`` (a mean over the batch's tokens, which couples records) is not computed: the criterion
          forms each record's loss from the output and the labels.
        """
        if isinstance(raw, Mapping):
            if "labels" not in raw:
                raise TypeError(
                    f"data: a record that is a dict needs a 'labels' field (the target), got fields "
                    f"{sorted(map(str, raw))}; or give (input, target) pairs with the dict as the input"
                )
            inputs: Any = {k: v for k, v in raw.items() if k != "labels"}
            targets: Any = raw["labels"]
        elif isinstance(raw, (tuple, list)) and len(raw) == 2:
            inputs, targets = raw
        elif isinstance(raw, (tuple, list)) and len(raw) > 2:
            inputs, targets = tuple(raw[:-1]), raw[-1]
        else:
            raise TypeError(
                f"data: each record must be an (input, target) pair, got a batch of {type(raw).__name__}"
            )
        return Batch(self._place(inputs), self._place(targets))

    def _place(self, value: Any) -> Tensor | Fields:
        """A collated tensor (or fields) on the device, floating tensors in ``dtype``."""
        if isinstance(value, (Mapping, tuple, list, Fields)):
            return Fields(value).map(self._place)
        t = torch.as_tensor(value)
        if t.device != self.device:
            t = t.to(self.device, non_blocking=t.is_pinned())
        return _cast(t, self.dtype)

    def empty(self) -> Batch:
        """No record: tensors of the first records' trailing shapes with no row (an empty Poisson draw)."""
        return Batch(*self._empty)

    def _loader(self, batch_sampler: Any) -> DataLoader:
        options = self._options
        return DataLoader(self.dataset, batch_sampler=batch_sampler, collate_fn=self.collate_fn, **options)

    def _gather(self, indices: np.ndarray | Sequence[int]) -> Batch:
        """The records ``indices`` gathered from the tensors of :meth:`_indexable`."""
        inputs, targets, rows = self._rows
        index = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        if rows is not None:
            index = rows[index]
        inputs, targets = (t[batch_rows(index, t.device)] for t in (inputs, targets))
        return Batch(self._place(inputs), self._place(targets))

    def _load(self, items: list[list[int]]) -> list[Batch]:
        """The batches ``items`` (index lists) loaded through the direct-load loader, in order."""
        if self._rows is not None:
            return [self._gather(item) for item in items]
        if self._job_loader is None:
            self._jobs = _Jobs()
            options = dict(self._options)
            if self.num_workers > 0:  # its workers serve every direct load: keep them between loads
                options["persistent_workers"] = True
            self._job_loader = DataLoader(
                self.dataset, batch_sampler=self._jobs, collate_fn=self.collate_fn, **options
            )
        self._jobs.items = items
        try:
            batches = [self.convert(raw) for raw in self._job_loader]  # the whole job: the next starts clean
        finally:
            self._jobs.items = []
        for batch, item in zip(batches, items):
            _check_rows(batch, len(item))
        return batches

    def batch(self, indices: np.ndarray | Sequence[int]) -> Batch:
        indices = np.asarray(indices, dtype=np.int64)
        if not len(indices):
            return self.empty()
        if self._rows is not None:
            return self._gather(indices)
        return self._load([indices.tolist()])[0]

    def draw(self, sampler: BatchSampler) -> Batch:
        if sampler.scheme == "full":
            return self.full()
        if self._rows is not None:  # nothing is drawn ahead: the sampler's pending draws, then new ones
            return self.batch(sampler.draw())
        stream = self._streams.get(id(sampler))
        if stream is None or stream.sampler is not sampler:
            feed = _Feed(sampler)
            stream = self._streams[id(sampler)] = _Stream(self._loader(feed), feed)
        drawn = stream.next()
        if drawn is None:
            return self.empty()
        raw, records = drawn
        return _check_rows(self.convert(raw), records)

    def full(self) -> Batch:
        if self._full is not None:
            return self._full
        n, size = self.n, self.chunk
        parts = self._load([list(range(s, min(n, s + size))) for s in range(0, n, size)])
        if len(parts) == 1:
            batch = parts[0]
        elif all(_trailing(p.inputs) == _trailing(parts[0].inputs) and _trailing(p.targets) ==
                 _trailing(parts[0].targets) for p in parts):
            batch = Batch(cat([p.inputs for p in parts]), cat([p.targets for p in parts]))
        else:  # a collate that pads per batch: the full batch is one batch
            del parts
            batch = self._load([list(range(n))])[0]
        if self.cache_full:
            self._full = batch
        return batch

    def chunks(self, size: int = CHUNK) -> Iterator[Batch]:
        n = self.n
        for start in range(0, n, size):  # one chunk at a time: memory bounded by the chunk
            yield self._load([list(range(start, min(n, start + size)))])[0]

    def probe(self, k: int = 1) -> Batch:
        if k <= PROBE or len(self._probe) == self.n:
            return Batch(self._probe.inputs[:k], self._probe.targets[:k])
        return self.batch(np.arange(min(k, self.n)))

    def _every_chunk(self) -> Iterator[Batch]:
        """Read in this process (not by the workers, whose random state is their own), with torch's, numpy's
        and Python's global generators seeded to a fixed value as for :meth:`fingerprint`, so that an
        augmentation drawing from them reads alike wherever the same records are read."""
        with _fixed_randomness():
            for start in range(0, self.n, CHUNK):
                yield self.convert(self._read(range(start, min(self.n, start + CHUNK))))

    def close(self) -> None:
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()
        self._job_loader = self._jobs = None

    # ---- binding ---------------------------------------------------------------------------------------
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            kind = type(self.dataset)
            collate = getattr(self.collate_fn, "__qualname__", type(self.collate_fn).__qualname__)
            head = f"dataset {kind.__module__}.{kind.__qualname__} n={self.n} collate={collate}"
            if self._named is not None:
                head += f" named {self._named}"
                self._fingerprint = "records " + hashlib.sha256(head.encode()).hexdigest()
                return self._fingerprint
            spread = sorted({int(i) for i in np.linspace(0, self.n - 1, FINGERPRINT_RECORDS).round()})
            with _fixed_randomness():
                x, y = self.convert(self._read(spread))
            values = data_fingerprint(data_leaves(x, y))
            self._fingerprint = "records " + hashlib.sha256(f"{head} {spread} {values}".encode()).hexdigest()
        return self._fingerprint


class _fixed_randomness:
    """torch's (CPU), numpy's and Python's global generators seeded to 0 inside, restored after."""

    def __enter__(self) -> None:
        self._torch = torch.random.get_rng_state()
        self._numpy = np.random.get_state()
        self._python = random.getstate()
        torch.random.default_generator.manual_seed(0)
        np.random.seed(0)
        random.seed(0)

    def __exit__(self, *exc: Any) -> None:
        torch.random.set_rng_state(self._torch)
        np.random.set_state(self._numpy)
        random.setstate(self._python)


__all__ = ["Batch", "DatasetRecords", "Records", "TensorRecords", "as_records", "records_fingerprint"]
