"""DP Double-SPIDER (psi-divergence DRO, dual form) and DP Recursive-SPIDER (KL-DRO, compositional form).

Both are SPIDER estimators refreshed every ``q`` steps: at a refresh step an estimator is reset to a noisy
mean of per-sample clipped gradients; at the other steps it adds a noisy mean of per-sample clipped
same-sample differences between the current and the previous point, clipped at a radius proportional to
how far the (released) iterates moved, with noise std proportional to that radius. Each noisy mean is a
release of one stream of the plans :class:`dpvr.privacy.events.DoubleSpiderPlan` / ``RecursiveSpider``, which
the algorithm admits (budget guard), performs and records in one accountant, as it happens.

Noise multipliers are dpvr's (``dpvr account double-spider --noise-multipliers ...``): the noise std on a
stream's batch *mean* is ``z * C / b`` with ``C`` its clip radius and ``b`` its batch size (``n`` for a full
batch).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap

from ..privacy import events
from ..problems import (
    Divergence,
    LossFn,
    dual_eta_grads,
    dual_weights,
    inner_lambda_grads,
    inner_values,
    inner_x_weights,
)
from .base import PrivateAlgorithm
from .config import PrivacyConfig, RuntimeConfig, stream_clips
from .estimator import ClippedSum, DifferenceEstimator, Iterate, Radius, global_norm, release
from .gradients import ClippedGradients, accumulators, check_loss
from .records import Batch, Records, as_records
from .sampling import BatchSampler


class _Spider(PrivateAlgorithm):
    """What both algorithms share: data, one sampler per stream, per-sample losses and clipped sums at
    iterates, the noisy estimator update of one stream, and the previous iterate ``x_{t-1}``."""


    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        records: Records,
        *,
        plan: events._SpiderPlan,
        noise: Mapping[str, float] | None,
        privacy: PrivacyConfig,
        runtime: RuntimeConfig,
        settings: Mapping[str, Any],
    ) -> None:
        privacy.require_replace_one(self.name)
        check_loss(model, loss_fn, *records.probe(1))
        super().__init__(
            model, loss_fn, plan=plan, noise=noise, privacy=privacy, runtime=runtime, settings=settings,
            data=records,
        )  # fmt: skip
        self.records = records
        n = len(records)
        # One sampler per stream, keyed by name and sized by the plan's own per-stream batch size: what a
        # stream draws is what its releases are charged for.
        self.samplers = {
            stream: BatchSampler.for_stream(plan, stream, n, runtime.sampler_seed_for(k))
            for k, (stream, _) in enumerate(plan.batch_sizes)
        }
        self.gradients = ClippedGradients(
            model, loss_fn, mode=runtime.grad_mode, chunk_size=runtime.chunk_size, nonfinite=self.nonfinite
        )
        # Sums over records stay in float64 until their release adds the noise (and rounds once).
        self._sum = accumulators(self.flat)
        self.x = Iterate(self.params)  # x_t and x_{t-1}

    def _draw(self, stream: str) -> Batch:
        """The records of ``stream``'s next batch, ``(inputs, targets)``."""
        return self.records.draw(self.samplers[stream])

    def _losses(self, point: Sequence[Tensor], batch: Batch) -> Tensor:
        """Per-sample losses at the parameter values ``point`` (no gradient)."""
        inputs, targets = batch
        with torch.no_grad():
            outputs = functional_call(self.model, dict(zip(self.param_names, point)), (inputs,))
            return vmap(self.loss_fn)(outputs, targets)

    def _vector_sum(
        self,
        batch: Batch,
        radius: float,
        weights: Tensor,
        previous: Sequence[Tensor] | None = None,
        previous_weights: Tensor | None = None,
    ) -> int:
        """``self._sum = sum_i clip(w_i grad l(x_t; z_i))`` or, with ``previous``, the clipped same-sample
        difference ``w_i grad l(x_t; z_i) - w'_i grad l(x_{t-1}; z_i)``; radius 0 means both points and
        weights coincide, so the sum is exactly zero."""
        for s in self._sum:
            s.zero_()
        if radius == 0:
            return 0
        dtype = self.params[0].dtype
        (inputs, t), x, w = batch, self.x.point(), weights.to(dtype)
        if previous is None:
            return self.gradients.sum(inputs, t, radius, self._sum, point=x, weights=w)
        return self.gradients.diff_sum(
            inputs, t, x, previous, radius, self._sum, a=w, b=previous_weights.to(dtype)
        )

    def _scalar_sum(self, values: Tensor, radius: float, out: Tensor) -> int:
        """``out = sum_i clip_radius(values_i)`` for per-sample scalars (or same-sample differences of them),
        through the engine like every other sum of a release (so a data-parallel engine all-reduces it)."""
        out.zero_()
        if radius == 0:
            return 0
        # The per-record values in the parameters' dtype (clipped so), their sum into float64 ``out``.
        return self.gradients.rows(values.reshape(-1, 1).to(self.params[0].dtype), radius, [out])

    def _clipped(self, stream: str, total: Sequence[Tensor], radius: float) -> ClippedSum:
        """``total``, a sum over ``stream``'s batch of terms clipped into a ball of ``radius``."""
        return ClippedSum(total, radius, self.samplers[stream].batch_size)

    def _clipped_range(self, stream: str, total: Sequence[Tensor], low: float, high: float) -> ClippedSum:
        """``total``, a sum over ``stream``'s batch of scalar terms confined to ``[low, high]``: a replace-one
        range, less than a ball's ``2 high`` when the terms are one-sided."""
        return ClippedSum.replace_one(total, high - low, self.samplers[stream].batch_size)

    def _release(self, stream: str, estimator: DifferenceEstimator, clipped: ClippedSum, reset: bool) -> None:
        """``v <- (0 if reset else v) + clipped / b + noise`` at the stream's noise multiplier."""
        estimator.release(
            stream, clipped, noise_multiplier=self.noise[stream], reset=reset, generator=self.generator
        )

    def _buffers(self) -> dict[str, list[Tensor]]:
        return {"prev": self.x.previous}

    def _extra_state(self) -> dict[str, Any]:
        return {"dx": self.x.move, "samplers": {k: s.state_dict() for k, s in self.samplers.items()}}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.x.move = float(state["dx"])
        for k, s in self.samplers.items():
            s.load_state_dict(state["samplers"][k])


