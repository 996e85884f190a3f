"""Distributionally robust objectives: the penalised psi-divergence DRO problem, its dual, and KL-DRO in
compositional form.

Penalised problem over ``n`` records with per-sample losses ``l_i(x)`` and penalty ``lam > 0``::

    F(x) = max_{p in simplex} sum_i p_i l_i(x) - lam D_psi(p, 1/n)                    (minimax form)
         = min_eta (1/n) sum_i [lam psi*((l_i(x) - eta) / lam) + eta]                 (dual, per sample L)

The dual's per-sample gradients are ``grad_x L = (psi*)'(a) grad l`` and ``grad_eta L = 1 - (psi*)'(a)`` with
``a = (l - eta) / lam``: a re-weighting of the loss gradient and a scalar from the loss value alone.

KL-DRO with radius ``rho`` in compositional form::

    min_{x, lam >= lam0} Psi(x, lam) = lam log((1/n) sum_i exp(l_i(x) / lam)) + lam rho

with inner function ``g(w; z) = exp(l(x; z) / lam)``. With ``lam`` near ``lam0 = 1e-3`` that exponential
overflows any float, so dpvr evaluates it shifted by a public loss bound ``B`` on a loss capped at ``B``::

    g_B(w; z) = exp((min(l, B) - B) / lam) in (0, 1],    Psi = lam log mean_i g_B + B + lam rho

which is the same ``Psi`` (for losses below ``B``) with every inner value, and so every clipped quantity,
bounded by 1. ``grad_x Psi = sum_i softmax_i(l / lam) grad l_i``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .divergences import Divergence
from .minimax import MinimaxProblem

SampleLoss = Callable[[Tensor, Tensor], Tensor]


def cross_entropy(output: Tensor, target: Tensor) -> Tensor:
    """One sample's cross-entropy: ``output`` the logits ``(K,)``, ``target`` the class (a 0-d tensor)."""
    return F.cross_entropy(output, target.long())


# ---- the dual (3) --------------------------------------------------------------------------------------
def dual_argument(losses: Tensor, eta: Tensor | float, lam: float) -> Tensor:
    return (losses - eta) / lam


def dual_losses(div: Divergence, losses: Tensor, eta: Tensor | float, lam: float) -> Tensor:
    """Per-sample ``L(x, eta; z_i) = lam psi*((l_i - eta) / lam) + eta``."""
    return lam * div.conjugate(dual_argument(losses, eta, lam)) + eta


def dual_weights(div: Divergence, losses: Tensor, eta: Tensor | float, lam: float) -> Tensor:
    """Per-sample ``(psi*)'((l_i - eta) / lam)``: ``grad_x L(x, eta; z_i) = weight_i grad l_i``."""
    return div.conjugate_grad(dual_argument(losses, eta, lam))


def dual_eta_grads(div: Divergence, losses: Tensor, eta: Tensor | float, lam: float) -> Tensor:
    """Per-sample ``grad_eta L(x, eta; z_i) = 1 - (psi*)'((l_i - eta) / lam)``."""
    return 1 - dual_weights(div, losses, eta, lam)


class WithEta(nn.Module):
    """``model`` with the dual variable ``eta`` as an extra trainable output coordinate, so the dual can be
    trained by any per-sample-gradient optimiser (DP-SGD on ``(x, eta)``)."""

    def __init__(self, model: nn.Module, eta: float = 0.0) -> None:
        super().__init__()
        self.model = model
        self.eta = nn.Parameter(torch.tensor([float(eta)]))

    def forward(self, inputs: Tensor) -> Tensor:
        outputs = self.model(inputs)
        return torch.cat([outputs, self.eta.to(outputs.dtype).expand(outputs.shape[0], 1)], dim=1)


def dual_loss(div: Divergence, lam: float, base: SampleLoss = cross_entropy) -> SampleLoss:
    """One sample's dual loss for a :class:`WithEta` model: ``lam psi*((l - eta)/lam) + eta``."""

    def loss(output: Tensor, target: Tensor) -> Tensor:
        eta = output[-1]
        return dual_losses(div, base(output[:-1], target), eta, lam)

    return loss


