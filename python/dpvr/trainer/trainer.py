"""``make_private``: a PyTorch model, loss and dataset in; a private trainer out.

The trainer is a thin layer over one of dpvr's algorithms (:mod:`dpvr.algorithms`): it turns the user's
batched criterion into the per-record loss the algorithms clip, the user's ``Dataset``/``DataLoader`` into the
records their accountant-aware samplers draw (loaded batch by batch: :mod:`dpvr.trainer.data`), ``epochs``
into steps, and ``epsilon``/``delta`` into a :class:`~dpvr.optim.PrivacyConfig`. Before anything runs it
checks, on a copy of the model, that records stay independent (:mod:`dpvr.trainer.checks`). Everything that
decides what is released stays in the algorithm, so the trainer's guarantee is the algorithm's, stated in its
class documentation.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from .. import algorithms, registry
from ..optim import PrivacyConfig, PrivateAlgorithm, RuntimeConfig
from ..optim.guard import EveryStream
from ..optim.sampling import steps_per_epoch
from ..privacy import PrivacyReport
from ..problems import MinimaxProblem
from .checks import PROBE, check_model
from .collate import check_collate
from .data import dataset_records
from .defaults import Derived, Public, derivable, derive, derive_steps, derives_steps
from .losses import check_separable, per_sample
from .parallel import DataParallel, constructed


class _FrontDoor(Sequence[str]):
    """The names of the registry's algorithms that ``make_private`` runs (those with a layout), sorted, read
    from :mod:`dpvr.registry` on each access: an algorithm added with :func:`dpvr.registry.register` is
    among them while it is registered."""

    def _names(self) -> tuple[str, ...]:
        return tuple(sorted(registry.front_door()))

    def __getitem__(self, index: Any) -> Any:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


ALGORITHMS: Sequence[str] = _FrontDoor()

Evaluation = Callable[["PrivateTrainer", dict[str, float]], Any]

_LOG = logging.getLogger("dpvr")  # one line per step at INFO, when the user enables it (PrivateTrainer.step)


def _scalars(info: Mapping[str, Any]) -> dict[str, float]:
    """The numeric entries of a step's information dictionary (one-element tensors read)."""
    out = {}
    for key, value in info.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            out[key] = float(value)
    return out