class DoubleSpider(_Spider):
    """DP Double-SPIDER (Algorithm 2) on the dual ``L(x, eta) = mean_i lam psi*((l_i(x) - eta)/lam) + eta``.

    Step ``t = 0, 1, ...`` (a refresh when ``t % q == 0``), ``a = (l - eta) / lam`` per sample:

    1. eta-estimator ``g``: refresh, ``g = mean_{B1} clip_{C1}(1 - (psi*)'(a(x_t, eta_t))) + noise``;
       otherwise ``g += mean_{B2} clip_{C2,t}(grad_eta L(x_t, eta_t) - grad_eta L(x_{t-1}, eta_{t-1}))
       + noise`` (same sample at both points),
       ``C2,t = max(k2_eta |eta_t - eta_{t-1}|, k2_x ||x_t - x_{t-1}||)``;
    2. ``eta_{t+1} = eta_t - alpha g``;
    3. x-estimator ``v`` at the new ``eta_{t+1}``: refresh, ``v = mean_{B3} clip_{C3}((psi*)'(a) grad l(x_t))
       + noise``; otherwise ``v += mean_{B4} clip_{C4,t}((psi*)'(a(x_t, eta_{t+1})) grad l(x_t)
       - (psi*)'(a(x_{t-1}, eta_t)) grad l(x_{t-1})) + noise``,
       ``C4,t = max(k4_eta |eta_{t+1} - eta_t|, k4_x ||x_t - x_{t-1}||)``;
    4. the normalised step ``x_{t+1} = x_t - beta_t v`` with ``beta_t = min(lr, max_move / ||v||)``
       (Theorem 7's ``min(1/(2 L0), 1/(L0 sqrt(n) ||v||))``), so ``||x_{t+1} - x_t|| <= max_move``.

    The difference radii follow Theorem 6's ``C2 = 2 max(L2 |d eta|, G M ||d x|| / lam)`` and
    ``C4 = 2 max(M L |d eta| / lam, (L0 + L1 sqrt(H)) ||d x||)`` with the constants as public coefficients
    ``clip["eta-difference"] = (k2_eta, k2_x)``, ``clip["x-difference"] = (k4_eta, k4_x)`` (both > 0: a zero
    coefficient would make a moving point's difference unclipped). The paper's ``C1, C3`` are
    ``clip["eta-refresh"]``, ``clip["x-refresh"]``; ``q`` is ``restart``.

    Args:
        model: the ``nn.Module`` whose trainable parameters are ``x`` (``x0``: its parameters on entry).
        loss_fn: the per-record loss ``l_i(x)``, ``(output, target) -> scalar``.
        inputs: the private records' inputs, or :class:`~dpvr.optim.records.Records`.
        targets: the records' targets; omitted with ``Records``.
        divergence: the psi-divergence (:class:`~dpvr.problems.dual.Divergence`) whose conjugate ``psi*``
            defines the dual.
        lam: the weight ``lam`` of the psi-divergence penalty in the DRO objective (> 0).
        steps: the number of steps ``T``.
        restart: the refresh period ``q`` (a refresh when ``t % q == 0``).
        batch_sizes: the batch sizes ``N1..N4``: ``{stream: b}`` for the streams ``"eta-refresh"``,
            ``"eta-difference"``, ``"x-refresh"``, ``"x-difference"``, or a sequence in that (the paper's)
            order; a batch equal to the dataset size is a full batch.
        lr: the x step size's upper bound (Theorem 7's ``1/(2 L0)``), > 0.
        lr_eta: the eta step size ``alpha``, > 0.
        max_move: the largest x step ``||x_{t+1} - x_t||`` (> 0).
        clip: ``{"eta-refresh": C1, "eta-difference": (k2_eta, k2_x), "x-refresh": C3,
            "x-difference": (k4_eta, k4_x)}``; every number > 0.
        eta0: the starting dual variable ``eta_0`` (public); default 0.
        noise: the four streams' noise multipliers ``{stream: z}``; ``None``: calibrated jointly from
            ``privacy.epsilon`` for the total ``(epsilon, delta)``.
        sampling: how each batch is drawn: ``"wor"`` (default: fixed-size without replacement) or another
            scheme of :mod:`dpvr.optim.sampling`.
        privacy: the :class:`~dpvr.optim.PrivacyConfig`.
        runtime: the :class:`~dpvr.optim.RuntimeConfig`.

    Raises:
        ValueError: ``privacy.neighbouring="add-remove"`` (replace-one only: the sizes are the data's);
            ``lam``, ``lr``, ``lr_eta`` or ``max_move`` not > 0; ``clip`` without exactly the four
            streams, a radius not > 0, or a difference coefficient that is 0; ``batch_sizes`` that do not
            name the four streams or exceed the dataset size; ``steps < 1`` or ``restart < 1``; an unknown
            ``sampling``; noise that is neither given nor calibratable.
        TypeError: ``clip`` not a mapping, ``privacy``/``runtime`` of the wrong type, or ``targets`` given
            with ``Records``.

    Guarantee:
        Replace-one, the paper's relation: each of the four streams releases a mean over its batch of
        per-sample terms of norm at most its radius, plus Gaussian noise of std ``z C / b``; the radii are
        functions of released values only (``eta`` and ``x`` iterates), so each release is a sampled
        Gaussian mechanism with a fixed noise multiplier ``z``. The eta-refresh terms ``1 - (psi*)'(a)`` are
        at most 1 (``(psi*)' >= 0``), so clipped at ``C1`` they lie in ``[-C1, min(1, C1)]``: replacing a
        record moves the sum by at most ``C1 + min(1, C1)``, twice the unit ``(C1 + min(1, C1)) / 2`` that
        the noise std ``z (C1 + min(1, C1)) / (2 b)`` is scaled to (``z C1 / b`` when ``C1 <= 1``). All four
        streams are composed in one accountant as the plan :class:`dpvr.privacy.events.DoubleSpiderPlan`
        describes, behind the budget guard. Assumptions: batches drawn as stated (seeded from the operating
        system unless ``runtime.sampler_seed``), ``x0`` and ``eta0`` independent of the data, a loss that is
        a function of one record.

    Departures from the printed algorithm: per-sample clipping (the printed one clips the batch mean, which
    has no per-record sensitivity bound); one accountant for all four streams (the paper calibrates each to
    the full budget); output is the last iterate (the paper's uniformly random iterate is not kept); ``G``-
    rescaling of eta is not used (``G = 1``).
    """

    name = "Double-SPIDER"

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        inputs: Tensor | Records,
        targets: Tensor | None = None,
        *,
        divergence: Divergence,
        lam: float,
        steps: int,
        restart: int,
        batch_sizes: Mapping[str, int] | Sequence[int],
        lr: float,
        lr_eta: float,
        max_move: float,
        clip: Mapping[str, float | tuple[float, float]],
        eta0: float = 0.0,
        noise: Mapping[str, float] | None = None,
        sampling: str = "wor",
        privacy: PrivacyConfig = PrivacyConfig(),
        runtime: RuntimeConfig = RuntimeConfig(),
    ) -> None:
        settings = dict(
            divergence=divergence, lam=lam, steps=steps, restart=restart, batch_sizes=batch_sizes, lr=lr,
            lr_eta=lr_eta, max_move=max_move, clip=clip, eta0=eta0, noise=noise, sampling=sampling,
            privacy=privacy, runtime=runtime,
        )  # fmt: skip
        for name, value in (("lam", lam), ("lr", lr), ("lr_eta", lr_eta), ("max_move", max_move)):
            if not value > 0:
                raise ValueError(f"{name}: must be > 0, got {value}")
        differences = ("eta-difference", "x-difference")
        streams = ("eta-refresh", "eta-difference", "x-refresh", "x-difference")
        clip = stream_clips(clip, streams, pairs=differences)
        for stream in differences:
            if not min(clip[stream]) > 0:  # a zero coefficient leaves a moving point's difference unclipped
                raise ValueError(f"clip[{stream!r}]: both coefficients must be > 0, got {clip[stream]}")
        records = as_records(inputs, targets)
        plan = events.DoubleSpiderPlan(len(records), steps, restart, _batch_sizes(batch_sizes), sampling)
        super().__init__(
            model, loss_fn, records, plan=plan, noise=noise, privacy=privacy, runtime=runtime,
            settings=settings,
        )  # fmt: skip
        self.divergence, self.lam, self.restart, self.clip = divergence, float(lam), int(restart), clip
        self.lr, self.lr_eta, self.max_move = float(lr), float(lr_eta), float(max_move)
        # Difference radii capped at twice the refresh radius (not in the paper: noise cannot feed on itself).
        self.eta_radius = Radius(
            clip["eta-refresh"], per_move=clip["eta-difference"], cap=2 * clip["eta-refresh"]
        )
        self.x_radius = Radius(clip["x-refresh"], per_move=clip["x-difference"], cap=2 * clip["x-refresh"])
        dtype = self.params[0].dtype
        self.eta = torch.tensor([float(eta0)], dtype=dtype)  # eta_t
        self._eta_prev = self.eta.clone()  # eta_{t-1}
        self.g = DifferenceEstimator([self.eta])  # estimates grad_eta L
        self.v = DifferenceEstimator(self.flat)  # estimates grad_x L
        self._g_sum = torch.zeros(1, dtype=torch.float64)  # a sum over records: float64 until the noise

    def _step(self) -> dict[str, float]:
        t = self.steps_done
        refresh = t % self.restart == 0
        x, x_prev, eta, eta_prev = self.x.point(), self.x.previous, float(self.eta), float(self._eta_prev)
        div, lam = self.divergence, self.lam
        # 1. the eta-estimator g at (x_t, eta_t)
        stream = "eta-refresh" if refresh else "eta-difference"
        radius = self.eta_radius(refresh, abs(eta - eta_prev), self.x.move)
        with self.releasing(stream):
            batch = self._draw(stream)
            values = dual_eta_grads(div, self._losses(x, batch), eta, lam)
            if not refresh:
                values = values - dual_eta_grads(div, self._losses(x_prev, batch), eta_prev, lam)
            dropped = self._scalar_sum(values, radius, self._g_sum)
            # grad_eta = 1 - (psi*)' <= 1, as (psi*)' >= 0: a refresh term lies in [-C1, min(1, C1)]
            clipped = (
                self._clipped_range(stream, [self._g_sum], -radius, min(1.0, radius))
                if refresh
                else self._clipped(stream, [self._g_sum], radius)
            )
            self._release(stream, self.g, clipped, refresh)
        # 2. eta_{t+1} = eta_t - lr_eta g
        self._eta_prev.copy_(self.eta)
        self.eta.sub_(self.g.value[0], alpha=self.lr_eta)
        eta_next = float(self.eta)
        # 3. the x-estimator v at (x_t, eta_{t+1}), the difference against (x_{t-1}, eta_t)
        stream = "x-refresh" if refresh else "x-difference"
        radius = self.x_radius(refresh, abs(eta_next - eta), self.x.move)
        with self.releasing(stream):
            batch = self._draw(stream)
            weights = dual_weights(div, self._losses(x, batch), eta_next, lam)
            if refresh:
                dropped += self._vector_sum(batch, radius, weights)
            else:
                before = dual_weights(div, self._losses(x_prev, batch), eta, lam)
                dropped += self._vector_sum(batch, radius, weights, x_prev, before)
            self._release(stream, self.v, self._clipped(stream, self._sum, radius), refresh)
        # 4. the normalised step x_{t+1} = x_t - min(lr, max_move / ||v||) v
        norm = global_norm(self.v.value)
        self.x.step(self.v.value, min(self.lr, self.max_move / norm) if norm > 0 else self.lr)
        return {"refresh": float(refresh), "eta": eta_next, "move": self.x.move, "v": norm,
                "nonfinite": dropped}

    def _buffers(self) -> dict[str, list[Tensor]]:
        return {**super()._buffers(), "v": self.v.value, "g": self.g.value, "eta": [self.eta, self._eta_prev]}


