"""The run ledger: every release a run makes, in order, written down before it is made.

A *run* is one private computation on one dataset, from its first release to its last, however many times
it is checkpointed and resumed. Its ledger is born with it (a random run id), travels in every checkpoint of
it, and once the run has written a checkpoint file lives in a file of its own beside that first checkpoint,
``dpvr-run-<run id>.ledger``, one JSON line per release, each flushed to disk before the release is made (a
write-ahead log).

Each release gets a *sequence number*, unique in the run and increasing across every resume, and belongs to
a *segment*: the stretch of the run between two resumes that re-run released steps. A checkpoint records
the sequence number it was written at, and its accountant holds every release of the run up to it (the
invariant :meth:`RunLedger.releases_after` keeps): so a resume from *any* checkpoint of the run charges
exactly the ledger's releases after that number — the releases the run made since that checkpoint, in
whichever branch it made them — and then continues numbering after the ledger's last release.

Why segments: a re-run (a resume from a checkpoint the run had moved past) repeats released steps with
fresh noise. Its batches must not reuse the sampling randomness of the branch it repeats (two releases
of the same hidden batch are not two independently sampled mechanisms), so the re-run starts a new segment
with fresh sampling randomness, and the accountant groups releases whose privacy depends on a shared
allocation (random allocation's epochs, the last-iterate bound of one trajectory) by segment.

A ledger is bound to one process at a time: two processes resuming the same run at once would each miss
the other's releases.

Before the run has a file, what it released is known only to the chain of ledger objects that made the
releases (its *lineage*: the ledger an algorithm object was born with, and every ledger that took over from
it on an in-memory resume). A state taken in memory names its lineage; it can be charged exactly only while
that lineage is alive in this process (:meth:`RunLedger.of_state`), and is refused otherwise.

The file is readable and writable by its owner only (0600), like a checkpoint: it is created so, and a file
of the run found with a looser mode (written by an older version, or copied) is made so when the ledger
opens it, or refused if that fails. Nothing in it is secret on its own (no seed is written), but the run's
shape and history are the data holder's business.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import dp_accounting as dpa

from ..persistence import Journal
from ..privacy import event_from_dict, event_to_dict

LEDGER_PREFIX = "dpvr-run-"
LEDGER_SUFFIX = ".ledger"


@dataclass(frozen=True)
class Release:
    """One release of the run: its sequence number, segment, streams (a name, or ``{name: weight}`` for a
    release shared by several streams) and event; ``replace`` marks a whole-trajectory bound (last iterate)
    that supersedes its segment's earlier ones."""

    seq: int
    segment: str
    parts: str | Mapping[str, float]
    event: dpa.DpEvent
    replace: bool = False

    def to_dict(self, run: str) -> dict[str, Any]:
        return {
            "run": run,
            "seq": self.seq,
            "segment": self.segment,
            "parts": self.parts if isinstance(self.parts, str) else dict(self.parts),
            "event": event_to_dict(self.event),
            "replace": self.replace,
        }

    @classmethod
    def from_dict(cls, entry: Mapping[str, Any]) -> Release:
        parts = entry["parts"]
        return cls(
            int(entry["seq"]),
            str(entry["segment"]),
            parts if isinstance(parts, str) else {str(k): float(v) for k, v in parts.items()},
            event_from_dict(entry["event"]),
            bool(entry["replace"]),
        )


class LedgerError(ValueError):
    """A run's ledger is missing, unreadable, of another run or not known here: the releases after a
    checkpoint (or an in-memory state) cannot be charged, so the run cannot resume from it."""


class _Lineage:
    """What one chain of ledger objects knows of its run: the releases it made while the run had no file,
    and the file once it has one. Registered (weakly) under a random token, which states name."""

    __slots__ = ("__weakref__", "file", "memory", "run", "token")

    def __init__(self, run: str) -> None:
        self.run, self.token = run, secrets.token_hex(16)
        self.memory: list[Release] = []
        self.file: Journal | None = None
        _LINEAGES[self.token] = self