@constructed  # under a process group: every process agrees on the whole run before it is returned
def make_private(
    module: nn.Module,
    criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | MinimaxProblem,
    data: Dataset | DataLoader | Sequence[Dataset | DataLoader],
    *,
    algorithm: str,
    epsilon: float | None = None,
    delta: float | None = None,
    noise_multiplier: float | Mapping[str, float] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    batch_size: int | None = None,
    epochs: float | None = None,
    steps: int | None = None,
    accountant: str | None = None,
    public_dataset_size: int | None = None,
    runtime: RuntimeConfig | None = None,
    privacy: PrivacyConfig | None = None,
    process_group: Any = None,
    **settings: Any,
) -> PrivateTrainer:
    """A :class:`PrivateTrainer` that trains ``module`` with ``algorithm`` at ``(epsilon, delta)``-DP.

    Args:
        module: the ``nn.Module`` to train (its trainable parameters are the released iterates); the plain
            module, not a ``DistributedDataParallel`` wrapper.
        criterion: an ordinary batched loss (``nn.CrossEntropyLoss()``, or any ``(output, target) -> loss``
            that is a mean or a sum of per-record losses; checked); for the minimax algorithms
            (``"dp-sgda"``, ``"private-diff"``: ``problem="minimax"`` in the registry) a
            :class:`~dpvr.problems.MinimaxProblem` instead.
        data: a map-style ``Dataset`` or a ``DataLoader`` (its dataset and ``collate_fn`` are used; dpvr's
            sampler replaces its batch sampler, with a warning) of ``(input, target)`` records; for a
            federated algorithm (``"diff2"``) a list of them gives one client each.
        algorithm: a name of :mod:`dpvr.registry` whose entry has a ``layout`` (every built-in one but
            ``"phased"``); the entry says which class runs it and how the run is laid out.
        epsilon: the privacy budget of the whole run; without ``noise_multiplier`` the noise is calibrated to
            spend it; with one it is the budget every release is admitted against.
        delta: the target ``delta``; default ``1e-5``.
        noise_multiplier: the noise given instead of calibrated (Opacus' ``noise_multiplier``), in the
            accountant's convention (noise std over the clip radius): a number for every stream of the
            algorithm, or ``{stream: z}`` keyed by its plan's stream names (``trainer.algorithm.noise``).
            :meth:`PrivateTrainer.privacy_spent` then reports the epsilon spent; with ``epsilon`` also
            given, a release that would exceed it is still refused. ``0`` is refused: the clipped sum would
            be released exactly, which is not differentially private at any epsilon.
        optimizer: any ``torch.optim.Optimizer`` over ``module``'s parameters; it steps on the released noisy
            gradient estimate (written into ``p.grad``). Momentum, Adam, weight decay and learning-rate
            schedules are post-processing of what was released: the guarantee is unchanged. Without one,
            the algorithm's own SGD step is used and ``lr`` must be given in ``settings``. The SPIDER
            algorithms and DIFF2's BVR-L-SGD routine take their own steps (their step rules are part of the
            analysis).
        batch_size: the (expected) batch size of a sampling algorithm; default a ``DataLoader``'s own
            ``batch_size``; not given for the full-batch ones.
        epochs: the run's length in epochs (or give ``steps``). An epoch is the sampler's own
            (:func:`dpvr.optim.sampling.steps_per_epoch`), so that ``epochs`` is what is charged:
            ``round(n / batch_size)`` steps for ``sampling="random-allocation"`` (the epoch its accountant
            prices; a fractional number of epochs is charged as the next whole number), ``n / batch_size``
            for the cyclic last-iterate traversal, ``ceil(n / batch_size)`` for Poisson and fixed-size
            batches, one step for the full batch (``"dp-gd"``, ``"diff2"``, ``sampling="full"``).
        steps: the run's length in steps (or give ``epochs``); the SPIDERs take ``steps``. For ``"diff2"``,
            neither: the rounds ``R`` of Theorem 4.3's proof with the accountant's noise constant (the
            clip radii standing in for ``G`` and ``L``; :func:`dpvr.trainer.defaults.diff2_protocol`),
            shown in ``trainer.derived["steps"]``.
        accountant: ``"rdp"`` or ``"pld"``; default the tightest the algorithm's plan allows (PLD wherever its
            releases are Gaussian on Poisson, fixed-size or full batches).
        public_dataset_size: the dataset size ``N`` stated as public
            (:attr:`dpvr.optim.PrivacyConfig.public_dataset_size`): with it, Poisson and random-allocation
            DP-SGD are accounted under add/remove, and their sampling rate, epoch, divisor, the steps of
            ``epochs`` and the noise read ``N``, never the size of ``data`` (private under add/remove).
            Without it (default) the size of ``data`` is used and the run is accounted under replace-one,
            where the size is public by definition (random allocation is then refused).
            ``privacy_spent().assumptions`` says which.
        runtime: the :class:`~dpvr.optim.RuntimeConfig` (gradient mode, chunk size, noise source, seeds);
            default ``RuntimeConfig()``.
        privacy: the whole :class:`~dpvr.optim.PrivacyConfig` instead of ``epsilon``/``delta`` (what
            :func:`dpvr.tuning.tune` hands a build: ``make_private(..., privacy=privacy)``); ``accountant``
            and ``public_dataset_size`` may still be given where it leaves them ``None``.
        process_group: a ``torch.distributed`` group to train data-parallel over (default: the initialised
            default group when it has more than one process): one logical run, every process drawing the
            same batches and noise, loading and clipping its share of each batch, the clipped sums
            all-reduced. Before the first release the processes compare the whole run (every setting that
            shapes a release, the starting parameters and a fingerprint of every record each holds, in
            order) and all refuse it, naming what differs and where, unless they agree
            (:mod:`dpvr.trainer.parallel`: ``dp-sgd``, ``dp-gd``, ``last-iterate``, ``diff2``, ``dp-sgda``,
            ``private-diff`` (``y_release="ascent"``), ``double-spider``, ``recursive-spider``).
        **settings: the algorithm's own keyword arguments (``clip``, ``lr``, ``restart``, ...; see its
            class in :mod:`dpvr.algorithms`), except ``noise`` (give ``noise_multiplier``). The schedule
            settings left out (DIFF2's and PrivateDiff's ``restart``, ``lr`` and, with no length given,
            ``steps``; PrivateDiff's ``y_steps``; the SPIDERs' ``restart`` and ``batch_sizes``,
            Recursive-SPIDER's ``lr`` and Double-SPIDER's ``lr_eta``) take the values of the papers'
            theorems (their proofs, with the accountant's noise constant for the dropped log factors) at this
            run's public sizes, budget and clip radii
            (:mod:`dpvr.trainer.defaults`; listed with their reasons in ``trainer.derived``).

    The noise is calibrated so that the whole planned run spends ``epsilon`` (unless ``noise_multiplier`` is
    given); a release that would exceed ``epsilon`` raises :class:`~dpvr.optim.BudgetExhaustedError` before
    it happens.

    Which algorithm (measured, ``dpvr experiment scaling``: MNIST-1D, d of 700-800, n from 4k to 256k,
    epsilon 1 and 4, five paired seeds): DIFF2-GD's gradient norm is 7-13 % below DP-GD's from n = 64k
    where the same step size is tuned (far above it at its larger step), with equal test accuracy;
    PrivateDiff never beats DP-SGDA up to 256k; on the KL dual of DRO, Double-SPIDER's gradient norm is
    below DP-SGD's at every n, from its step rule rather than from variance reduction (the gap is the same
    without noise). So use ``"dp-sgd"``/``"dp-gd"`` for minimisation and ``"dp-sgda"`` for minimax
    problems, ``"diff2"`` when stationarity at n >= 64k is the goal, and ``"double-spider"`` for DRO in its
    dual form. Where DIFF2 starts to win at the theorems' protocol (``dpvr experiment regime``: a planted
    nonconvex problem with known G, L and f(x0) - f*, d = 10, n to 1e6, five paired seeds): its gradient
    norm falls as n^-0.63 against DP-GD's n^-0.50, as the theorems say, and crosses below DP-GD's at
    ``n * epsilon / sqrt(d) ~ 2e5`` (95% interval 1.2e5-3.0e5; 0.71x at 1.3e6), about 2,500 times later than
    the theorems' bounds predict, with 12-19x more rounds; at d = 100 no crossover up to 1.3e5. On MNIST-1D
    records (d = 10, ``--paper diff2-real``) the rates carry over and the crossover comes later, near 1e6
    (0.62x at 1.3e6; fitted 8e5, interval 1.9e5-1.3e7). So: ``"diff2"`` from ``n * epsilon / sqrt(d) >~ 1e6``
    (2e5 on the planted problem), ``"dp-gd"`` below it. PrivateDiff never beat a DP-SGDA with a tuned step and
    number of rounds (``--paper private-diff``, d = 10, coordinate up to 4e5): ``"dp-sgda"``. DP
    Recursive-SPIDER overtakes DP-SGD on the KL-DRO dual from ``n * epsilon / sqrt(d) ~ 5e4`` (interval
    4.3e4-7.8e4, d = 10, ``--paper spider``): ``"recursive-spider"`` above it.

    Returns:
        A :class:`PrivateTrainer` around the calibrated algorithm (``trainer.algorithm``); nothing has run
        and nothing is released until it is stepped.

    Raises:
        ValueError: ``algorithm`` is not a name ``make_private`` runs, ``noise`` is given, neither
            ``epsilon`` nor ``noise_multiplier`` is, a noise multiplier is not > 0, ``module`` has no
            trainable parameters, the data or settings do not fit the algorithm (every problem listed at
            once), or the model fails a record-independence check (the module named, with the fix).
        TypeError: ``module`` is not an ``nn.Module``, or ``criterion`` is not what ``algorithm`` takes (a
            loss callable, or a ``MinimaxProblem`` for the minimax algorithms).

    Guarantee:
        The whole run is ``(epsilon, delta)``-DP under the algorithm's neighbouring relation (reported by
        :meth:`PrivateTrainer.privacy_spent`) with respect to what the algorithm releases: every iterate, or
        only the last one under ``algorithm="last-iterate"``. The optimizer's steps and
        :meth:`PrivateTrainer.evaluate` callbacks are post-processing of released values.
    """
    spec = _entry(algorithm)
    privacy, noise = _budget(privacy, noise_multiplier, settings, epsilon=epsilon, delta=delta,
                             accountant=accountant, public_dataset_size=public_dataset_size)
    cls, sampled = spec.algorithm_class(), spec.layout == "sampled"
    settings = {**spec.algorithm_options, **settings}
    params = _trainable(module)
    parallel = DataParallel.detect(process_group)
    if parallel is not None:
        parallel.check(spec, module, settings)
    minimax = spec.problem == "minimax"
    _check_criterion(algorithm, criterion, minimax)
    # Nothing of the data's size is read or held here: each step loads the records its sampler draws.
    records, batch_size = _records(spec, data, batch_size, params[0])
    # The size every release's shape reads: the stated public one (add/remove), else the data's own, which
    # the algorithm then accounts under replace-one, where it is public by definition.
    n = privacy.public_dataset_size
    n = n if n is not None else min(len(r) for r in records)
    if sampled:
        settings["batch_size"] = batch_size
    if optimizer is not None:
        settings["optimizer"] = optimizer
    _check_settings(spec, cls, n, settings, batch_size=batch_size, epochs=epochs, steps=steps)
    runtime = runtime or RuntimeConfig()
    if parallel is not None:  # one sampler seed and one noise generator for every process
        runtime = parallel.runtime(runtime)
    loss, runtime = _checked_loss(module, criterion, records[0], runtime, minimax)
    # One definition of an epoch, the sampler's: ceil(n / b) here once charged one random-allocation epoch
    # as two (the plan prices any step past round(n / b) as a new epoch).
    scheme = _sampling(spec, settings) if sampled else "full"
    per_epoch = 1 if spec.layout == "per-stream" else steps_per_epoch(scheme, n, batch_size)
    public = Public(n=n, clients=len(records), dimension=sum(p.numel() for p in params),
                    epsilon=privacy.epsilon, delta=privacy.delta, steps=steps)
    steps, derived = _schedule(algorithm, settings, noise, public, epochs=epochs, per_epoch=per_epoch)
    settings.update({name: d.value for name, d in derived.items()})
    arguments: dict[str, Any] = {"steps": steps, "privacy": privacy, "runtime": runtime, **settings}
    if noise is not None:
        arguments["noise"] = noise
    # One client per dataset given to a federated algorithm.
    if parallel is not None:  # each process loads its share of every batch drawn, and every clipped sum
        records = [parallel.records(r) for r in records]  # is the whole batch's (the runtime's all-reduce)
        arguments["runtime"] = dataclasses.replace(runtime, all_reduce=parallel.gradients)
    private: PrivateAlgorithm = cls(module, loss, records if spec.federated else records[0], **arguments)
    return PrivateTrainer(private, steps_per_epoch=per_epoch, parallel=parallel, derived=derived)


