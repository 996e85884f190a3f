"""What every dpvr algorithm shares: its accountant, noise generator, budget guard, checkpoints and loop.

An algorithm owns everything that decides what it releases — sampling, per-sample clipping, noise — so the
accountant records exactly the releases that happened: each noisy release first asks the accountant whether
it fits the budget, then runs, then is recorded.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import io
import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..grads import trainable_parameters
from ..ops import NoiseGenerator, check_nonfinite
from ..privacy import Accountant, PrivacyReport, event_from_dict, event_to_dict
from ..privacy.calibration import calibrate
from ..privacy.events import PaperSigmas, Plan
from ..privacy.mechanism import noise_dict

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
STATE_FORMAT = 2
CHECKPOINT_MAGIC = b"DPVR-CHECKPOINT\n"
CHECKPOINT_VERSION = 2

# Constructor arguments that do not shape what a run releases: the budget (it only stops a run), the
# accountant and calibration (the noise they produce is bound itself), the noise source (restored from the
# state) and the objects fingerprinted on their own (model, loss, data).
_UNBOUND_ARGUMENTS = frozenset({
    "self", "model", "loss_fn", "problem", "inputs", "targets", "clients", "generator", "epsilon", "delta",
    "calibration", "accountant", "u", "sampler_seed",
})


class BudgetExhaustedError(RuntimeError):
    """The next release would take the privacy loss above the budget; nothing was released."""


class PrivateAlgorithm:
    """Base of the DP algorithms (see the module documentation).

    Subclasses set ``plan`` (the :mod:`dpvr.privacy.events` description of the run), ``noise`` (noise
    multiplier per stream), implement :meth:`step` and list their state tensors in :meth:`_buffers`.

    Noise is given one way everywhere: ``noise={stream: z}``, a noise multiplier per named stream of the
    plan in the accountant's convention (one number for a one-stream plan), or :class:`~dpvr.PaperSigmas`
    to convert a paper's sigmas explicitly, or ``epsilon`` to calibrate all streams jointly.

    ``nonfinite`` is the policy for a record whose contribution to any release is not finite: ``"zero"``
    (the default: it contributes nothing, which keeps every sensitivity bound) or ``"raise"``
    (:class:`dpvr.ops.NonFiniteError` before the release; the error reveals that such a record exists, so
    use it to debug, not in a private run).

    What the guarantee covers: the released iterates (or, for last-iterate algorithms, the last one). The
    dictionaries :meth:`step` returns are diagnostics for the data holder: entries such as ``nonfinite``
    (samples dropped for non-finite gradients) are computed from the private data without noise and must
    not be published; entries derived from released iterates (clip radii, step lengths) may be.

    Resuming (:meth:`load_state_dict`, :meth:`load_checkpoint`) is bound to the run. Protected:

    - a state is loaded only into an algorithm with the same *binding* (:meth:`binding`): algorithm, plan
      (steps, schedule, sampling, batch sizes, neighbouring relation), noise multipliers, every constructor
      setting that shapes a release (clip radii, learning rates, ...), non-finite policy, parameter names,
      shapes and dtypes, and a SHA-256 fingerprint of the private data; a load that differs is refused
      with a message naming every entry that differs;
    - noise cannot be reused by construction: the generator is bound to a digest of the binding, and every
      noise key also depends on a digest of the signal that release adds noise to, so two releases share a
      noise draw only if their signals are bit-identical (their difference is then a function of earlier
      releases, and reveals nothing new);
    - releases are not lost to a crash: after :meth:`save_checkpoint`, every release is journaled to disk
      (:class:`ReleaseJournal`) before it is made, and :meth:`load_checkpoint` charges the journaled
      releases; the steps that replay them are charged again as they run (conservatively, even when a
      replay is bit-identical and so reveals nothing new).

    Not protected: :meth:`load_state_dict` of an in-memory state has no journal, so releases made after
    that state was taken are not charged; resume from checkpoint files. A state holds the noise seed: keep
    it as confidential as the data.
    """

    name = "private-algorithm"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = _recording_arguments(cls.__init__)

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        *,
        plan: Plan,
        delta: float,
        epsilon: float | None,
        noise: Mapping[str, float] | float | None,
        calibration: str,
        accountant: str,
        generator: NoiseGenerator | None,
        nonfinite: str = "zero",
        **paper_options: float,
    ) -> None:
        if not 0 < delta < 1:
            raise ValueError(f"delta: must be in (0, 1), got {delta}")
        if epsilon is not None and not epsilon > 0:
            raise ValueError(f"epsilon: must be > 0, got {epsilon}")
        self.nonfinite = check_nonfinite(nonfinite)
        self.model, self.loss_fn, self.plan = model, loss_fn, plan
        self.param_names, self.params = map(list, zip(*trainable_parameters(model)))
        for name, p in zip(self.param_names, self.params):
            if not p.is_contiguous():
                raise ValueError(f"parameter {name}: must be contiguous")
        self.flat = [p.detach().view(-1) for p in self.params]
        if noise is None:
            if epsilon is None:
                raise ValueError("give noise={stream: noise multiplier} or a target epsilon to calibrate it")
            noise = calibrate(
                plan, epsilon, delta, accountant=accountant, calibration=calibration, **paper_options
            )
        elif isinstance(noise, PaperSigmas):
            noise = plan.noise_from_paper(noise)
        elif isinstance(noise, Mapping):
            noise = plan.streams_of_run(noise)
        self.noise = noise_dict(plan.streams, noise)
        self.epsilon_budget, self.delta = epsilon, delta
        self.accountant = Accountant(accountant, plan.neighbouring)
        for assumption in plan.mechanism(self.noise).assumptions:
            self.accountant.assume(assumption)
        self.generator = generator if generator is not None else NoiseGenerator()
        self.steps_done = 0
        self._journal: ReleaseJournal | None = None  # releases since the last checkpoint file

    # ---- binding -------------------------------------------------------------------------------------
    def _data(self) -> Sequence[torch.Tensor] | str:
        """The private data (tensors, hashed for the binding), or a fingerprint of it."""
        return []

    def binding(self, *, data: bool = True) -> dict[str, Any]:
        """Every setting that shapes what this run releases, as a flat dictionary of canonical values.

        A state is loaded only into an algorithm with an equal binding; the generator's noise keys are
        derived from a digest of it (the data fingerprint excepted, so that a run whose clients hold the
        data elsewhere draws the same noise as the same run in one process)."""
        bound = {"algorithm": self.name, "nonfinite": self.nonfinite}
        bound.update({f"noise.{k}": v for k, v in sorted(self.noise.items())})
        for f in dataclasses.fields(self.plan) if dataclasses.is_dataclass(self.plan) else ():
            bound[f"plan.{f.name}"] = _canonical(getattr(self.plan, f.name))
        for name, value in sorted(getattr(self, "_arguments", {}).items()):
            bound[f"setting.{name}"] = _canonical(value)
        for name, p in zip(self.param_names, self.params):
            bound[f"parameter.{name}"] = f"{tuple(p.shape)} {p.dtype}"
        if data:
            private = self._data()
            bound["data"] = private if isinstance(private, str) else data_fingerprint(private)
        return bound

    def _bind_noise(self) -> None:
        """Derive the generator's keys from this run's binding (call once the subclass is built)."""
        settings = self.binding(data=False)
        self._noise_context = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).digest()
        self.generator.bind(self._noise_context)

    # ---- privacy -------------------------------------------------------------------------------------
    def _admit(self, stream: str) -> tuple[Any, Any]:
        """The accounting of one release of ``stream``; raises if it would exceed the budget. After a
        checkpoint the release is journaled here, before it happens (a release that then fails is charged
        on resume all the same: conservative)."""
        parts, event = self.plan.step(stream, self.noise)
        if self.epsilon_budget is not None and self.accountant.would_exceed(
            parts, event, self.epsilon_budget, self.delta
        ):
            spent = self.accountant.epsilon(self.delta) if self.accountant.streams else 0.0
            raise BudgetExhaustedError(
                f"{self.name}: the next '{stream}' release would exceed the budget epsilon="
                f"{self.epsilon_budget:g} at delta={self.delta:g} (spent so far: epsilon={spent:.4g} "
                f"after {self.steps_done} steps)"
            )
        if self._journal is not None:
            self._journal.append(parts, event)
        return parts, event

    def _record(self, admitted: tuple[Any, Any]) -> None:
        self.accountant.record(*admitted)

    def privacy_spent(self, delta: float | None = None) -> PrivacyReport:
        """(epsilon, delta) of everything released so far, from the releases actually made."""
        return self.accountant.report(self.delta if delta is None else delta)

    # ---- running -------------------------------------------------------------------------------------
    @property
    def total_steps(self) -> int:
        raise NotImplementedError

    def step(self) -> dict[str, float]:
        raise NotImplementedError

    def run(
        self,
        steps: int | None = None,
        *,
        progress: bool = True,
        callback: Callable[[int, dict[str, float]], None] | None = None,
    ) -> list[dict[str, float]]:
        """Runs ``steps`` steps (default: what remains of the planned run); returns per-step info."""
        from tqdm import tqdm

        remaining = self.total_steps - self.steps_done if steps is None else steps
        history = []
        for _ in tqdm(range(remaining), desc=self.name, disable=not progress, leave=False):
            info = self.step()
            history.append(info)
            if callback is not None:
                callback(self.steps_done, info)
        return history

    # ---- checkpoints ---------------------------------------------------------------------------------
    def _buffers(self) -> dict[str, list[torch.Tensor]]:
        return {}

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        del state

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: parameters, estimator buffers, noise counters, accountant.

        It contains the noise seed: keep checkpoints as confidential as the training data.
        """
        return {
            "format": STATE_FORMAT,
            "algorithm": self.name,
            "binding": self.binding(),
            "steps_done": self.steps_done,
            "params": [p.detach().clone() for p in self.params],
            "buffers": {k: [t.clone() for t in v] for k, v in self._buffers().items()},
            "generator": self.generator.state_dict(),
            "accountant": self.accountant.state_dict(),
            "extra": self._extra_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a :meth:`state_dict`; validates it fully before changing anything."""
        try:
            if state["format"] != STATE_FORMAT or state["algorithm"] != self.name:
                raise ValueError(f"state: written by {state['algorithm']!r} format {state['format']}")
            params, buffers = state["params"], state["buffers"]
            _check_tensors("params", params, self.params)
            mine = self._buffers()
            if set(buffers) != set(mine):
                raise ValueError(f"state: buffers {sorted(buffers)} differ from {sorted(mine)}")
            for k in mine:
                _check_tensors(k, buffers[k], mine[k])
            mine_bound, theirs = self.binding(), dict(state["binding"])
            differ = sorted(k for k in set(mine_bound) | set(theirs) if mine_bound.get(k) != theirs.get(k))
            if differ:
                shown = "; ".join(
                    f"{k}: checkpoint {theirs.get(k)!r}, here {mine_bound.get(k)!r}" for k in differ
                )
                raise ValueError(
                    f"state: written by a {self.name} run with other settings, and resuming it here could "
                    f"release what that run already released under other conditions; differs in {shown}"
                )
        except (KeyError, TypeError) as err:
            raise ValueError(f"state: not a {self.name} checkpoint ({err!r})") from None
        self._restore(state)

    def _restore(self, state: Mapping[str, Any]) -> None:
        """Installs a :meth:`state_dict`: the second half of :meth:`load_state_dict`, without its checks.
        Called directly only by tests that replay one run's history on a neighbouring dataset."""
        try:
            generator = NoiseGenerator.from_state_dict(state["generator"])
            accountant = Accountant.from_state_dict(state["accountant"])
            steps = int(state["steps_done"])
        except (KeyError, TypeError) as err:
            raise ValueError(f"state: not a {self.name} checkpoint ({err!r})") from None
        with torch.no_grad():
            for p, v in zip(self.params, state["params"]):
                p.copy_(v)
            for k, tensors in self._buffers().items():
                for t, v in zip(tensors, state["buffers"][k]):
                    t.copy_(v)
        generator.bind(self._noise_context)
        self.generator, self.accountant, self.steps_done = generator, accountant, steps
        self._load_extra_state(state["extra"])

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Writes :meth:`state_dict` to ``path`` atomically (a temporary file in the same directory, flushed
        to disk, renamed over ``path``, the directory flushed), so a crash leaves the old checkpoint or the
        new one, never a mixture. The file is a magic line, a JSON header (format version, payload length,
        SHA-256 of the payload) and the payload. Like the state, it holds the noise seed: protect it like
        the data.
        """
        buffer = io.BytesIO()
        torch.save(self.state_dict(), buffer)
        payload = buffer.getvalue()
        header = {
            "version": CHECKPOINT_VERSION,
            "algorithm": self.name,
            "length": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
        }
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".checkpoint-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(CHECKPOINT_MAGIC + json.dumps(header).encode() + b"\n" + payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        _fsync_directory(directory)  # the rename itself survives a crash
        self._journal = ReleaseJournal(path)
        self._journal.start()

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restores a :meth:`save_checkpoint` file; refuses (``ValueError``) a file that is truncated,
        altered, of another format version, of another algorithm or of a run with other settings
        (:meth:`load_state_dict`), before changing anything.

        The releases the earlier run made after writing the checkpoint (its release journal, ``path`` +
        ``".releases"``) are charged to the restored accountant: they happened, and the steps that now
        replay them are releases too (with fresh noise unless bit-identical), charged as they run."""
        state = read_checkpoint(path)
        if state.get("algorithm") != self.name:
            raise ValueError(
                f"checkpoint {os.fspath(path)!r}: written by {state.get('algorithm')!r}, not {self.name}"
            )
        journal = ReleaseJournal(path)
        released = journal.read()
        self.load_state_dict(state)
        for parts, event in released:
            self.accountant.record(parts, event)
        self._journal = journal


class ReleaseJournal:
    """The releases a run made since it wrote its checkpoint ``path``: one JSON line per release in
    ``path + ".releases"``, written and flushed to disk before the release is made (a write-ahead log).

    A crash after a release loses the in-memory accountant but not the journal, so a resume from the
    checkpoint can charge what was released after it. :meth:`start` empties the journal when a new
    checkpoint (which holds the accountant so far) has been written."""

    def __init__(self, checkpoint: str | os.PathLike) -> None:
        self.path = os.fspath(checkpoint) + ".releases"

    def start(self) -> None:
        with open(self.path, "wb") as f:
            os.fsync(f.fileno())
        _fsync_directory(os.path.dirname(os.path.abspath(self.path)))

    def append(self, parts: Mapping[str, float] | str, event: Any) -> None:
        line = json.dumps({"parts": parts, "event": event_to_dict(event)}, sort_keys=True) + "\n"
        with open(self.path, "ab") as f:
            f.write(line.encode())
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> list[tuple[Any, Any]]:
        """The journaled releases; none if there is no journal. A torn last line (a crash mid-write) is a
        release that may have happened: it is refused rather than guessed."""
        if not os.path.exists(self.path):
            return []
        with open(self.path, "rb") as f:
            lines = f.read().splitlines()
        try:
            entries = [json.loads(line) for line in lines if line.strip()]
            return [(e["parts"], event_from_dict(e["event"])) for e in entries]
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f"release journal {self.path!r}: unreadable; the releases after the checkpoint cannot be "
                "charged, so the run cannot resume from it"
            ) from None


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The state a :meth:`PrivateAlgorithm.save_checkpoint` file holds, after checking its magic line,
    format version, length and SHA-256; only tensors and plain containers are unpickled."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(CHECKPOINT_MAGIC):
        raise ValueError(f"checkpoint {os.fspath(path)!r}: not a dpvr checkpoint (bad magic)")
    head, sep, payload = data[len(CHECKPOINT_MAGIC) :].partition(b"\n")
    try:
        header = json.loads(head) if sep else None
        version, length, digest = header["version"], int(header["length"]), str(header["sha256"])
    except (ValueError, TypeError, KeyError):
        raise ValueError(f"checkpoint {os.fspath(path)!r}: unreadable header (truncated?)") from None
    if version != CHECKPOINT_VERSION:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r}: format version {version!r}, this dpvr reads "
            f"{CHECKPOINT_VERSION}"
        )
    if len(payload) != length:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r}: truncated or padded ({len(payload)} payload bytes, "
            f"header says {length})"
        )
    if hashlib.sha256(payload).hexdigest() != digest:
        raise ValueError(f"checkpoint {os.fspath(path)!r}: checksum mismatch (the file was altered)")
    return torch.load(io.BytesIO(payload), weights_only=True)