# The lineages alive in this process, by token: an in-memory state is charged from its lineage's releases
# while that lineage is alive (some algorithm object holds it); once it is gone they cannot be known.
_LINEAGES: weakref.WeakValueDictionary[str, _Lineage] = weakref.WeakValueDictionary()


def _ledger_journal(path: str) -> Journal:
    """The run ledger's file at ``path``, owner-only: created so, and a looser existing file tightened."""
    journal = Journal(path, private=True)
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return journal
    if mode & 0o077:
        try:
            os.chmod(path, stat.S_IRUSR | stat.S_IWUSR)
        except OSError as err:
            raise LedgerError(
                f"run ledger {path!r}: readable by others (mode {mode:o}) and cannot be made owner-only "
                f"({err.strerror}); the run ledger is kept owner-only, like its checkpoints"
            ) from None
    return journal


class RunLedger:
    """The ledger of one run (see the module documentation).

    Until :meth:`attach` gives it a file it keeps the releases this object made (every branch it ran) in
    memory; from then on every release is appended to the file before it is made, and read back from it."""

    def __init__(
        self, run: str | None = None, segment: str | None = None, seq: int = 0, branched: bool = False
    ) -> None:
        self.run = run if run is not None else secrets.token_hex(16)
        self.segment = segment if segment is not None else secrets.token_hex(8)
        self.seq = seq
        self.branched = branched  # some releases of the run were re-run: its releases are no longer one line
        self._lineage = _Lineage(self.run)

    @property
    def _file(self) -> Journal | None:
        return self._lineage.file

    @property
    def _memory(self) -> list[Release]:
        return self._lineage.memory

    @property
    def path(self) -> str | None:
        """The ledger's file, once the run has written a checkpoint file."""
        return None if self._file is None else self._file.path

    def admit(
        self, parts: str | Mapping[str, float], event: dpa.DpEvent, *, replace: bool = False
    ) -> Release:
        """Numbers the next release and writes it down (to disk first, when attached); returns it."""
        release = Release(self.seq + 1, self.segment, parts, event, replace)
        if self._file is not None:
            self._file.append(release.to_dict(self.run))
        else:  # once there is a file it holds every release: memory would only grow with the run
            self._memory.append(release)
        self.seq = release.seq
        return release

    def noise_context(self) -> bytes:
        """What every noise key of the next release is derived from besides the signal: the run, its
        segment and the release's sequence number, so that no two releases of a run share a key (on every
        device: no digest of the signal is needed for that)."""
        return f"{self.run}/{self.segment}/{self.seq}".encode()

    def attach(self, checkpoint: str | os.PathLike[str]) -> None:
        """Gives the ledger its file (once): beside ``checkpoint``, the run's first checkpoint file."""
        if self._file is not None:
            return
        directory = os.path.dirname(os.path.abspath(checkpoint))
        journal = _ledger_journal(os.path.join(directory, f"{LEDGER_PREFIX}{self.run}{LEDGER_SUFFIX}"))
        for entry in journal.entries():  # a file of this run already (a resume that had none in state)
            _check_run(entry, self.run, journal.path)
        if not os.path.exists(journal.path):
            journal.clear()  # the file every checkpoint will name exists from the first one on
        self._lineage.file = journal

    def detach(self) -> None:
        """Stops writing to the file: in a data-parallel run every process numbers the same releases, and
        one process (rank 0) writes them down."""
        self._lineage.file = None

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the ledger: the run, segment, sequence number, file and lineage."""
        return {
            "run": self.run,
            "segment": self.segment,
            "seq": self.seq,
            "branched": self.branched,
            "path": self.path,
            "lineage": self._lineage.token,
        }

    def releases_after(self, seq: int) -> list[Release]:
        """Every release of the run numbered after ``seq``: those this object made before the run had a file
        (memory), then the file's (every branch since)."""
        remembered = [r for r in self._memory if r.seq > seq]
        if self._file is None:
            return remembered
        try:
            entries = self._file.entries()
            for entry in entries:
                _check_run(entry, self.run, self._file.path)
            return remembered + [r for r in map(Release.from_dict, entries) if r.seq > seq]
        except LedgerError:
            raise
        except (ValueError, KeyError, TypeError) as err:
            raise LedgerError(
                f"run ledger {self._file.path!r}: unreadable ({err}); the releases after the checkpoint "
                "cannot be charged, so the run cannot resume from it"
            ) from None

    @classmethod
    def at(cls, state: Mapping[str, Any]) -> RunLedger:
        """A ledger standing where ``state`` (:meth:`state`) says, without its file or releases."""
        return cls(str(state["run"]), str(state["segment"]), int(state["seq"]), bool(state["branched"]))

    @classmethod
    def of_checkpoint(cls, state: Mapping[str, Any], checkpoint: str | os.PathLike[str]) -> RunLedger:
        """The ledger of the run a checkpoint ``state`` was written by, with its file: the file the state
        names, or the file of that name beside ``checkpoint`` (a run directory that was moved)."""
        ledger = cls.at(state)
        named = state.get("path")
        if named is None:
            raise LedgerError(f"checkpoint {os.fspath(checkpoint)!r}: its run ledger has no file")
        beside = os.path.join(os.path.dirname(os.path.abspath(checkpoint)), os.path.basename(named))
        for candidate in (named, beside):
            if os.path.exists(candidate):
                ledger._lineage.file = _ledger_journal(candidate)
                return ledger
        raise LedgerError(
            f"checkpoint {os.fspath(checkpoint)!r}: its run ledger {named!r} is missing (not there, nor "
            "beside the checkpoint); the releases the run made after this checkpoint cannot be charged, so "
            "it cannot resume from it. Keep the ledger file with the run's checkpoints."
        )

    @classmethod
    def of_state(cls, state: Mapping[str, Any]) -> RunLedger:
        """The ledger of the run an in-memory state (no file named) was taken in: standing where ``state``
        says, with the lineage that made the run's releases, which must be alive in this process (an
        algorithm object holds it). Otherwise what the run released after the state cannot be known:
        :class:`LedgerError`, naming the way that charges it (checkpoint files)."""
        lineage = _LINEAGES.get(str(state.get("lineage")))
        if lineage is None or lineage.run != str(state["run"]):
            raise LedgerError(
                f"state: taken in memory (state_dict) by a run that had no ledger file yet, and the object "
                f"that made its releases is not in this process any more, so what run {state['run']!r} "
                "released after this state cannot be known and charged. Resume from files instead: "
                "save_checkpoint, then load_checkpoint (the ledger file beside the checkpoint charges every "
                "release made after it)"
            )
        ledger = cls.at(state)
        ledger._lineage = lineage
        return ledger

    def sampler_seed(self, secret: int, k: int) -> int:
        """The seed of an algorithm's ``k``-th sampler in this segment of a reproducible run: keyed by
        ``secret`` (the noise generator's seed, which no ledger line shows), so that a re-run's batches
        are reproducible by whoever holds the seed (every process of a data-parallel run) and by nobody
        who reads only the ledger."""
        key = int(secret).to_bytes(8, "little")
        message = f"{self.run}/{self.segment}/{k}".encode()
        mac = hashlib.blake2b(message, key=key, digest_size=8, person=b"dpvr-sampler")
        return int.from_bytes(mac.digest(), "little")

    def resumed(self, rerun: bool, seed: int | None = None) -> None:
        """Continues numbering after the ledger's last release; a re-run starts a new segment (random, or
        derived from ``seed`` for a reproducible run, so that its replay is reproducible too)."""
        self.seq = max([self.seq, *(r.seq for r in self.releases_after(self.seq))])
        if rerun:
            self.branched = True
            self.segment = (
                secrets.token_hex(8)
                if seed is None
                else hashlib.sha256(f"{seed}/{self.run}/{self.seq}".encode()).hexdigest()[:16]
            )


def _check_run(entry: Any, run: str, path: str) -> None:
    if not isinstance(entry, Mapping) or entry.get("run") != run:
        found = entry.get("run") if isinstance(entry, Mapping) else None
        raise LedgerError(f"run ledger {path!r}: holds releases of run {found!r}, not of this run {run!r}")