def _entry(algorithm: str) -> registry.AlgorithmSpec:
    """The registry's entry for ``algorithm``, refusing a name ``make_private`` does not run (no layout)."""
    spec = registry.REGISTRY.get(algorithm) if isinstance(algorithm, str) else None
    if spec is None or spec.layout is None:
        raise ValueError(f"algorithm: must be one of {sorted(registry.front_door())}, got {algorithm!r}")
    return spec


def _budget(privacy: PrivacyConfig | None, noise_multiplier: float | Mapping[str, float] | None,
            settings: Mapping[str, Any], *, epsilon: float | None, delta: float | None,
            accountant: str | None, public_dataset_size: int | None,
            ) -> tuple[PrivacyConfig, float | dict[str, float] | None]:
    """The run's :class:`~dpvr.optim.PrivacyConfig` (:func:`_privacy`) and its noise (:func:`_noise`): the
    noise only ever as ``noise_multiplier``, and at least one of a budget and a noise."""
    if "noise" in settings:
        raise ValueError(
            "noise: give the noise as noise_multiplier= (a number for every stream, or {stream: z}); "
            "without it make_private calibrates the noise to epsilon"
        )
    privacy = _privacy(privacy, epsilon=epsilon, delta=delta, accountant=accountant,
                       public_dataset_size=public_dataset_size)
    noise = _noise(noise_multiplier)
    if privacy.epsilon is None and noise is None:
        raise ValueError(
            "give epsilon= (the noise is calibrated to spend it) or noise_multiplier= (the accountant then "
            "reports the epsilon spent), or both (epsilon is then a budget no release may exceed)"
        )
    return privacy, noise