# ---- the penalised minimax form (2) --------------------------------------------------------------------
class PenalisedDRO(MinimaxProblem):
    """``max_{p in simplex} sum_i p_i l_i - lam D_psi(p, 1/n)`` as a :class:`MinimaxProblem` with ``y = p``.

    One sample's term is ``f(x, p; z_i) = n p_i l_i(x) - lam psi(n p_i)``, so it needs the sample's index:
    targets are ``(label, index)`` rows (:func:`indexed_targets`). ``psi`` is evaluated at
    ``max(n p_i, floor)`` so that KL's ``log`` stays finite on the simplex's faces. ``grad_y f`` of a sample
    lives in its own coordinate, so per-sample clipping bounds the sensitivity as for any other ``y``.
    """

    def __init__(
        self,
        div: Divergence,
        lam: float,
        n: int,
        *,
        base: SampleLoss = cross_entropy,
        loss_bound: float = 10.0,
        floor: float = 1e-6,
    ) -> None:
        if not lam > 0:
            raise ValueError(f"lam: must be > 0, got {lam}")
        self.div, self.lam, self.n, self.base, self.floor = div, float(lam), int(n), base, float(floor)
        self.y_dim = self.n
        self.diameter = math.sqrt(2.0)
        # psi'' >= 1 on the simplex for chi^2 and (t <= n) >= 1/n for KL: f is at least lam-strongly concave.
        self.strong_concavity = self.lam
        self.y_lipschitz = self.n * (loss_bound + self.lam * abs(math.log(floor)) + self.lam * self.n)

    def loss(self, output: Tensor, target: Tensor, y: Tensor) -> Tensor:
        label, index = target[0], target[1].long().reshape(1)
        p_i = y.index_select(0, index)[0]  # vmap-friendly y[index]
        penalty = self.div.psi((self.n * p_i).clamp_min(self.floor))
        return self.n * p_i * self.base(output, label) - self.lam * penalty

    def project(self, y: Tensor) -> Tensor:
        return project_simplex(y)

    def initial_y(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return torch.full((self.n,), 1.0 / self.n, dtype=dtype)


def indexed_targets(labels: Tensor) -> Tensor:
    """``(label, index)`` rows for :class:`PenalisedDRO`."""
    return torch.stack([labels.long(), torch.arange(len(labels))], dim=1)


def project_simplex(y: Tensor) -> Tensor:
    """Euclidean projection onto the probability simplex (sort-based, Held et al. / Duchi et al.)."""
    u, _ = torch.sort(y, descending=True)
    cumulative = u.cumsum(0) - 1
    k = torch.arange(1, len(y) + 1, dtype=y.dtype)
    rho = int((u - cumulative / k > 0).nonzero().max())
    return (y - cumulative[rho] / (rho + 1)).clamp_min(0)


# ---- KL-DRO, compositional form (5) --------------------------------------------------------------------
def kl_compositional(losses: Tensor, lam: Tensor | float, rho: float) -> Tensor:
    """``Psi = lam log((1/n) sum_i exp(l_i / lam)) + lam rho``, evaluated stably (log-sum-exp)."""
    n = losses.shape[0]
    return lam * (torch.logsumexp(losses / lam, dim=0) - math.log(n)) + lam * rho


def inner_values(losses: Tensor, lam: float, bound: float) -> Tensor:
    """Shifted inner function ``g_B = exp((min(l, B) - B) / lam)`` per sample, in ``(0, 1]``."""
    return torch.exp((losses.clamp_max(bound) - bound) / lam)


def inner_x_weights(losses: Tensor, lam: float, bound: float) -> Tensor:
    """Per-sample ``a_i`` with ``grad_x g_B(w; z_i) = a_i grad l_i``: ``g_B / lam`` below the cap, 0 above."""
    return torch.where(losses < bound, inner_values(losses, lam, bound) / lam, torch.zeros_like(losses))


def inner_lambda_grads(losses: Tensor, lam: float, bound: float) -> Tensor:
    """Per-sample ``d g_B / d lam = -g_B (min(l, B) - B) / lam^2`` (non-negative)."""
    return -inner_values(losses, lam, bound) * (losses.clamp_max(bound) - bound) / lam**2


def compositional_gradient(
    inner: float, x_grad: Tensor | float, lam_grad: float, lam: float, rho: float
) -> tuple[Tensor | float, float]:
    """``(grad_x Psi, grad_lam Psi)`` from estimates of ``g_B``, ``grad_x g_B`` and ``grad_lam g_B``:
    ``((lam / s) v, (lam / s) u + log s + rho)`` (the shift ``B`` does not depend on ``lam``)."""
    scale = lam / inner
    return x_grad * scale, lam_grad * scale + math.log(inner) + rho
