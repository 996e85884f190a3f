"""What every dpvr algorithm shares: its accountant, noise generator, budget guard, checkpoints and loop.

An algorithm owns everything that decides what it releases — sampling, per-sample clipping, noise — so the
accountant records exactly the releases that happened: each noisy release first asks the accountant whether
it fits the budget, then runs, then is recorded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import dp_accounting as dpa
import numpy as np
import torch
from torch import nn

from ..grads import trainable_parameters
from ..ops import NoiseGenerator
from ..persistence import Journal, read_checkpoint, write_checkpoint
from ..privacy import Accountant, PrivacyReport, account, event_from_dict, event_to_dict
from ..privacy.allocation import stream_dimensions
from ..privacy.calibration import calibrate
from ..privacy.events import PaperSigmas, Plan
from ..privacy.mechanism import noise_dict
from ..privacy.relations import tightest_accountant as tightest
from ..problems import LossFn
from .config import PrivacyConfig, RuntimeConfig, bound_fields

STATE_FORMAT = 3

# Constructor arguments bound otherwise: the objects fingerprinted on their own (model, loss, data) and the
# two config groups, whose bound fields are recorded one by one (:func:`dpvr.optim.config.bound_fields`).
_UNBOUND_ARGUMENTS = frozenset({"self", "model", "loss_fn", "problem", "inputs", "targets", "clients"})
_CONFIGS = ("privacy", "runtime")


class BudgetExhaustedError(RuntimeError):
    """The next release would take the privacy loss above the budget; nothing was released."""


class PrivateAlgorithm:
    """Base of the DP algorithms (see the module documentation).

    Subclasses set ``plan`` (the :mod:`dpvr.privacy.events` description of the run), ``noise`` (noise
    multiplier per stream), implement :meth:`step` and list their state tensors in :meth:`_buffers`.

    Every algorithm takes its own settings as keyword arguments named alike across algorithms (``lr``,
    ``steps``, ``restart``, ``batch_size``/``batch_sizes``, ``clip={stream: C}``), plus ``noise`` and the two
    shared groups ``privacy=`` :class:`~dpvr.optim.PrivacyConfig` (budget, delta, accountant, calibration)
    and ``runtime=`` :class:`~dpvr.optim.RuntimeConfig` (gradient mode, noise source, seeds, non-finite
    policy).

    Noise is given one way everywhere: ``noise={stream: z}``, a noise multiplier per named stream of the
    plan in the accountant's convention (one number for a one-stream plan), or :class:`~dpvr.PaperSigmas`
    to convert a paper's sigmas explicitly, or ``privacy.epsilon`` to calibrate all streams jointly.

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
        noise: Mapping[str, float] | float | None,
        privacy: PrivacyConfig,
        runtime: RuntimeConfig,
    ) -> None:
        for name, config, kind in (("privacy", privacy, PrivacyConfig), ("runtime", runtime, RuntimeConfig)):
            if not isinstance(config, kind):
                raise TypeError(f"{name}: expected a {kind.__name__}, got {type(config).__name__}")
        self.privacy, self.runtime = privacy, runtime
        self.nonfinite = runtime.nonfinite
        self.model, self.loss_fn, self.plan = model, loss_fn, plan
        self.param_names, self.params = map(list, zip(*trainable_parameters(model)))
        for name, p in zip(self.param_names, self.params):
            if not p.is_contiguous():
                raise ValueError(f"parameter {name}: must be contiguous")
        self.flat = [p.detach().view(-1) for p in self.params]
        epsilon, delta = privacy.epsilon, privacy.delta
        accountant = privacy.accountant or tightest_accountant(plan)
        if noise is None:
            if epsilon is None:
                raise ValueError(
                    "give noise={stream: noise multiplier}, or privacy=PrivacyConfig(epsilon=...) to "
                    "calibrate it"
                )
            noise = calibrate(
                plan,
                epsilon,
                delta,
                accountant=accountant,
                calibration=privacy.calibration,
                shares=privacy.shares,
                dimensions=(  # public: parameter counts and the max block's length
                    stream_dimensions(plan, self._parameter_count(), getattr(self, "problem", None))
                    if privacy.shares == "auto"
                    else None
                ),
                units=self._noise_units() if privacy.shares == "auto" else None,
                **(privacy.paper_options if privacy.calibration == "paper" else {}),
            )
        elif isinstance(noise, PaperSigmas):
            noise = plan.noise_from_paper(noise)
        elif isinstance(noise, Mapping):
            noise = plan.streams_of_run(noise)
        self.noise = noise_dict(plan.streams, noise)
        self.accountant = Accountant(accountant, plan.neighbouring)
        mechanism = plan.mechanism(self.noise)
        for assumption in mechanism.assumptions:
            self.accountant.assume(assumption)
        # The planned run, priced once. While every stream has made no more releases than the plan counts, a
        # release is admitted without recomputing epsilon: the run so far is then a sub-run of the plan (a
        # post-processing of it), so it spends no more than the plan's bound, which is within the budget.
        self._planned = {s.name: s.count for s in mechanism.streams}
        self._released: dict[str, int] = {}
        self._within_plan = epsilon is not None and (
            account(mechanism, delta, accountant=accountant).epsilon <= epsilon
        )
        self.generator = runtime.generator if runtime.generator is not None else NoiseGenerator()
        self.steps_done = 0
        self.optimizer: torch.optim.Optimizer | None = None  # set by algorithms that step with one
        self._journal: ReleaseJournal | None = None  # releases since the last checkpoint file

    @property
    def epsilon_budget(self) -> float | None:
        """The budget every release is admitted against (``privacy.epsilon``)."""
        return self.privacy.epsilon

    @property
    def delta(self) -> float:
        return self.privacy.delta

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
            if name in _CONFIGS:
                for field, setting in bound_fields(value).items():
                    bound[f"{name}.{field}"] = _canonical(setting)
            else:
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
        released = self._released.get(stream, 0) + 1
        within_plan = self._within_plan and released <= self._planned.get(stream, 0)
        if not within_plan and self.epsilon_budget is not None and self.accountant.would_exceed(
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
        self._released[stream] = released  # counted when admitted: a release that then fails still counts
        return parts, event

    def _admit_round(self, releases: Mapping[str, int]) -> None:
        """Refuses, before any of them happens, a round of releases (``{stream: count}``) that would not fit
        the budget as a whole, so that a run never stops half-way through a round (each release is then
        admitted and recorded as usual)."""
        if self.epsilon_budget is None or all(
            self._within_plan and self._released.get(s, 0) + c <= self._planned.get(s, 0)
            for s, c in releases.items()
        ):
            return
        events = [dpa.SelfComposedDpEvent(self.plan.step(s, self.noise)[1], c) for s, c in releases.items()]
        round_event = dpa.ComposedDpEvent([e for e in events if e.count])
        if self.accountant.would_exceed(next(iter(releases)), round_event, self.epsilon_budget, self.delta):
            spent = self.accountant.epsilon(self.delta) if self.accountant.streams else 0.0
            raise BudgetExhaustedError(
                f"{self.name}: the next round ({', '.join(f'{c} x {s!r}' for s, c in releases.items())}) "
                f"would exceed the budget epsilon={self.epsilon_budget:g} at delta={self.delta:g} (spent so "
                f"far: epsilon={spent:.4g} after {self.steps_done} steps); nothing of it was released"
            )

    def _record(self, admitted: tuple[Any, Any]) -> None:
        self.accountant.record(*admitted)

    @contextlib.contextmanager
    def releasing(self, stream: str) -> Iterator[None]:
        """One release of ``stream``: admitted (budget guard, journal) on entry, recorded in the accountant
        when the block completes. A block that raises is not recorded: what it released, if anything, is
        charged on resume from the journal."""
        admitted = self._admit(stream)
        yield
        self._record(admitted)

    def _parameter_count(self) -> int:
        return sum(p.numel() for p in self.params)

    def _noise_units(self) -> dict[str, float] | None:
        """For ``shares="auto"``: the public radius or sensitivity each stream's noise multiplier is relative
        to, relative to the others' (``None``: equal). Called during construction, before calibration."""
        return None

    def std(self, stream: str, unit: float) -> float:
        """The noise std of a release of ``stream`` whose per-record unit of sensitivity is ``unit`` (its
        clip radius, or half the replace-one range of a one-sided term): ``unit`` times the plan's noise per
        unit."""
        return self.plan.sigma(self.noise[stream], stream) * unit

    def privacy_spent(self, delta: float | None = None) -> PrivacyReport:
        """(epsilon, delta) of everything released so far, from the releases actually made; per stream its
        share of the spend and its noise multiplier."""
        report = self.accountant.report(self.delta if delta is None else delta)
        return dataclasses.replace(report, noise_multipliers=dict(self.noise))

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
        progress: bool = False,
        callback: Callable[[int, dict[str, float]], None] | None = None,
    ) -> list[dict[str, float]]:
        """Runs ``steps`` steps (default: what remains of the planned run); returns per-step info.
        ``progress=True`` shows a progress bar (the library prints nothing unless asked)."""
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
            "released": dict(self._released),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
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
            released = {str(k): int(v) for k, v in state["released"].items()}
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise ValueError(f"state: not a {self.name} checkpoint ({err!r})") from None
        with torch.no_grad():
            for p, v in zip(self.params, state["params"]):
                p.copy_(v)
            for k, tensors in self._buffers().items():
                for t, v in zip(tensors, state["buffers"][k]):
                    t.copy_(v)
        generator.bind(self._noise_context)
        self.generator, self.accountant, self.steps_done = generator, accountant, steps
        self._released = released
        self._load_extra_state(state["extra"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Writes :meth:`state_dict` to ``path`` atomically (:func:`dpvr.persistence.write_checkpoint`), so a
        crash leaves the old checkpoint or the new one, never a mixture, then empties the release journal
        (the new checkpoint's accountant holds those releases). Like the state, the file holds the noise
        seed: it is readable by its owner only; protect it like the data.
        """
        write_checkpoint(path, self.state_dict(), self.name)
        self._journal = ReleaseJournal(path)
        self._journal.start()

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restores a :meth:`save_checkpoint` file; refuses (``ValueError``) a file that is truncated,
        altered, of another format version, of another algorithm or of a run with other settings
        (:meth:`load_state_dict`), before changing anything.

        The releases the earlier run made after writing the checkpoint (its release journal, ``path`` +
        ``".releases"``) are charged to the restored accountant: they happened, and the steps that now
        replay them are releases too (with fresh noise unless bit-identical), charged as they run."""
        state = read_checkpoint(path, self.name)
        journal = ReleaseJournal(path)
        released = journal.read()
        self.load_state_dict(state)
        for parts, event in released:
            self.accountant.record(parts, event)
        if released:  # journaled releases are charged on top of the plan's: check every release from now on
            self._within_plan = False
        self._journal = journal


class ReleaseJournal:
    """The releases a run made since it wrote its checkpoint ``path``: one JSON line per release in
    ``path + ".releases"``, written and flushed to disk before the release is made (a write-ahead log).

    A crash after a release loses the in-memory accountant but not the journal, so a resume from the
    checkpoint can charge what was released after it. :meth:`start` empties the journal when a new
    checkpoint (which holds the accountant so far) has been written."""

    def __init__(self, checkpoint: str | os.PathLike) -> None:
        self._file = Journal(os.fspath(checkpoint) + ".releases")
        self.path = self._file.path

    def start(self) -> None:
        self._file.clear()

    def append(self, parts: Mapping[str, float] | str, event: Any) -> None:
        self._file.append({"parts": parts, "event": event_to_dict(event)})

    def read(self) -> list[tuple[Any, Any]]:
        """The journaled releases; none if there is no journal. A torn last line (a crash mid-write) is a
        release that may have happened: it is refused rather than guessed."""
        try:
            return [(e["parts"], event_from_dict(e["event"])) for e in self._file.entries()]
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f"release journal {self.path!r}: unreadable; the releases after the checkpoint cannot be "
                "charged, so the run cannot resume from it"
            ) from None


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
    if isinstance(value, torch.optim.Optimizer):
        # Its kind and constructor hyper-parameters; not its state, nor the group values a scheduler changes.
        return {"optimizer": type(value).__qualname__, "defaults": _canonical(value.defaults, depth + 1)}
    if isinstance(value, nn.Module):
        return {"module": type(value).__qualname__, **_canonical(value.state_dict(), depth + 1)}
    if dataclasses.is_dataclass(value):
        fields = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return {"type": type(value).__qualname__, **_canonical(fields, depth + 1)}
    if hasattr(value, "__dict__") and not callable(value):
        return {"type": type(value).__qualname__, **_canonical(vars(value), depth + 1)}
    return type(value).__qualname__ if callable(value) else repr(value)


def tightest_accountant(plan: Plan) -> str:
    """``"pld"`` where the PLD accountant can price every release of ``plan``, else ``"rdp"``
    (:func:`dpvr.privacy.relations.tightest_accountant`)."""
    return tightest(plan.mechanism(dict.fromkeys(plan.streams, 1.0)).event, plan.neighbouring)


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