def _trainable(module: nn.Module) -> list[nn.Parameter]:
    """``module``'s trainable parameters (the released iterates), refusing anything but a module with some."""
    if not isinstance(module, nn.Module):
        changes = isinstance(module, list) and all(isinstance(m, str) for m in module)
        hint = (" (dpvr.fix(model) changes the model in place and returns the list of its changes: pass "
                "the model itself)" if changes else "")
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}{hint}")
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("module: has no trainable parameters")
    return params


def _check_criterion(algorithm: str, criterion: Any, minimax: bool) -> None:
    """Refuses a ``criterion`` of the wrong kind: a minimax algorithm takes a ``MinimaxProblem``, the others a
    loss callable."""
    if minimax != isinstance(criterion, MinimaxProblem):
        where = (
            " (dpvr.problems.MinimaxProblem: build one from dpvr.objectives, e.g. "
            "AUCMargin(positive_ratio=p) with an AUCModel, or ClassDRO(nn.CrossEntropyLoss(), classes=K); "
            "or subclass MinimaxProblem)" if minimax else
            " (e.g. nn.CrossEntropyLoss(); a MinimaxProblem is for 'dp-sgda' and 'private-diff')"
        )
        raise TypeError(
            f"criterion: {algorithm!r} takes a {'MinimaxProblem' if minimax else 'loss callable'}, "
            f"got {type(criterion).__name__}{where}"
        )