class RecursiveSpider(_Spider):
    """DP Recursive-SPIDER (Algorithm 3), as intended, on KL-DRO in compositional form
    ``min_{x, lam >= lam0} lam log mean_i exp(l_i(x)/lam) + lam rho``, ``w = (x, lam)``.

    With the shifted inner function ``g(w; z) = exp((min(l, B) - B)/lam)`` (``B = loss_bound``, public),
    step ``t = 0, 1, ...`` (a refresh when ``t % q == 0``), ``d_t = ||w_t - w_{t-1}||``:

    1. ``v`` (estimates ``grad_x g``): refresh ``v = mean_{B1} clip_{C1}(grad_x g(w_t)) + noise``, otherwise
       ``v += mean_{B2} clip_{k2 d_t}(grad_x g(w_t) - grad_x g(w_{t-1})) + noise`` (same sample);
    2. ``u`` (estimates ``grad_lam g``): the same with ``B3``, ``C3`` and ``B4``, ``k4 d_t``;
    3. ``s`` (STORM estimate of ``g``) from one record ``z``: ``s = clip_{C5}(g(w_t; z)) + (1 - beta)
       (s - clip_{C5}(g(w_{t-1}; z))) + N(0, (z_s (2 - beta) C5 / 2)^2)``, starting from the public ``s0``
       with ``w_{-1} = w_0``;
    4. with ``s' = max(s, s_floor)``: ``x <- x - lr (lam/s') v``,
       ``lam <- max(lam0, lam - lr_lam ((lam/s') u + log s' + rho))``.

    The paper's ``C1 .. C5`` and ``k2, k4`` are ``clip["v-refresh"]``, ``clip["v-difference"]`` (``k2``),
    ``clip["u-refresh"]``, ``clip["u-difference"]`` (``k4``) and ``clip["s"]``; ``q`` is ``restart``.

    Args:
        model: the ``nn.Module`` whose trainable parameters are ``x`` (``x0``: its parameters on entry).
        loss_fn: the per-record loss ``l_i(x)``, ``(output, target) -> scalar``.
        inputs: the private records' inputs, or :class:`~dpvr.optim.records.Records`.
        targets: the records' targets; omitted with ``Records``.
        rho: the KL-ball radius ``rho`` of the DRO objective.
        lam0: the lower bound ``lam0`` on ``lam`` (> 0; ``lam`` is projected onto ``[lam0, inf)``).
        steps: the number of steps ``T``.
        restart: the refresh period ``q`` (a refresh when ``t % q == 0``).
        batch_sizes: the batch sizes ``b1..b4``: ``{stream: b}`` for ``"v-refresh"``, ``"v-difference"``,
            ``"u-refresh"``, ``"u-difference"``, or a sequence in that (the paper's) order; ``"s"`` always
            draws one record.
        lr: the x step size (> 0).
        lr_lam: the ``lam`` step size (> 0).
        beta: the STORM weight ``beta``, in ``(0, 1]``.
        loss_bound: the public cap ``B`` on the loss (the inner function's shift).
        clip: ``{"v-refresh": C1, "v-difference": k2, "u-refresh": C3, "u-difference": k4, "s": C5}``; each
            > 0 (``k2``, ``k4`` per unit of ``d_t``).
        lam_init: the starting ``lam``, ``>= lam0``; default 1.
        s0: the starting STORM estimate ``s``; default 1.
        s_floor: the public floor ``s`` is clamped to where used (> 0); default ``1e-3``.
        noise: the five streams' noise multipliers ``{stream: z}``; ``None``: calibrated jointly from
            ``privacy.epsilon``.
        sampling: how each batch is drawn: ``"wor"`` (default: fixed-size without replacement) or another
            scheme of :mod:`dpvr.optim.sampling`.
        privacy: the :class:`~dpvr.optim.PrivacyConfig`.
        runtime: the :class:`~dpvr.optim.RuntimeConfig`.

    Raises:
        ValueError: ``privacy.neighbouring="add-remove"`` (replace-one only: the sizes are the data's);
            ``lam0``, ``lr``, ``lr_lam`` or ``s_floor`` not > 0; ``beta`` outside ``(0, 1]``;
            ``lam_init < lam0``; ``clip`` without exactly the five streams or a radius not > 0;
            ``batch_sizes`` that do not name the four sampled streams or exceed the dataset size;
            ``steps < 1`` or ``restart < 1``; an unknown ``sampling``; noise neither given nor calibratable.
        TypeError: ``clip`` not a mapping, ``privacy``/``runtime`` of the wrong type, or ``targets`` given
            with ``Records``.

    Guarantee:
        Replace-one: every stream releases a mean of per-sample terms bounded by its radius, with noise std
        ``z C / b``, except where a term is one-sided: the u-refresh terms ``d g / d lam >= 0`` clipped at
        ``C3`` lie in ``[0, C3]``, so replacing a record moves the sum by at most ``C3``, twice the unit
        ``C3 / 2`` (noise std ``z C3 / (2 b)``). For ``s`` the released term of the one drawn record lies in
        ``[-(1 - beta) C5, C5]`` (both inner values are clipped into ``[0, C5]``; a record with a non-finite
        value contributes 0), so replacing that record moves it by at most ``(2 - beta) C5``: the
        replace-one sensitivity, which is twice dpvr's unit, so the unit is ``(2 - beta) C5 / 2`` and the
        noise std ``z_s (2 - beta) C5 / 2``. Radii depend on released iterates only; the five streams are
        composed in one accountant as the plan :class:`dpvr.privacy.events.RecursiveSpiderPlan` describes,
        behind the budget guard. Assumptions: batches as stated, ``x0``, ``lam0``, ``lam_init``, ``s0``,
        ``B`` and ``s_floor`` independent of the data.

    Departures from the printed algorithm (each fixes a bug listed in the design notes):

    - SPIDER accumulation: the printed lines 13-14 drop ``+ v_{t-1}`` / ``+ u_{t-1}``; here they accumulate;
    - STORM: the printed line 16 evaluates ``g(w_t; z)`` twice (a plain moving average); here the second
      evaluation is at ``w_{t-1}``, as the proof (Lemma 8) uses;
    - start: ``w_0 = 0`` puts ``lam = 0``; here ``lam`` starts at ``lam_init >= lam0``, ``s`` at ``s0``, and
      the first step is a refresh (the printed loop first refreshes at ``t = q``, with uninitialised
      estimators before);
    - ``lam`` is projected onto ``[lam0, inf)`` after each step (the constraint of problem (5));
    - ``exp(l/lam)`` overflows for ``lam`` near ``lam0``: the inner function is shifted by the public bound
      ``B`` on a loss capped at ``B`` (a sample above the cap contributes no x-gradient), which leaves the
      objective unchanged below the cap and bounds every inner value by 1;
    - ``log s`` and ``lam/s`` of a noisy ``s``: ``s`` is clamped to the public floor ``s_floor`` where used;
    - the noise variances use each stream's own radius (the printed lines 11-12 swap the hats), one
      accountant for all streams, and the last iterate is the output.
    """

    name = "Recursive-SPIDER"

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        inputs: Tensor | Records,
        targets: Tensor | None = None,
        *,
        rho: float,
        lam0: float,
        steps: int,
        restart: int,
        batch_sizes: Mapping[str, int] | Sequence[int],
        lr: float,
        lr_lam: float,
        beta: float,
        loss_bound: float,
        clip: Mapping[str, float],
        lam_init: float = 1.0,
        s0: float = 1.0,
        s_floor: float = 1e-3,
        noise: Mapping[str, float] | None = None,
        sampling: str = "wor",
        privacy: PrivacyConfig = PrivacyConfig(),
        runtime: RuntimeConfig = RuntimeConfig(),
    ) -> None:
        settings = dict(
            rho=rho, lam0=lam0, steps=steps, restart=restart, batch_sizes=batch_sizes, lr=lr, lr_lam=lr_lam,
            beta=beta, loss_bound=loss_bound, clip=clip, lam_init=lam_init, s0=s0, s_floor=s_floor,
            noise=noise, sampling=sampling, privacy=privacy, runtime=runtime,
        )  # fmt: skip
        for name, value in (("lam0", lam0), ("lr", lr), ("lr_lam", lr_lam), ("s_floor", s_floor)):
            if not value > 0:
                raise ValueError(f"{name}: must be > 0, got {value}")
        if not 0 < beta <= 1:
            raise ValueError(f"beta: must be in (0, 1], got {beta}")
        if not lam_init >= lam0:
            raise ValueError(f"lam_init: must be >= lam0 = {lam0}, got {lam_init}")
        clip = stream_clips(clip, ("v-refresh", "v-difference", "u-refresh", "u-difference", "s"))
        records = as_records(inputs, targets)
        plan = events.RecursiveSpiderPlan(len(records), steps, restart, _batch_sizes(batch_sizes), sampling)
        super().__init__(
            model, loss_fn, records, plan=plan, noise=noise, privacy=privacy, runtime=runtime,
            settings=settings,
        )  # fmt: skip
        self.rho, self.lam0, self.restart, self.clip = float(rho), float(lam0), int(restart), clip
        self.lr, self.lr_lam, self.beta, self.bound = float(lr), float(lr_lam), float(beta), float(loss_bound)
        self.s_floor = float(s_floor)
        # Difference radii capped at twice the refresh radius (not in the paper: noise cannot feed on itself).
        self.v_radius = Radius(clip["v-refresh"], per_move=(clip["v-difference"],), cap=2 * clip["v-refresh"])
        self.u_radius = Radius(clip["u-refresh"], per_move=(clip["u-difference"],), cap=2 * clip["u-refresh"])
        dtype = self.params[0].dtype
        self.lam = torch.tensor([float(lam_init)], dtype=dtype)
        self._lam_prev = self.lam.clone()
        self.s = torch.tensor([float(s0)], dtype=dtype)
        self.v = DifferenceEstimator(self.flat)  # estimates grad_x g
        self.u = DifferenceEstimator([self.lam])  # estimates grad_lam g
        # Sums over records: float64 until the noise is added.
        self._u_sum, self._s_term = torch.zeros(1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)

    def _step(self) -> dict[str, float]:
        t = self.steps_done
        refresh = t % self.restart == 0
        x, x_prev = self.x.point(), self.x.previous
        lam, lam_prev, bound = float(self.lam), float(self._lam_prev), self.bound
        dw = math.hypot(self.x.move, lam - lam_prev)
        # 1. v: grad_x g
        stream = "v-refresh" if refresh else "v-difference"
        radius = self.v_radius(refresh, dw)
        with self.releasing(stream):
            batch = self._draw(stream)
            weights = inner_x_weights(self._losses(x, batch), lam, bound)
            if refresh:
                dropped = self._vector_sum(batch, radius, weights)
            else:
                before = inner_x_weights(self._losses(x_prev, batch), lam_prev, bound)
                dropped = self._vector_sum(batch, radius, weights, x_prev, before)
            self._release(stream, self.v, self._clipped(stream, self._sum, radius), refresh)
        # 2. u: grad_lam g
        stream = "u-refresh" if refresh else "u-difference"
        radius = self.u_radius(refresh, dw)
        with self.releasing(stream):
            batch = self._draw(stream)
            values = inner_lambda_grads(self._losses(x, batch), lam, bound)
            if not refresh:
                values = values - inner_lambda_grads(self._losses(x_prev, batch), lam_prev, bound)
            dropped += self._scalar_sum(values, radius, self._u_sum)
            # d g / d lam >= 0: a refresh term lies in [0, C3], a replace-one range of C3, half of a ball's
            clipped = (
                self._clipped_range(stream, [self._u_sum], 0.0, radius)
                if refresh
                else self._clipped(stream, [self._u_sum], radius)
            )
            self._release(stream, self.u, clipped, refresh)
        # 3. s: the STORM estimate of g on one record at w_t and w_{t-1}
        with self.releasing("s"):
            record = self._draw("s")
            # Through the engine: in a data-parallel run the process holding the record forms its term, the
            # others (holding none) add exactly zero, and the all-reduce gives every process the term.
            self._s_term.zero_()
            dropped += self.gradients.clamped_diff_sum(
                inner_values(self._losses(x, record), lam, bound),
                inner_values(self._losses(x_prev, record), lam_prev, bound),
                0.0, self.clip["s"], [self._s_term], weight=1 - self.beta,
            )  # fmt: skip
            self.s.mul_(1 - self.beta)
            # now in [0, C], (1 - beta) before in [0, (1 - beta) C]: the term's range is (2 - beta) C
            release(
                [self.s], "s", ClippedSum.replace_one([self._s_term], (2 - self.beta) * self.clip["s"]),
                noise_multiplier=self.noise["s"], reset=False, generator=self.generator,
            )
        # 4. the step on w = (x, lam), lam projected onto [lam0, inf)
        s = max(float(self.s), self.s_floor)
        x_grad_scale = lam / s
        lam_grad = x_grad_scale * float(self.u.value[0]) + math.log(s) + self.rho
        self.x.step(self.v.value, self.lr * x_grad_scale)
        self._lam_prev.copy_(self.lam)
        self.lam.fill_(max(self.lam0, lam - self.lr_lam * lam_grad))
        return {"refresh": float(refresh), "lam": float(self.lam), "s": float(self.s),
                "move": self.x.move, "nonfinite": dropped}

    def _buffers(self) -> dict[str, list[Tensor]]:
        return {**super()._buffers(), "v": self.v.value, "u": self.u.value, "s": [self.s],
                "lam": [self.lam, self._lam_prev]}


def _batch_sizes(given: Mapping[str, int] | Sequence[int]) -> Mapping[str, int] | tuple[int, ...]:
    """Per-stream batch sizes as the plan takes them: keyed by stream name, or in the paper's order."""
    return dict(given) if isinstance(given, Mapping) else tuple(given)
