"""DP Double-SPIDER (psi-divergence DRO in its dual form): the algorithm of the home
:mod:`dpvr.algorithms.double_spider`, built on the SPIDER machinery of :mod:`dpvr.algorithms.spider`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ...optim.config import PrivacyConfig, RuntimeConfig
from ...optim.estimator import DifferenceEstimator, global_norm
from ...optim.records import Records
from ...problems import Divergence, LossFn, dual_eta_grads, dual_weights
from ..spider import SpiderAlgorithm, require_positive
from . import STREAMS
from .plan import DoubleSpiderPlan


class DoubleSpider(SpiderAlgorithm):
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
        streams are composed in one accountant as the plan :class:`dpvr.algorithms.DoubleSpiderPlan`
        describes, behind the budget guard. Assumptions: batches drawn as stated (seeded from the operating
        system unless ``runtime.sampler_seed``), ``x0`` and ``eta0`` independent of the data, a loss that is
        a function of one record.

    Departures from the printed algorithm: per-sample clipping (the printed one clips the batch mean, which
    has no per-record sensitivity bound); one accountant for all four streams (the paper calibrates each to
    the full budget); output is the last iterate (the paper's uniformly random iterate is not kept); ``G``-
    rescaling of eta is not used (``G = 1``).
    """

    name = "Double-SPIDER"
    plan_type = DoubleSpiderPlan
    required_settings = (
        "divergence", "lam", "steps", "restart", "batch_sizes", "lr", "lr_eta", "max_move", "clip",
    )  # fmt: skip
    clip_streams = STREAMS
    clip_pairs = ("eta-difference", "x-difference")  # (k_eta, k_x): a radius per unit of each one's move

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
        require_positive(lam=lam, lr=lr, lr_eta=lr_eta, max_move=max_move)
        super().__init__(
            model, loss_fn, inputs, targets, steps=steps, restart=restart, batch_sizes=batch_sizes,
            sampling=sampling, clip=clip, noise=noise, privacy=privacy, runtime=runtime, settings=settings,
        )  # fmt: skip
        self.divergence, self.lam = divergence, float(lam)
        self.lr, self.lr_eta, self.max_move = float(lr), float(lr_eta), float(max_move)
        self.eta_radius = self._difference_radius("eta-refresh", "eta-difference")
        self.x_radius = self._difference_radius("x-refresh", "x-difference")
        dtype = self.params[0].dtype
        self.eta = torch.tensor([float(eta0)], dtype=dtype)  # eta_t
        self._eta_prev = self.eta.clone()  # eta_{t-1}
        self.g = DifferenceEstimator([self.eta])  # estimates grad_eta L
        self.v = DifferenceEstimator(self.flat)  # estimates grad_x L
        self._g_sum = torch.zeros(1, dtype=torch.float64)  # a sum over records: float64 until the noise

    def _checked_clip(self, clip: Mapping[str, float | tuple[float, float]]) -> dict[str, Any]:
        checked = super()._checked_clip(clip)
        for stream in self.clip_pairs:
            # A zero coefficient would leave a moving point's difference unclipped.
            if not min(checked[stream]) > 0:
                raise ValueError(f"clip[{stream!r}]: both coefficients must be > 0, got {checked[stream]}")
        return checked

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