def _records(spec: registry.AlgorithmSpec, data: Dataset | DataLoader | Sequence[Dataset | DataLoader],
             batch_size: int | None, like: torch.Tensor) -> tuple[list[Any], int | None]:
    """``data`` as the records the algorithm draws from (one set per client for a federated algorithm), in
    the dtype and on the device of the parameter ``like``, and the batch size: the one given, else, for a
    sampling algorithm, a ``DataLoader``'s own."""
    # A list is one dataset per client for a federated algorithm; for the others, a list of records (a
    # plain Python list is a map-style dataset) unless every element is itself a dataset or loader.
    clients = isinstance(data, (list, tuple)) and (
        spec.federated or all(isinstance(d, (Dataset, DataLoader)) for d in data))
    shards = data if clients else [data]
    if len(shards) > 1 and not spec.federated:
        federated = [name for name in registry.front_door() if registry.get(name).federated]
        raise ValueError(
            f"data: a list of datasets (one per client) is for the federated algorithms only ({federated})"
        )
    for shard in shards:
        if isinstance(shard, DataLoader):
            check_collate(shard.collate_fn, shard.dataset)
    sampled = spec.layout == "sampled"
    if batch_size is None and sampled and isinstance(shards[0], DataLoader):
        batch_size = shards[0].batch_size  # the (expected) batch size the user already chose
    return [dataset_records(d, like.dtype, like.device, batched=sampled) for d in shards], batch_size


def _checked_loss(module: nn.Module, criterion: Any, records: Any, runtime: RuntimeConfig,
                  minimax: bool) -> tuple[Any, RuntimeConfig]:
    """The per-record loss the algorithm clips (a ``MinimaxProblem`` as it is), and ``runtime`` with the
    gradient mode that fits ``module``, once the model and the criterion have passed the record-independence
    checks on a few of ``records``."""
    probe = list(records.probe(PROBE))
    loss = criterion if minimax else per_sample(criterion)
    # On a copy of the model, before anything runs on the user's own (its forward could write into it).
    grad_mode = check_model(module, *probe, None if minimax else loss, grad_mode=runtime.grad_mode)
    runtime = dataclasses.replace(runtime, grad_mode=grad_mode)
    if not minimax:
        check_separable(criterion, module, *probe)
    return loss, runtime


def _schedule(algorithm: str, settings: Mapping[str, Any], noise: float | dict[str, float] | None,
              public: Public, *, epochs: float | None, per_epoch: int) -> tuple[int, dict[str, Derived]]:
    """The run's length in steps and the schedule settings not given (the run's length too, where a theorem
    gives it), from the papers' theorems and public quantities only (:mod:`dpvr.trainer.defaults`)."""
    steps = public.steps
    if public.epsilon is None:  # the theorems' schedules are functions of the budget
        needed = [name for name in derivable(algorithm) if settings.get(name) is None]
        needed += ["steps"] if steps is None and epochs is None else []
        if needed:
            raise ValueError(
                f"make_private({algorithm!r}): {', '.join(needed)}: not given, and the theorems' defaults "
                "are functions of the budget epsilon; give them, or give epsilon= beside noise_multiplier="
            )
    derived: dict[str, Derived] = {}
    if steps is None and epochs is None:
        derived["steps"] = derive_steps(algorithm, settings, public)
        steps = derived["steps"].value
    elif steps is None:
        steps = max(1, round(epochs * per_epoch))
    # The rules read the run's noise where it is given (a step size is a function of it).
    rules_read = settings if noise is None else {**settings, "noise": noise}
    derived.update(derive(algorithm, rules_read, dataclasses.replace(public, steps=steps)))
    return steps, derived


def _privacy(privacy: PrivacyConfig | None, *, epsilon: float | None, delta: float | None,
             accountant: str | None, public_dataset_size: int | None) -> PrivacyConfig:
    """The run's :class:`~dpvr.optim.PrivacyConfig`: ``privacy`` with ``accountant`` and
    ``public_dataset_size`` filled in where it leaves them ``None``, or one made of the separate arguments."""
    if privacy is None:
        return PrivacyConfig(epsilon=epsilon, delta=1e-5 if delta is None else delta, accountant=accountant,
                             public_dataset_size=public_dataset_size)
    if not isinstance(privacy, PrivacyConfig):
        raise TypeError(f"privacy: expected a dpvr.optim.PrivacyConfig, got {type(privacy).__name__}")
    given = [name for name, value in (("epsilon", epsilon), ("delta", delta)) if value is not None]
    if given:
        raise ValueError(f"{' and '.join(given)}: given twice; privacy= holds them (privacy.epsilon, "
                         "privacy.delta): leave these out, or drop privacy=")
    fill = {}
    for name, value in (("accountant", accountant), ("public_dataset_size", public_dataset_size)):
        held = getattr(privacy, name)
        if value is not None and held is not None and value != held:
            raise ValueError(f"{name}: {value!r} differs from privacy.{name}={held!r}; give it once")
        if value is not None:
            fill[name] = value
    return dataclasses.replace(privacy, **fill) if fill else privacy


