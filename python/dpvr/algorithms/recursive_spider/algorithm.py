"""DP Recursive-SPIDER (KL-DRO in its compositional form): the algorithm of the home
:mod:`dpvr.algorithms.recursive_spider`, built on the SPIDER machinery of :mod:`dpvr.algorithms.spider`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from ...optim.config import PrivacyConfig, RuntimeConfig
from ...optim.estimator import ClippedSum, DifferenceEstimator, release
from ...optim.records import Records
from ...problems import LossFn, inner_lambda_grads, inner_values, inner_x_weights
from ..spider import SpiderAlgorithm, require_positive
from . import STREAMS
from .plan import RecursiveSpiderPlan


class RecursiveSpider(SpiderAlgorithm):
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
        composed in one accountant as the plan :class:`dpvr.algorithms.RecursiveSpiderPlan` describes,
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
    plan_type = RecursiveSpiderPlan
    required_settings = (
        "rho", "lam0", "steps", "restart", "batch_sizes", "lr", "lr_lam", "beta", "loss_bound", "clip",
    )  # fmt: skip
    clip_streams = STREAMS

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
        require_positive(lam0=lam0, lr=lr, lr_lam=lr_lam, s_floor=s_floor)
        if not 0 < beta <= 1:
            raise ValueError(f"beta: must be in (0, 1], got {beta}")
        if not lam_init >= lam0:
            raise ValueError(f"lam_init: must be >= lam0 = {lam0}, got {lam_init}")
        super().__init__(
            model, loss_fn, inputs, targets, steps=steps, restart=restart, batch_sizes=batch_sizes,
            sampling=sampling, clip=clip, noise=noise, privacy=privacy, runtime=runtime, settings=settings,
        )  # fmt: skip
        self.rho, self.lam0, self.s_floor = float(rho), float(lam0), float(s_floor)
        self.lr, self.lr_lam, self.beta, self.bound = float(lr), float(lr_lam), float(beta), float(loss_bound)
        self.v_radius = self._difference_radius("v-refresh", "v-difference")
        self.u_radius = self._difference_radius("u-refresh", "u-difference")
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
