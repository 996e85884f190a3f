"""What every dpvr algorithm shares: its accountant, noise generator, budget guard, run ledger, checkpoints
and loop.

An algorithm owns everything that decides what it releases — sampling, per-sample clipping, noise — so the
accountant records exactly the releases that happened: each noisy release first asks the accountant whether
it fits the budget, is written into the run's ledger (:mod:`dpvr.optim.ledger`), runs, then is recorded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from ..grads import trainable_parameters
from ..ops import NoiseGenerator
from ..persistence import read_checkpoint, write_checkpoint
from ..privacy import Accountant, PrivacyReport, account
from ..privacy.allocation import HasYDim, stream_dimensions
from ..privacy.events import PaperSigmas, Plan
from ..problems import LossFn
from .binding import bind_run, canonical, data_fingerprint, digest
from .config import PrivacyConfig, RuntimeConfig, bound_fields
from .guard import BudgetExhaustedError as BudgetExhaustedError  # re-exported
from .guard import Guarded, PrivacyGuard, resolve_noise, tightest_accountant
from .ledger import Release, RunLedger
from .records import Records, records_fingerprint
from .sampling import BatchSampler

STATE_FORMAT = 4

# Settings that are config groups, whose bound fields are recorded one by one
# (:func:`dpvr.optim.config.bound_fields`).
_CONFIGS = ("privacy", "runtime")

PrivateData = str | Records | Sequence[Records] | Sequence[torch.Tensor]


class PrivateAlgorithm(Guarded):
    """Base of the DP algorithms (see the module documentation).

    Subclasses pass to ``__init__`` their ``plan`` (the :mod:`dpvr.privacy.events` description of the run,
    whose ``steps`` are the run's), the ``noise`` they were given (resolved to one multiplier per stream by
    :func:`~dpvr.optim.guard.resolve_noise`, with the public ``units`` and ``problem`` that
    ``shares="auto"`` needs), their ``settings`` (explicitly: every constructor argument that shapes a
    release, by name, the ``privacy`` and ``runtime`` groups included, as given; :meth:`binding` records
    them) and their private ``data`` (records, hashed for the binding); they implement :meth:`_step` (the
    base :meth:`step` guards the plan's length and counts the steps) and list their state tensors in
    :meth:`_buffers`. The privacy side of the run (accountant, budget guard, run ledger) is a composed
    :class:`~dpvr.optim.guard.PrivacyGuard` (``self.guard``).

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
    (samples dropped for non-finite gradients) and ``loss`` (the batch's mean loss) are computed from the
    private data without noise and must not be published; entries derived from released iterates (clip
    radii, step lengths) may be.

    Resuming (:meth:`load_state_dict`, :meth:`load_checkpoint`) is bound to the run. Protected:

    - a state is loaded only into an algorithm with the same *binding* (:meth:`binding`): algorithm, plan
      (steps, schedule, sampling, batch sizes, neighbouring relation), noise multipliers, every constructor
      setting that shapes a release (clip radii, learning rates, ...), non-finite policy, parameter names,
      shapes and dtypes, and a SHA-256 fingerprint of the private data; a load that differs is refused
      with a message naming every entry that differs;
    - every release of the run is charged, whatever is resumed: each release is written into the run's
      ledger (:class:`~dpvr.optim.ledger.RunLedger`, one per run, kept beside its first checkpoint file and
      named in every checkpoint) before it is made, and a resume from *any* checkpoint of the run charges
      every release the run made after that checkpoint, in any branch (a crash's last release included);
      the steps that then re-run released steps are charged again as they run;
    - a re-run is a new segment of the run: its noise keys and its batches are fresh (the sampling
      randomness of the branch it repeats is not reused: the two branches are then independently sampled
      mechanisms, which is what composing their charges assumes); in a reproducible run the re-run's
      sampler seeds are keyed by the noise seed, so the ledger (which names the segment) does not predict
      its batches;
    - a state held only in memory (:meth:`state_dict`, taken before the run had a ledger file) is charged
      from the ledgers that made the run's releases while the algorithm object holding them is alive in
      this process (this object or another); otherwise what the run released after it cannot be known,
      and the state is refused (:class:`~dpvr.optim.ledger.LedgerError`): resume from checkpoint files;
    - noise cannot be reused by construction: the generator is bound to a digest of the binding, every key
      also depends on the release's ledger entry (never repeated in a run) and, on the host, on a digest
      of the signal the noise is added to.

    A state holds the noise seed: keep it as confidential as the data.
    """

    name = "private-algorithm"
    #: The keyword settings the constructor takes no default for: ``make_private`` names every one missing
    #: (with the run's other problems, at once) before it builds anything. Each algorithm states its own.
    required_settings: tuple[str, ...] = ()
    #: The streams clipped each with a radius of its own (``clip={stream: radius}``; empty where ``clip`` is
    #: one radius), and those of them whose radius is a pair of constants; the constructor checks ``clip``
    #: against them (:func:`~dpvr.optim.config.stream_clips`), ``make_private`` shows them as an example.
    clip_streams: tuple[str, ...] = ()
    clip_pairs: tuple[str, ...] = ()
    #: Whether only the final iterate is released (and accounted), so that no intermediate iterate may be
    #: shown to anyone: ``make_private``'s trainer refuses callbacks before the last step.
    releases_last_iterate_only: bool = False

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        *,
        plan: Plan,
        noise: Mapping[str, float] | float | PaperSigmas | None,
        privacy: PrivacyConfig,
        runtime: RuntimeConfig,
        settings: Mapping[str, Any],
        data: PrivateData = (),
        units: Mapping[str, float] | None = None,
        problem: HasYDim | None = None,
    ) -> None:
        for name, config, kind in (("privacy", privacy, PrivacyConfig), ("runtime", runtime, RuntimeConfig)):
            if not isinstance(config, kind):
                raise TypeError(f"{name}: expected a {kind.__name__}, got {type(config).__name__}")
        _check_public_size(self.name, plan, privacy.public_dataset_size)
        self.privacy, self.runtime = privacy, runtime
        self.nonfinite = runtime.nonfinite
        self.model, self.loss_fn, self.plan = model, loss_fn, plan
        self.settings = dict(settings)
        self._private_data = data
        self.param_names, self.params = map(list, zip(*trainable_parameters(model)))
        for name, p in zip(self.param_names, self.params):
            if not p.is_contiguous():
                raise ValueError(f"parameter {name}: must be contiguous")
        self.flat = [p.detach().view(-1) for p in self.params]
        count = sum(p.numel() for p in self.params)  # public, like the max block's length
        dimensions = stream_dimensions(plan, count, problem) if privacy.shares == "auto" else None
        self.noise = resolve_noise(plan, noise, privacy, dimensions=dimensions, units=units)
        epsilon, delta = privacy.epsilon, privacy.delta
        accountant = privacy.accountant or tightest_accountant(plan)
        mechanism = plan.mechanism(self.noise)
        # The planned run, priced once. While every stream has made no more releases than the plan counts, a
        # release is admitted without recomputing epsilon: the run so far is then a sub-run of the plan (a
        # post-processing of it), so it spends no more than the plan's bound, which is within the budget.
        self.guard = PrivacyGuard(
            Accountant(accountant, plan.neighbouring),
            runtime.generator if runtime.generator is not None else NoiseGenerator(),
            epsilon=epsilon,
            delta=delta,
            planned={s.name: s.count for s in mechanism.streams},
            within_plan=epsilon is not None
            and account(mechanism, delta, accountant=accountant).epsilon <= epsilon,
        )
        for assumption in mechanism.assumptions:
            self.accountant.assume(assumption)
        self.steps_done = 0
        self.optimizer: torch.optim.Optimizer | None = None  # set by algorithms that step with one
        # The generator's keys and the run's ledger, from the binding: complete here (settings, data).
        self._bind_noise()

    def close(self) -> None:
        """Shuts down the loader workers of the run's records, if any (a ``Dataset`` loaded through a
        ``DataLoader`` with workers); they start again if the run is stepped or its data read afterwards.
        Without it they live until the records are collected, which a reference cycle can defer into a
        process forked later (a loader worker of another run), where collecting them fails."""
        data = self._private_data
        held = [data] if isinstance(data, Records) else list(data) if isinstance(data, (list, tuple)) else []
        for records in held:
            if isinstance(records, Records):
                records.close()

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
        data = self._private_data
        if isinstance(data, (str, Records)):
            return data if isinstance(data, str) else data.fingerprint()
        if data and all(isinstance(d, Records) for d in data):
            return records_fingerprint(list(data))
        return list(data)

    def binding(self, *, data: bool = True) -> dict[str, Any]:
        """Every setting that shapes what this run releases, as a flat dictionary of canonical values.

        A state is loaded only into an algorithm with an equal binding; the generator's noise keys are
        derived from a digest of it (the data fingerprint excepted, so that a run whose clients hold the
        data elsewhere draws the same noise as the same run in one process)."""
        bound = {"algorithm": self.name, "nonfinite": self.nonfinite}
        bound.update({f"noise.{k}": v for k, v in sorted(self.noise.items())})
        for f in dataclasses.fields(self.plan) if dataclasses.is_dataclass(self.plan) else ():
            bound[f"plan.{f.name}"] = canonical(getattr(self.plan, f.name))
        for name, value in sorted(self.settings.items()):
            if name in _CONFIGS:
                for field, setting in bound_fields(value).items():
                    bound[f"{name}.{field}"] = canonical(setting)
            else:
                bound[f"setting.{name}"] = canonical(value)
        for name, p in zip(self.param_names, self.params):
            bound[f"parameter.{name}"] = f"{tuple(p.shape)} {p.dtype}"
        if data:
            private = self._data()
            bound["data"] = private if isinstance(private, str) else data_fingerprint(private)
        return bound

    def _bind_noise(self) -> None:
        """Derive the generator's keys and the run's ledger from this run's binding."""
        settings = self.binding(data=False)
        self._noise_context = digest(settings)  # bound again on every load: a loaded generator is unbound
        self.guard.ledger = bind_run(self.generator, settings, identity=self.binding())

    # ---- privacy -------------------------------------------------------------------------------------
    def _admit(self, stream: str) -> tuple[Any, Any]:
        """The accounting of one release of ``stream``; raises if it would exceed the budget. The release is
        written into the run's ledger here, before it happens (a release that then fails is charged on
        resume all the same: conservative)."""
        parts, event = self.plan.step(stream, self.noise)
        return self.guard.admit(
            stream,
            parts,
            event,
            lambda spent: (
                f"{self.name}: the next '{stream}' release would exceed the budget epsilon="
                f"{self.epsilon_budget:g} at delta={self.delta:g} (spent so far: epsilon={spent:.4g} "
                f"after {self.steps_done} steps)"
            ),
        )

    def _write_ahead(self, parts: Any, event: Any, *, replace: bool = False) -> Release:
        """Writes an admitted release into the run's ledger and names its noise keys after the entry."""
        return self.guard.write_ahead(parts, event, replace=replace)

    def _admit_round(self, releases: Mapping[str, int]) -> None:
        """Refuses, before any of them happens, a round of releases (``{stream: count}``) that would not fit
        the budget as a whole, so that a run never stops half-way through a round (each release is then
        admitted and recorded as usual)."""
        self.guard.admit_round(
            {s: (c, self.plan.step(s, self.noise)[1]) for s, c in releases.items()},
            lambda spent: (
                f"{self.name}: the next round ({', '.join(f'{c} x {s!r}' for s, c in releases.items())}) "
                f"would exceed the budget epsilon={self.epsilon_budget:g} at delta={self.delta:g} (spent so "
                f"far: epsilon={spent:.4g} after {self.steps_done} steps); nothing of it was released"
            ),
        )

    def _record(self, admitted: tuple[Any, Any]) -> None:
        self.guard.record(*admitted)

    @contextlib.contextmanager
    def releasing(self, stream: str) -> Iterator[None]:
        """One release of ``stream``: admitted (budget guard, run ledger) on entry, recorded in the accountant
        when the block completes. A block that raises is not recorded: what it released, if anything, is
        charged on resume from the ledger."""
        admitted = self._admit(stream)
        yield
        self._record(admitted)

    def privacy_spent(self, delta: float | None = None) -> PrivacyReport:
        """(epsilon, delta) of everything released so far, from the releases actually made; per stream its
        share of the spend and its noise multiplier."""
        report = self.accountant.report(self.delta if delta is None else delta)
        return dataclasses.replace(report, noise_multipliers=dict(self.noise))

    # ---- running -------------------------------------------------------------------------------------
    @property
    def total_steps(self) -> int:
        """The planned number of steps."""
        return self.plan.steps

    def step(self) -> dict[str, float]:
        """Step ``steps_done + 1`` of the planned run (:meth:`_step`), counted once it completes; returns its
        diagnostics, ``step`` first (see the class documentation for what may be published)."""
        if self.steps_done >= self.total_steps:
            raise RuntimeError(f"{self.name}: all {self.total_steps} planned steps have run")
        info = self._step()
        self.steps_done += 1
        return {"step": self.steps_done, **info}

    def _step(self) -> dict[str, float]:
        """The algorithm's step ``steps_done + 1``: its releases, each inside :meth:`releasing` (or admitted
        and recorded explicitly), and the update; returns the step's diagnostics."""
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
        """Everything needed to resume: parameters, estimator buffers, noise counters, accountant, and where
        the run's ledger stands.

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
            **self.guard.state(),  # accountant, ledger, released
            "extra": self._extra_state(),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a :meth:`state_dict`; validates it fully before changing anything, then charges what the
        run released after it (see the class documentation: from the run's ledger file when the run has
        one, else from the releases of the objects that made them, if they are alive in this process; a
        state whose later releases cannot be known is refused with
        :class:`~dpvr.optim.ledger.LedgerError`)."""
        self._check_state(state)
        self._resume(state, self.guard.ledger_of(state["ledger"]))

    def _check_state(self, state: Mapping[str, Any]) -> None:
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
            ledger = state["ledger"]
            if not isinstance(ledger, Mapping) or int(ledger["seq"]) < 0:
                raise ValueError(f"state: corrupt ledger position {ledger!r}")
        except (KeyError, TypeError) as err:
            raise ValueError(f"state: not a {self.name} checkpoint ({err!r})") from None

    def _resume(self, state: Mapping[str, Any], ledger: RunLedger) -> None:
        """Installs a checked state, charges the run's releases after it and, if there were any (or they
        cannot be known), makes what follows a re-run: a new segment with fresh sampling randomness."""
        after = ledger.releases_after(ledger.seq)  # a foreign or unreadable ledger raises: nothing changed
        self._check_rerun(after)
        rerun = bool(after)  # the ledger holds every release after the state (ledger_of refuses otherwise)
        self._restore(state)
        seed = self.generator.seed if self.generator.reproducible else None
        self.guard.resume(ledger, after, rerun=rerun, seed=seed)
        if rerun:
            # A reproducible re-run's batches are keyed by the noise seed, never by what the ledger shows.
            for k, sampler in enumerate(self._samplers()):
                sampler.restart(None if seed is None else ledger.sampler_seed(seed, k))

    def _check_rerun(self, after: list[Release]) -> None:
        """Refuses (``ValueError``) to go on from a state after which the run made the releases ``after``,
        where a re-run cannot be accounted; called before anything changes."""
        del after

    def _samplers(self) -> list[BatchSampler]:
        """Every batch sampler of this algorithm (attributes holding one, or a list or dict of them)."""
        found = []
        for value in vars(self).values():
            items = value.values() if isinstance(value, Mapping) else value if isinstance(value, list) else ()
            found += [s for s in (value, *items) if isinstance(s, BatchSampler)]
        return found

    def _restore(self, state: Mapping[str, Any]) -> None:
        """Installs a :meth:`state_dict`: the second half of :meth:`load_state_dict`, without its checks and
        without charging anything. Called directly only by tests that replay one run's history on a
        neighbouring dataset."""
        try:
            generator = NoiseGenerator.from_state_dict(state["generator"])
            accountant = Accountant.from_state_dict(state["accountant"])
            steps = int(state["steps_done"])
            released = PrivacyGuard.parse_counts(state, parallel=False)
            ledger = RunLedger.at(state["ledger"])
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise ValueError(f"state: not a {self.name} checkpoint ({err!r})") from None
        with torch.no_grad():
            for p, v in zip(self.params, state["params"]):
                p.copy_(v)
            for k, tensors in self._buffers().items():
                for t, v in zip(tensors, state["buffers"][k]):
                    t.copy_(v)
        generator.bind(self._noise_context)
        self.guard.install(accountant, generator, ledger, released)
        self.steps_done = steps
        self._load_extra_state(state["extra"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Writes :meth:`state_dict` to ``path`` atomically (:func:`dpvr.persistence.write_checkpoint`), so a
        crash leaves the old checkpoint or the new one, never a mixture. The run's ledger gets its file
        beside the run's first checkpoint (``dpvr-run-<run id>.ledger``; keep it with the checkpoints: a
        resume needs it), and every later release is written there before it is made. Like the state, the
        file holds the noise seed: it is readable by its owner only; protect it like the data.
        """
        self.ledger.attach(path)
        write_checkpoint(path, self.state_dict(), self.name)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restores a :meth:`save_checkpoint` file; refuses (``ValueError``) a file that is truncated,
        altered, of another format version, of another algorithm or of a run with other settings
        (:meth:`load_state_dict`), or whose run ledger is missing or unreadable, before changing anything.

        Every release the run made after this checkpoint was written (in its ledger, whichever checkpoint
        it went on from) is charged to the restored accountant: they happened, and the steps that now
        re-run them are releases too, charged as they run, with fresh noise and fresh batches."""
        state = read_checkpoint(path, self.name)
        self._check_state(state)
        self._resume(state, self.guard.ledger_of(state["ledger"], path))


@functools.cache
def variant_class(cls: type, variant: type) -> type:
    """``cls`` in the form of ``variant``, a subclass chosen at construction by a setting (as
    ``DPSGD(sampling="cyclic")`` is a :class:`~dpvr.algorithms.LastIterateDPSGD`): ``variant`` itself for its
    base class, ``cls`` when it has that form already, and for any other subclass of the base (a user's, or
    a test's) a class deriving from both, ``cls``'s own methods first and its name kept, made once."""
    if issubclass(cls, variant):
        return cls
    if issubclass(variant, cls):
        return variant
    names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    return type(cls.__name__, (cls, variant), names)


def _check_public_size(name: str, plan: Plan, stated: int | None) -> None:
    """Refuses a stated public dataset size that the plan does not account (a setting never ignored)."""
    if stated is None:
        return
    planned = getattr(plan, "dataset_size", None)
    if planned is None:
        raise ValueError(f"public_dataset_size: {name}'s accounting reads no dataset size; leave it unset")
    if planned != stated:
        raise ValueError(
            f"public_dataset_size={stated}: {name}'s plan accounts a dataset of {planned} records under "
            f"{plan.neighbouring} (under replace-one the size is public by definition and is the data's own)"
        )


def _check_tensors(name: str, given: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> None:
    if len(given) != len(expected) or any(
        not isinstance(g, torch.Tensor) or g.shape != e.shape or g.dtype != e.dtype
        for g, e in zip(given, expected)
    ):
        raise ValueError(f"state: {name} do not match this model's shapes/dtypes")
    if any(not torch.isfinite(g).all() for g in given):
        raise ValueError(f"state: {name} contain non-finite values")