def _noise(noise_multiplier: float | Mapping[str, float] | None) -> float | dict[str, float] | None:
    """``noise_multiplier`` checked, as the algorithm's ``noise=``: ``EveryStream(z)`` for a number (every
    stream of the plan), ``{stream: z}`` for a mapping."""
    if noise_multiplier is None:
        return None

    def checked(name: str, z: Any) -> float:
        if isinstance(z, bool) or not isinstance(z, numbers.Real):
            raise TypeError(f"{name}: a noise multiplier is a number, got {type(z).__name__} {z!r}")
        if z == 0:
            raise ValueError(
                f"{name}: a noise multiplier of 0 releases the clipped gradients exactly, which is not "
                "differentially private at any epsilon (dpvr refuses it); for a non-private baseline train "
                "without dpvr, or give a small multiplier > 0 (privacy_spent() then reports its epsilon, "
                "inf where it is unbounded)"
            )
        if not (math.isfinite(z) and z > 0):
            raise ValueError(f"{name}: a noise multiplier must be a finite number > 0, got {z!r}")
        return float(z)

    if isinstance(noise_multiplier, Mapping):
        return {str(k): checked(f"noise_multiplier[{k!r}]", z) for k, z in noise_multiplier.items()}
    return EveryStream(checked("noise_multiplier", noise_multiplier))


def _check_settings(spec: registry.AlgorithmSpec, cls: type, n: int, settings: Mapping[str, Any], *,
                    batch_size: int | None, epochs: float | None, steps: int | None) -> None:
    """Every problem with the run's length, its batch size and the algorithm's own settings, listed at once
    with what each setting means (rather than one per try)."""
    layout, problems = spec.layout, []
    if layout == "per-stream":
        if steps is None:
            problems.append(f"steps: {spec.name!r} takes steps= (its batches differ per stream)")
        if epochs is not None:
            problems.append(f"epochs: {spec.name!r} has no single epoch (its batches differ per stream)")
    elif (epochs is None) == (steps is None) and not (steps is None and derives_steps(spec.name)):
        problems.append("give the run's length as exactly one of epochs= or steps=")
    if steps is not None and not (isinstance(steps, int) and steps >= 1):
        problems.append(f"steps: the number of steps must be a whole number >= 1, got {steps!r}")
    if epochs is not None and not (isinstance(epochs, (int, float)) and epochs > 0):
        problems.append(f"epochs: the number of passes over the data must be > 0, got {epochs!r}")
    if layout == "sampled" and batch_size is None:
        problems.append(f"batch_size: {spec.name!r} samples a batch each step; give its (expected) size "
                        "(or a DataLoader with a batch_size)")
    elif layout == "full-batch" and batch_size is not None:
        problems.append(f"batch_size: {spec.name!r} uses the full batch every step")
    if batch_size is not None and layout == "sampled" and not 1 <= batch_size <= n:
        problems.append(f"batch_size: each step samples about batch_size records of the {n} in the dataset, "
                        f"so it must lie in [1, {n}], got {batch_size}")
    problems += _setting_problems(spec, cls, settings)
    if len(problems) == 1:
        raise ValueError(f"make_private({spec.name!r}): {problems[0]}")
    if problems:
        listed = "\n  - ".join(problems)
        raise ValueError(f"make_private({spec.name!r}): {len(problems)} problems:\n  - {listed}")


def _setting_problems(spec: registry.AlgorithmSpec, cls: type[PrivateAlgorithm],
                      settings: Mapping[str, Any]) -> list[str]:
    """The algorithm's own settings that are missing or of the wrong form, from what its class declares
    (:attr:`~dpvr.optim.PrivateAlgorithm.required_settings`, ``clip_streams``): an algorithm registered from
    outside dpvr is checked, and told, alike."""
    problems, meaning = [], {a.name: a.help for a in spec.arguments}
    clip, per_stream = settings.get("clip"), bool(cls.clip_streams)
    example, home = _clip_example(cls), _home(cls)
    if clip is not None and not isinstance(clip, Mapping) and per_stream:
        # Said here, before a theorem's default reads a radius from it and complains about that default.
        problems.append(f"clip: {spec.name!r} clips each stream with its own radius, so it takes a mapping: "
                        f"clip={example} (see {home}), got {clip!r}")
    derived_later = ("steps", "privacy", "runtime", *derivable(spec.name))
    for name in cls.required_settings:
        if name not in settings and name not in derived_later:
            what = f" ({meaning[name]})" if name in meaning else ""
            if name == "clip" and per_stream:
                what = f": clip={example}, one radius per stream (see {home})"
            problems.append(f"{name}: {spec.name!r} needs this setting{what}")
    return problems


