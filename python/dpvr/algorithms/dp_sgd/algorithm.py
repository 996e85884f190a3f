"""DP-SGD and DP-GD: noisy clipped gradient steps on sampled or cyclically traversed batches."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ...grads.layer_clip import LayerRadii, layer_radii
from ...optim import prox as proximal
from ...optim.base import LossFn, PrivateAlgorithm, variant_class
from ...optim.clipping import AdaptiveRadius, check_policy, split_noise
from ...optim.config import PrivacyConfig, RuntimeConfig
from ...optim.estimator import ClippedSum, DifferenceEstimator, Iterate, release, step_size
from ...optim.gradients import accumulators, check_loss
from ...optim.guard import BudgetExhaustedError, resolve_noise
from ...optim.ledger import Release
from ...optim.records import Records, as_records
from ...optim.sampling import BatchSampler
from ...privacy import Accountant
from ..last_iterate.plan import CyclicDPSGDPlan
from .plan import AdaptiveClipDPSGDPlan, DPSGDPlan


class DPSGD(PrivateAlgorithm):
    """DP-SGD (Abadi et al. 2016) on ``(inputs, targets)`` tensors, or on
    :class:`~dpvr.optim.records.Records` given as ``inputs`` (``targets`` omitted), e.g. a user's ``Dataset``
    loaded batch by batch (:class:`~dpvr.optim.records.DatasetRecords`).

    Each step draws a batch (``sampling``), clips each per-sample gradient to ``clip``, adds
    ``N(0, (z * clip)^2 I)`` to the sum and steps ``x <- x - lr * noisy_sum / batch_size`` (the public,
    expected batch size).

    Clipping policies (``clipping``; :mod:`dpvr.optim.clipping`):

    - ``True`` / ``"flat"`` (default): each record's whole gradient clipped to one radius ``C``.
    - ``"per_layer"``: each record's gradient on parameter group ``l`` clipped to ``C_l`` on its own (the
      ghost, mixed and materialised paths alike), so one record moves the sum by at most
      ``C = sqrt(sum_l C_l^2)`` (add/remove; replace-one ``2C``), and the noise is ``N(0, (z C)^2 I)``:
      priced exactly as flat clipping at that ``C``. ``clip`` is a list (one radius per trainable parameter
      tensor, ``model.named_parameters()`` order), a dict ``{parameter or module name: C_l}`` (a module's
      name covers its parameters; the longest name wins; ``""`` is the whole model) or one number ``C``,
      split equally as ``C / sqrt(k)`` over the ``k`` tensors (the same noise as flat clipping at ``C``).
    - ``"adaptive"`` (Andrew et al. 2021): the radius follows the ``target_quantile`` ``gamma`` of the
      per-record gradient norms. ``clip`` is the initial radius ``C_0``. Each step releases, on its batch,
      the clipped sum at the radius in force ``C_t`` with ``N(0, (z_g C_t)^2 I)`` and the count
      ``sum_i (1[||g_i|| <= C_t] - 1/2) + N(0, count_noise^2)``, then sets
      ``C_{t+1} = C_t exp(-clip_lr (b_t - gamma))`` with ``b_t = (count + B/2) / B`` for the public batch size
      ``B``. ``C_t`` is a function of ``C_0`` and of the counts released before step ``t`` only
      (post-processing), never of the data directly. The shifted count moves by at most ``1/2`` (add/remove)
      or ``1`` (replace-one), half a clipped gradient's unit under either relation, so the pair is one
      Gaussian with ``1/z^2 = 1/z_g^2 + 1/(2 count_noise)^2``; the gradient's multiplier is raised to
      ``z_g = (z^-2 - (2 count_noise)^-2)^-1/2`` so that each step costs exactly one release at ``z`` (the
      given or calibrated noise). ``self.noise`` holds both streams, ``"gradient"`` (``z_g``) and
      ``"clip-count"`` (``2 count_noise``), and the accountant records their group per step
      (:class:`~dpvr.algorithms.dp_sgd.plan.AdaptiveClipDPSGDPlan`). The radius is in the checkpoints; each
      step's info has ``clip`` (the radius it used) and ``unclipped`` (the released fraction ``b_t``), both
      functions of releases.

    What shapes a release is public under the relation in force. Under add/remove the dataset size ``n``
    is private: the sampling rate ``batch_size / N``, random allocation's epoch and divisor, and the noise
    calibrated to them read the public size ``N = privacy.public_dataset_size`` (required for add/remove),
    never ``len(inputs)``; a full batch (DP-GD), whose mean divides by ``n``, is refused. Without a public
    size, Poisson sampling is accounted under replace-one, where ``n`` is public by definition
    (:meth:`dpvr.optim.PrivacyConfig.relation_and_size`). Opacus and most libraries take the rate from
    ``len(dataset)`` under add/remove, which makes every release's noise scale depend on the private size.

    ``sampling="cyclic"`` is Algorithm 1 of Kong & Ribero: disjoint batches in a fixed order,
    ``x <- prox_{lr h}(x - lr g + N(0, sigma^2 I))`` with ``h`` given by ``prox``, and only the *last
    iterate* released. It is accounted with the last-iterate bound (Theorems 2.2/2.3; replace-one), which
    needs the losses to be ``weak_convexity``-weakly convex and ``smoothness``-upper-smooth; step sizes the
    theorems do not cover are refused. Nothing about intermediate iterates is reported.

    Args:
        model: the ``nn.Module`` whose trainable parameters are ``x``.
        loss_fn: the per-record loss ``(output, target) -> scalar``.
        inputs: the private records' inputs (a tensor, one row per record), or
            :class:`~dpvr.optim.records.Records` holding inputs and targets.
        targets: the records' targets (one row per input); omitted with ``Records``.
        lr: the SGD step size; required without ``optimizer``, not given with one.
        clip: the per-sample clip radius ``C`` (L2, > 0); under ``clipping="per_layer"`` also a list or dict
            of per-group radii (above); under ``"adaptive"`` the initial radius.
        steps: the number of steps ``T`` (the planned run that is accounted).
        batch_size: the (expected) batch size ``b``, the public normaliser: Poisson rate ``b / n``,
            fixed-size ``"wor"`` and cyclic batches of ``b``; unused with ``"full"``.
        sampling: ``"poisson"`` (default; rate ``batch_size / n``), ``"wor"`` (fixed-size without
            replacement), ``"full"`` (every record) or ``"cyclic"`` (the last-iterate algorithm above).
        noise: the noise multiplier ``z`` of the one stream ``"gradient"`` (a number or
            ``{"gradient": z}``); ``None``: calibrated from ``privacy.epsilon`` for the whole ``steps``.
        prox: the proximal term ``h`` of ``sampling="cyclic"`` (:class:`~dpvr.optim.L1`,
            :class:`~dpvr.optim.ElasticNet`, :class:`~dpvr.optim.L2Ball`; the last one's diameter enters the
            bound); refused otherwise.
        weak_convexity: the losses' weak-convexity constant ``m`` (needed with ``"cyclic"``).
        smoothness: the losses' upper-smoothness constant ``M`` (needed with ``"cyclic"``).
        clipping: ``True`` or ``"flat"`` (default), ``"per_layer"`` or ``"adaptive"`` (above; both refused
            with ``"cyclic"``, whose last-iterate bound is for one fixed radius), or ``False`` (``"cyclic"``
            only; refused with the other schemes, whose accounting needs the clipping): it asserts that no
            per-example gradient norm ever exceeds ``clip`` (a known Lipschitz bound, e.g. unit-norm
            features for logistic regression), which gives the much smaller bound of Theorem 2.3 eq. (19);
            every step verifies the assertion and stops the run (releasing nothing more) if a gradient
            breaks it.
        target_quantile: ``"adaptive"`` only: the fraction ``gamma`` in (0, 1) of records to leave unclipped
            (default 0.5).
        clip_lr: ``"adaptive"`` only: the radius's geometric step ``eta_C > 0`` (default 0.2).
        count_noise: ``"adaptive"`` only: the count's noise std ``sigma_b``, more than ``z / 2`` (default
            ``batch_size / 20``, Andrew et al.'s choice; the full batch's ``n`` with ``"full"``).
        bound: the accounting of the cyclic run: ``"last-iterate"`` (default), ``"composition"`` (plain
            composition of the passes, valid for every iterate) or ``"best"`` (the smaller).
        optimizer: any ``torch.optim.Optimizer`` over the model's trainable parameters; it steps on the
            released noisy mean (written into each ``p.grad``) instead of the SGD step; it is post-processing
            of the release, so the guarantee is unchanged. Not with ``sampling="cyclic"``, whose bound
            assumes the SGD step.
        privacy: the :class:`~dpvr.optim.PrivacyConfig` (budget, delta, accountant, neighbouring relation).
        runtime: the :class:`~dpvr.optim.RuntimeConfig`; ``grad_mode="auto"`` uses ghost clipping where the
            model allows (``self.gradients.mode`` says which path ran), ``"materialised"`` forces per-sample
            gradients.
        settings: for subclasses: the settings the run's binding records (default: every argument but the
            model, loss and data, as given).

    Raises:
        ValueError: ``clip <= 0`` (or a per-layer radius ``<= 0``, a list whose length is not the number of
            trainable tensors, a dict name matching no parameter or leaving one uncovered); an unknown
            ``clipping``, ``False`` without ``"cyclic"``, ``"per_layer"``/``"adaptive"`` with ``"cyclic"``;
            ``target_quantile`` outside (0, 1), ``clip_lr <= 0``, ``count_noise <= z / 2``, or these settings
            without ``"adaptive"``; ``optimizer`` with ``sampling="cyclic"``; a bad ``lr`` (``<= 0``,
            missing without an optimizer, or given with one); ``sampling="full"`` under ``"add-remove"``;
            ``"cyclic"`` without ``weak_convexity`` and ``smoothness``, or with a step size the theorems do
            not cover, or an unknown ``bound``; ``prox`` without ``"cyclic"``; an unknown ``sampling`` or a
            batch size it cannot use; noise that is neither given nor calibratable.
        TypeError: ``clip`` not a number (one radius for the whole per-record gradient) outside
            ``"per_layer"``, or a per-layer radius that is not a number;
            ``privacy``/``runtime`` of the wrong type, ``optimizer`` not a ``torch.optim.Optimizer``,
            or ``targets`` given with ``Records``.
        RuntimeError: (at a step) under ``clipping=False``, a per-example gradient norm exceeded ``clip``;
            under ``"adaptive"``, the radius left the floating-point range.
        BudgetExhaustedError: (at a step) the release would exceed ``privacy.epsilon``.

    Guarantee:
        The composition of ``steps`` sampled Gaussian mechanisms with noise multiplier ``z`` under the
        neighbouring relation (default: add/remove for Poisson, replace-one otherwise), recorded step by step
        in ``self.accountant`` (per-layer: at the total radius; adaptive: each step's pair of releases as one
        Gaussian at ``z``, composed adaptively, the radius in force being chosen from earlier releases); a
        step that would exceed ``epsilon`` raises :class:`~dpvr.optim.base.BudgetExhaustedError` before
        anything is released. Under
        ``sampling="cyclic"``: the last iterate only, by the last-iterate bound chosen by ``bound``.
    """

    name = "DP-SGD"
    required_settings = ("clip", "steps")

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        inputs: torch.Tensor | Records,
        targets: torch.Tensor | None = None,
        *,
        lr: float | None = None,
        clip: float | Sequence[float] | dict[str, float],
        steps: int,
        batch_size: int | None = None,
        sampling: str = "poisson",
        noise: float | dict[str, float] | None = None,
        prox: object | None = None,
        weak_convexity: float | None = None,
        smoothness: float | None = None,
        clipping: bool | str = True,
        target_quantile: float | None = None,
        clip_lr: float | None = None,
        count_noise: float | None = None,
        bound: str = "last-iterate",
        optimizer: torch.optim.Optimizer | None = None,
        privacy: PrivacyConfig = PrivacyConfig(),
        runtime: RuntimeConfig = RuntimeConfig(),
        settings: Mapping[str, Any] | None = None,
    ) -> None:
        if sampling == "cyclic" and not isinstance(self, LastIterateDPSGD):
            # The variant is a subclass chosen at construction, before any state is set: DPSGD(...,
            # sampling="cyclic") is the last-iterate algorithm, whose accounting and resumption are its own
            # methods rather than a flag read throughout. (Not in __new__: the signature users read would
            # then be __new__'s.)
            self.__class__ = variant_class(type(self), LastIterateDPSGD)
        if settings is None:  # what the binding records: every argument above but the model, loss and data
            settings = dict(
                lr=lr, clip=clip, steps=steps, batch_size=batch_size, sampling=sampling, noise=noise,
                prox=prox, weak_convexity=weak_convexity, smoothness=smoothness, clipping=clipping,
                bound=bound, optimizer=optimizer, privacy=privacy, runtime=runtime,
                target_quantile=target_quantile, clip_lr=clip_lr, count_noise=count_noise,
            )  # fmt: skip
        records = as_records(inputs, targets)
        self.policy = _check_arguments(clip, clipping, sampling, noise,
                                       dict(target_quantile=target_quantile, clip_lr=clip_lr,
                                            count_noise=count_noise))
        lr = self._step_size(lr, optimizer, sampling)
        # Every quantity that shapes a release reads the public size: the data's own under replace-one, the
        # stated one under add/remove (where len(records) is private).
        n = len(records)
        neighbouring, public = privacy.relation_and_size(
            n, default=DPSGDPlan.default_neighbouring(sampling), sampling=sampling
        )
        plan = self._plan(
            sampling, n, public, neighbouring, runtime.sampler_seed, steps=steps, batch_size=batch_size,
            lr=lr, clip=clip, prox=prox, weak_convexity=weak_convexity, smoothness=smoothness, bound=bound,
        )  # fmt: skip
        self.adaptive: AdaptiveRadius | None = None
        if self.policy == "adaptive":
            plan, noise = self._adaptive_plan(plan, noise, privacy, clip, target_quantile=target_quantile,
                                              clip_lr=clip_lr, count_noise=count_noise)  # fmt: skip
        check_loss(model, loss_fn, *records.probe(1))
        super().__init__(
            model, loss_fn, plan=plan, noise=noise, privacy=privacy, runtime=runtime, settings=settings,
            data=records,
        )  # fmt: skip
        self.records = records
        self._init_state(model, loss_fn, clip, lr=lr, steps=steps, prox=prox, optimizer=optimizer,
                         runtime=runtime)

    def _step_size(
        self, lr: float | None, optimizer: torch.optim.Optimizer | None, sampling: str
    ) -> float | None:
        """The SGD step size (:func:`dpvr.optim.estimator.step_size`: required without an optimizer, refused
        with one)."""
        return step_size(lr, optimizer)

    def _plan(
        self, sampling: str, n: int, public: int, neighbouring: str, seed: int | None, *, steps: int,
        batch_size: int | None, lr: float | None, clip: Any, prox: object | None,
        weak_convexity: float | None, smoothness: float | None, bound: str,
    ) -> Any:  # fmt: skip
        """The accounted plan of the run, and its batch sampler (``self.sampler``): one sampled Gaussian
        release per step, at the sampling rate of the public size ``public``."""
        if prox is not None:
            raise ValueError("prox: only the cyclic last-iterate algorithm takes a proximal term")
        plan = DPSGDPlan(
            steps=steps,
            sampling=sampling,
            batch_size=n if sampling == "full" else batch_size,
            dataset_size=public,
            neighbouring=neighbouring,
        )
        self.sampler = BatchSampler.for_stream(plan, "gradient", n, seed, public_size=public)
        return plan

    def _adaptive_plan(
        self, plan: DPSGDPlan, noise: Any, privacy: PrivacyConfig, clip: Any, *,
        target_quantile: float | None, clip_lr: float | None, count_noise: float | None,
    ) -> tuple[AdaptiveClipDPSGDPlan, dict[str, float]]:  # fmt: skip
        """Adaptive clipping's plan and the two streams' multipliers; sets ``self.adaptive`` (the radius's
        state). The user's z (or the one calibrated for the plain plan) is what the pair of releases costs
        per step; the gradient's multiplier is raised to make room for the count's
        (:func:`dpvr.optim.clipping.split_noise`)."""
        # (one stream: a budget split across streams has nothing to split)
        z = resolve_noise(plan, noise, dataclasses.replace(privacy, shares=None))["gradient"]
        batch = self.sampler.batch_size  # public: the expected batch size, or n under replace-one
        sigma_b = batch / 20.0 if count_noise is None else count_noise
        self.adaptive = AdaptiveRadius(float(clip), 0.5 if target_quantile is None else target_quantile,
                                       0.2 if clip_lr is None else clip_lr, sigma_b)
        z_g, z_b = split_noise(z, self.adaptive.count_noise)
        plan = AdaptiveClipDPSGDPlan(**{f.name: getattr(plan, f.name)
                                               for f in dataclasses.fields(DPSGDPlan)})
        return plan, {"gradient": z_g, "clip-count": z_b}

    def _init_state(
        self, model: nn.Module, loss_fn: LossFn, clip: Any, *, lr: float | None, steps: int,
        prox: object | None, optimizer: torch.optim.Optimizer | None, runtime: RuntimeConfig,
    ) -> None:  # fmt: skip
        """The run's state after the base class is set up: the radius, the clipped-gradient engine and the
        buffers."""
        # The radius in force: one number (flat, adaptive: updated after each step), or per-layer radii.
        self.clip: float | LayerRadii = (layer_radii(model, clip) if self.policy == "per_layer"
                                         else float(clip))
        self.lr, self.steps, self.prox = lr, int(steps), prox
        self.optimizer = optimizer
        self.clipping = self.policy != "none"
        self.gradients = runtime.clipped_gradients(model, loss_fn)
        # The clipped sum stays in float64 until the release adds the noise (and rounds once): a float32 sum
        # of many records rounds at its own magnitude, which one record can move by more than 2C.
        self._sum = accumulators(self.flat)
        self.x = Iterate(self.params, optimizer, keep_previous=False)
        self.v = DifferenceEstimator(self.flat)  # reset at every step: the noisy clipped mean
        if self.adaptive is not None:  # the count's release (float64) and its exact sum
            self._count = self.flat[0].new_zeros(1, dtype=torch.float64)
            self._count_sum = [self.flat[0].new_zeros(1, dtype=torch.float64)]

    def _step(self) -> dict[str, float]:
        admitted = self._admit("gradient")
        inputs, targets = self.records.draw(self.sampler)
        # Per-record norms and losses in the parameters' dtype (the sum alone is float64).
        norms = self.flat[0].new_empty(len(inputs)) if self.policy in ("none", "adaptive") else None
        losses = self._loss_buffer(len(inputs))
        dropped = self.gradients.sum(inputs, targets, self.clip, self._sum, norms=norms, losses=losses,
                                     replace=True)
        if self.policy == "none" and not bool((norms <= self.clip).all()):
            raise RuntimeError(
                f"{self.name}: clipping=False asserted per-example gradient norms <= {self.clip:g}, but a "
                "gradient exceeded it; the last-iterate bound used does not hold, so the run stops here"
            )
        radius = self.clip.total if isinstance(self.clip, LayerRadii) else self.clip
        adaptive = {}
        if self.adaptive is not None:
            # The shifted count sum_i (1[n_i <= C] - 1/2), released on the same batch (a NaN norm: a record
            # dropped as non-finite counts as clipped; any function of the record alone moves it by <= 1/2).
            count = self._count_sum[0]
            count.fill_((norms <= self.clip).sum(dtype=torch.float64) - len(inputs) / 2.0)  # on the device
            release(
                [self._count], "clip-count", ClippedSum([count], 0.5),
                noise_multiplier=self.noise["clip-count"], reset=True, generator=self.generator,
            )  # fmt: skip
            released = float(self._count[0])
        self.v.release(
            "gradient", ClippedSum(self._sum, radius, self.sampler.batch_size),
            noise_multiplier=self.noise["gradient"], reset=True, generator=self.generator, iterate=self.x,
            lr=self.lr,
        )  # fmt: skip
        if self.adaptive is not None:
            # Post-processing of the released count: the next step's radius reads no private data.
            batch = self.sampler.batch_size
            adaptive = {"clip": radius, "unclipped": (released + batch / 2.0) / batch}
            self.clip = self.adaptive.update(released, batch)
        proximal.apply(self.prox, [p.detach() for p in self.params], self.lr)
        self._record(admitted)
        # The whole batch's size and mean loss (a data-parallel engine holds a share of the batch).
        batch, loss = self.gradients.batch_mean(losses, len(inputs))
        info = {"batch": batch, "nonfinite": dropped, **adaptive}
        if loss is not None:
            info["loss"] = loss  # a 0-d tensor: reading it waits for the device
        info.update(self._move())
        return info

    def _loss_buffer(self, size: int) -> torch.Tensor | None:
        """Where the step's pass writes each record's loss, for the batch's mean loss in the step's info
        (a diagnostic read at the iterate this step starts from, which was released)."""
        return self.flat[0].new_empty(size)

    def _move(self) -> dict[str, float]:
        """The step's length in the step's info (an optimizer's is unmeasured: none then)."""
        return {"move": self.x.move} if math.isfinite(self.x.move) else {}

    def _extra_state(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"sampler": self.sampler.state_dict()}
        if self.adaptive is not None:  # the radius in force: a function of the counts released so far
            extra["clip_radius"] = self.adaptive.radius
        return extra

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        if self.adaptive is not None:
            self.adaptive.radius = self.clip = float(state["clip_radius"])


class LastIterateDPSGD(DPSGD):
    """Last-iterate DP-SGD (Kong & Ribero, Algorithm 1): :class:`DPSGD` with ``sampling="cyclic"``, which
    constructs it (``DPSGD(..., sampling="cyclic")`` is an instance of this class). Its arguments are
    :class:`DPSGD`'s; only ``sampling="cyclic"`` (the default here) is taken.

    Guarantee:
        Only the last iterate is released, accounted by the last-iterate bound chosen by ``bound`` (Theorem
        2.3 or 2.2, or the composition of the passes), under replace-one; a step is admitted only if the
        bound of the trajectory so far, one step longer, stays within the budget, and a resumption that would
        release a second trajectory from a checkpoint is refused (unless ``bound="composition"``).

    The variant is this class's overrides of :class:`DPSGD`'s hooks, not a flag read throughout: the step
    size (no optimizer), the plan and sampler, the budget check and record of each step, the resumption
    check, and the step's information (no loss or step length, which would be read at an unreleased
    iterate).
    """

    releases_last_iterate_only = True

    def __init__(self, *args: Any, sampling: str = "cyclic", **kwargs: Any) -> None:
        super().__init__(*args, sampling=sampling, **kwargs)

    def _step_size(
        self, lr: float | None, optimizer: torch.optim.Optimizer | None, sampling: str
    ) -> float | None:
        if optimizer is not None and sampling == "cyclic":
            raise ValueError("optimizer: the last-iterate bound is proved for the (proximal) SGD step only")
        return super()._step_size(lr, optimizer, sampling)

    def _plan(
        self, sampling: str, n: int, public: int, neighbouring: str, seed: int | None, *, steps: int,
        batch_size: int | None, lr: float | None, clip: Any, prox: object | None,
        weak_convexity: float | None, smoothness: float | None, bound: str,
    ) -> CyclicDPSGDPlan:  # fmt: skip
        """The last-iterate bound's plan and the cyclic sampler: the traversal is accounted as a whole, not
        per sampled release."""
        if sampling != "cyclic":
            raise ValueError(f"sampling: {type(self).__name__} runs sampling='cyclic' only, got {sampling!r}")
        if neighbouring != "replace-one":
            raise ValueError("sampling='cyclic': the last-iterate bound is proved under replace-one only")
        self.sampler = BatchSampler("cyclic", n, batch_size, seed)
        if weak_convexity is None or smoothness is None:
            raise ValueError("sampling='cyclic': state weak_convexity (m) and smoothness (M) of the loss")
        return CyclicDPSGDPlan(
            dataset_size=n,
            batch_size=self.sampler.batch_size,
            steps=steps,
            lr=lr,
            clip=clip,
            weak_convexity=weak_convexity,
            smoothness=smoothness,
            bound=bound,
            clipping=self.policy != "none",
            domain_diameter=getattr(prox, "diameter", math.inf),
        )

    def _loss_buffer(self, size: int) -> None:
        return None  # the loss would be read at an intermediate iterate, which is not released

    def _move(self) -> dict[str, float]:
        return {}  # the step's length would reveal an intermediate iterate

    def _admit(self, stream: str) -> tuple[Any, Any]:
        # The bound covers this trajectory so far (the last-iterate bound, or the passes started): price it
        # with one more step, replacing what this segment recorded (an earlier branch's release, charged on
        # resume under its own segment, stays).
        plan = dataclasses.replace(self.plan, steps=self.steps_done + 1)
        admitted = (stream, plan(self.noise).event)
        trial = Accountant.from_state_dict(self.accountant.state_dict())
        trial.record(*admitted, run=self.ledger.segment, replace=True)
        budget = self.epsilon_budget
        if budget is not None and trial.epsilon(self.delta) > budget:
            raise BudgetExhaustedError(
                f"{self.name}: releasing the iterate after step {self.steps_done + 1} would exceed the "
                f"budget epsilon={budget:g} (spent so far: "
                f"{self.accountant.epsilon(self.delta):.4g})"
            )
        if self.steps_done + 1 == self.steps:  # the step that makes the release: the last iterate
            self._write_ahead(*admitted, replace=True)
        else:  # an unreleased iterate: nothing to write down, but its noise keys are never reused
            self.generator.for_release(self.ledger.noise_context() + f"/step {self.steps_done + 1}".encode())
        return admitted

    def _check_rerun(self, after: list[Release]) -> None:
        if after and self.plan.bound != "composition":
            raise ValueError(
                f"{self.name}: this run released its last iterate after the checkpoint being loaded; going "
                "on from it would release a second trajectory sharing the first one's start, which the "
                f"last-iterate bound (bound={self.plan.bound!r}) does not cover. Resume from a later "
                "checkpoint, or account the run with bound='composition' (valid for every iterate)"
            )

    def _record(self, admitted: tuple[Any, Any]) -> None:
        self.guard.record(*admitted, replace=True)






def _check_arguments(clip: Any, clipping: Any, sampling: str, noise: Any, adaptive: Mapping[str, Any]) -> str:
    """The clipping policy (:func:`dpvr.optim.clipping.check_policy`), after checking that ``clip`` has its
    shape (one radius > 0; a list or dict of radii for ``"per_layer"`` only), that ``False`` comes only with
    the cyclic last-iterate run and the adaptive settings only with ``"adaptive"``: a setting DP-SGD cannot
    honour is refused rather than ignored. A zero noise multiplier is refused saying why (the other bad
    values by the plan's own check)."""
    given = noise.values() if isinstance(noise, Mapping) else [noise]
    if any(z is not None and not isinstance(z, str) and z == 0 for z in given):
        raise ValueError(
            "noise: a noise multiplier of 0 releases the clipped gradients exactly, which is not "
            "differentially private at any epsilon (dpvr refuses it); for a non-private baseline train "
            "without dpvr, or give a small multiplier > 0 (privacy_spent() then reports its epsilon, inf "
            "where it is unbounded)"
        )
    policy = check_policy(clipping)
    stray = sorted(name for name, value in adaptive.items() if value is not None)
    if stray and policy != "adaptive":
        raise ValueError(f"{', '.join(stray)}: settings of clipping='adaptive', given with "
                         f"clipping={clipping!r}")
    if policy != "flat" and sampling == "cyclic" and policy != "none":
        raise ValueError(
            f"clipping={clipping!r}: sampling='cyclic' is accounted by the last-iterate bound, proved for "
            "one fixed radius on the whole gradient; use clipping=True there"
        )
    if policy == "none" and sampling != "cyclic":
        raise ValueError(
            f"clipping=False: only sampling='cyclic' takes it (the last-iterate bound of a known Lipschitz "
            f"constant, verified at every step); sampling={sampling!r} always clips each record's gradient "
            "to clip, which its accounting needs"
        )
    if policy == "per_layer" and isinstance(clip, (list, tuple, Mapping)):
        return policy  # each radius checked against the model's parameters (grads.layer_clip.layer_radii)
    try:
        radius = None if isinstance(clip, (bool, str)) else float(clip)
    except (TypeError, ValueError):
        radius = None
    if radius is None:
        shaped = isinstance(clip, (list, tuple, Mapping))
        raise TypeError(
            f"clip: clipping={clipping!r} clips each record's whole gradient (every parameter at once) to "
            f"one radius C, a number > 0; got {type(clip).__name__} {clip!r}"
            + (" (per-parameter radii need clipping='per_layer')" if shaped else "")
        )
    if not (radius > 0 and math.isfinite(radius)):
        raise ValueError(f"clip: must be a finite number > 0, got {clip}")
    return policy