def _recording_arguments(init: Callable[..., None]) -> Callable[..., None]:
    """Wraps a subclass ``__init__`` so that the outermost call records its bound arguments (the settings a
    checkpoint binds), before the constructor runs."""
    signature = inspect.signature(init)

    @functools.wraps(init)
    def wrapper(self: PrivateAlgorithm, *args: Any, **kwargs: Any) -> None:
        outermost = "_arguments" not in self.__dict__
        if outermost:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            arguments = {}
            for name, value in bound.arguments.items():
                kind = signature.parameters[name].kind
                if kind is inspect.Parameter.VAR_KEYWORD:
                    arguments.update(value)
                elif kind is not inspect.Parameter.VAR_POSITIONAL:
                    arguments[name] = value
            self._arguments = {k: v for k, v in arguments.items() if k not in _UNBOUND_ARGUMENTS}
        init(self, *args, **kwargs)
        if outermost:
            self._bind_noise()

    return wrapper


def _canonical(value: Any, depth: int = 0) -> Any:
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
        return {str(k): _canonical(v, depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v, depth + 1) for v in value]
    if isinstance(value, nn.Module):
        return {"module": type(value).__qualname__, **_canonical(value.state_dict(), depth + 1)}
    if dataclasses.is_dataclass(value):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return {"type": type(value).__qualname__, **_canonical(fields, depth + 1)}
    if hasattr(value, "__dict__") and not callable(value):
        return {"type": type(value).__qualname__, **_canonical(vars(value), depth + 1)}
    return type(value).__qualname__ if callable(value) else repr(value)


def data_fingerprint(tensors: Sequence[torch.Tensor]) -> str:
    """SHA-256 of the tensors' shapes, dtypes and values."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{tuple(t.shape)} {t.dtype};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _check_tensors(name: str, given: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> None:
    if len(given) != len(expected) or any(
        not isinstance(g, torch.Tensor) or g.shape != e.shape or g.dtype != e.dtype
        for g, e in zip(given, expected)
    ):
        raise ValueError(f"state: {name} do not match this model's shapes/dtypes")
    if any(not torch.isfinite(g).all() for g in given):
        raise ValueError(f"state: {name} contain non-finite values")


def global_norm(tensors: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors))