def _clip_example(cls: type[PrivateAlgorithm]) -> str:
    """``clip={...}`` as ``cls`` takes it: its streams in order, radii numbered ``C1, C2, ...`` (a pair of
    them for a stream whose radius is a pair of constants)."""
    parts, k = [], 1
    for stream in cls.clip_streams:
        pair = stream in cls.clip_pairs
        parts.append(f'"{stream}": ' + (f"(C{k}, C{k + 1})" if pair else f"C{k}"))
        k += 2 if pair else 1
    return "{" + ", ".join(parts) + "}"


def _home(cls: type) -> str:
    """Where the user reads ``cls``'s documentation: ``dpvr.algorithms.<Class>`` for a built-in algorithm,
    its own module's path for one defined elsewhere."""
    if cls.__module__.startswith(f"{algorithms.__name__}.") and cls.__name__ in algorithms.__all__:
        return f"{algorithms.__name__}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _sampling(spec: registry.AlgorithmSpec, settings: Mapping[str, Any]) -> str:
    """The sampling scheme the run's algorithm draws its batches with: the given one (or the entry's
    ``algorithm_options``, already among ``settings``), else its settings schema's default."""
    if "sampling" in settings:
        return settings["sampling"]
    scheme = spec.defaults().get("sampling")
    if scheme is None:
        raise TypeError(f"{spec.name}: samples batches but its settings schema states no default sampling "
                        "scheme (a 'sampling' setting with a default)")
    return scheme


class PrivateTrainer:
    """A private training run: step it in your own loop, iterate over it, or :meth:`run` it.

    ``for info in trainer:`` runs the remaining planned steps, yielding each step's information dictionary
    (diagnostics for the data holder: entries computed from private data without noise, such as
    ``nonfinite``, must not be published; on a CUDA device ``nonfinite`` and ``loss`` are 0-d device tensors,
    so that a step never waits for the device: reading one, ``int(info["nonfinite"])``, waits for that
    step). :meth:`evaluate` registers a callback run after every ``every``
    steps, e.g. to score the model on held-out data (which is not private data: the callback sees released
    parameters only).

    What is released, and so what the guarantee covers, is the algorithm's: every iterate for most
    algorithms, but under ``algorithm="last-iterate"`` (cyclic DP-SGD accounted by the last-iterate bound)
    only the parameters after the last planned step. There the parameters between steps are *not* released:
    :attr:`released` is false until the run is complete, :meth:`evaluate` refuses callbacks that would see an
    intermediate iterate, and the step dictionaries carry nothing computed from one (no step length, no
    loss). The model object is yours: reading it in your own loop before the run is complete (to score it,
    log it, or publish a checkpoint of it) is outside the guarantee: every iterate of a cyclic run is covered
    only by the plain composition of its passes (``bound="composition"``), above the last-iterate bound.

    Built by :func:`make_private`; the constructor wraps an algorithm already built.

    Args:
        algorithm: the calibrated :class:`~dpvr.optim.PrivateAlgorithm` that runs (and releases) every step.
        steps_per_epoch: the sampler's steps per epoch (:func:`dpvr.optim.sampling.steps_per_epoch`);
            default 1.
        parallel: the data-parallel layer (:mod:`dpvr.trainer.parallel`) of a distributed run; default
            ``None``, one process.
        derived: the settings :func:`make_private` derived from the papers' theorems
            (:mod:`dpvr.trainer.defaults`), each with its value and why; default none.

    Attributes:
        derived: ``{setting: Derived(value, why)}``, the settings that were not given and were derived from
            the papers' theorems and public quantities.
    """

    def __init__(self, algorithm: PrivateAlgorithm, *, steps_per_epoch: int = 1,
                 parallel: DataParallel | None = None, derived: Mapping[str, Derived] | None = None) -> None:
        self.algorithm, self.parallel = algorithm, parallel
        self.derived = dict(derived or {})
        self.model = algorithm.model
        self.steps_per_epoch = steps_per_epoch
        self._evaluations: list[tuple[int, Evaluation]] = []

    @property
    def steps_done(self) -> int:
        return self.algorithm.steps_done

    @property
    def total_steps(self) -> int:
        return self.algorithm.total_steps

    @property
    def last_iterate_only(self) -> bool:
        """Whether the algorithm releases only its last iterate (the last-iterate bound)."""
        return self.algorithm.releases_last_iterate_only

    @property
    def released(self) -> bool:
        """Whether :attr:`model` holds released parameters now: always for an algorithm that releases every
        iterate; under the last-iterate bound only once every planned step has run."""
        return not self.last_iterate_only or self.steps_done >= self.total_steps

    def evaluate(self, callback: Evaluation, *, every: int = 1) -> PrivateTrainer:
        """Calls ``callback(trainer, info)`` after every ``every`` steps (and returns the trainer).

        The callback sees released parameters only (post-processing: it costs no privacy when it reads no
        private data). Under the last-iterate bound only the final iterate is released, so a callback that
        would run before the last planned step (``every < total_steps``) is refused here, before the run;
        ``every=trainer.total_steps`` runs it once, on the released last iterate."""
        if every < 1:
            raise ValueError(f"every: must be >= 1, got {every}")
        if self.last_iterate_only and every < self.total_steps:
            unreleased = (self.total_steps - 1) // every
            raise ValueError(
                f"evaluate: {self.algorithm.name} here releases only its last iterate (the last-iterate "
                f"bound), so a callback every {every} steps would see {unreleased} unreleased "
                "intermediate iterate(s), which the reported epsilon does not cover; use "
                f"every=trainer.total_steps ({self.total_steps}) to run it once on the released last "
                "iterate, or score trainer.model after trainer.run()"
            )
        self._evaluations.append((every, callback))
        return self

    def step(self, *, writer: Any = None) -> dict[str, float]:
        """One step of the algorithm (one or more releases, each admitted by the budget guard); then the
        :meth:`evaluate` callbacks that are due, when the model holds released parameters.

        Metrics: with the ``"dpvr"`` logger enabled at ``INFO`` (``logging.getLogger("dpvr").setLevel(
        logging.INFO)`` and a handler), one line per step, and with ``writer`` (TensorBoard's
        ``SummaryWriter``, or anything with its ``add_scalar``) one scalar ``dpvr/<entry>`` per numeric entry:
        the step's information dictionary, i.e. the class's documented diagnostics. Like the dictionary, they
        are for the data holder: entries computed from private data without noise (``loss``,
        ``nonfinite``) are not releases and must not be published."""
        info = self.algorithm.step()
        if self.released:  # under the last-iterate bound: not before the run is complete
            for every, callback in self._evaluations:
                if self.algorithm.steps_done % every == 0:
                    callback(self, info)
        if writer is not None or _LOG.isEnabledFor(logging.INFO):  # reading a device value waits for it
            scalars = _scalars(info)
            _LOG.info("%s step %d/%d: %s", self.algorithm.name, self.steps_done, self.total_steps,
                      ", ".join(f"{k}={v:.6g}" for k, v in scalars.items()))
            for key, value in scalars.items() if writer is not None else ():
                writer.add_scalar(f"dpvr/{key}", value, self.steps_done)
        return info

    def __iter__(self) -> Iterator[dict[str, float]]:
        while self.algorithm.steps_done < self.algorithm.total_steps:
            yield self.step()

    def run(self, steps: int | None = None, *, progress: bool = False,
            writer: Any = None) -> list[dict[str, float]]:
        """Runs ``steps`` steps (default: the rest of the planned run); ``progress=True`` shows a bar;
        ``writer``: each step's metrics (:meth:`step`), and at the end ``dpvr/epsilon``, the epsilon spent
        (released: it is a function of what the run released)."""
        remaining = self.algorithm.total_steps - self.algorithm.steps_done if steps is None else steps
        bar = tqdm(range(remaining), desc=self.algorithm.name, disable=not progress)
        infos = [self.step(writer=writer) for _ in bar]
        if writer is not None:
            writer.add_scalar("dpvr/epsilon", self.privacy_spent().epsilon, self.steps_done)
        return infos

    def privacy_spent(self, delta: float | None = None) -> PrivacyReport:
        """``(epsilon, delta)`` of everything released so far, and per stream its share of epsilon and its
        noise multiplier."""
        return self.algorithm.privacy_spent(delta)

    def close(self) -> None:
        """Shuts down the ``DataLoader`` workers of the run's data, if any
        (:meth:`dpvr.optim.PrivateAlgorithm.close`); they start again if the trainer is stepped afterwards."""
        self.algorithm.close()

    def state_dict(self) -> dict[str, Any]:
        return self.algorithm.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.algorithm.load_state_dict(state)

    def save_checkpoint(self, path: str) -> None:
        """Writes the run's checkpoint (:meth:`dpvr.optim.PrivateAlgorithm.save_checkpoint`); in a
        data-parallel run, rank 0 writes it, the others wait for it."""
        if self.parallel is None or self.parallel.rank == 0:
            self.algorithm.save_checkpoint(path)
        if self.parallel is not None:
            torch.distributed.barrier(group=self.parallel.group)

    def load_checkpoint(self, path: str) -> None:
        """Restores a :meth:`save_checkpoint` file (:meth:`dpvr.optim.PrivateAlgorithm.load_checkpoint`). In
        a data-parallel run every process loads the same file; each derives the same new segment from the
        shared seed, rank 0 alone goes on writing the run's ledger, and the processes are checked to agree."""
        self.algorithm.load_checkpoint(path)
        if self.parallel is not None:
            if self.parallel.rank != 0:
                self.algorithm.ledger.detach()
            self.parallel.agree(self.algorithm)
