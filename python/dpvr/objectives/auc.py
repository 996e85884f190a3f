"""The square-margin AUC objective (AUC-M; Yuan et al. 2021; PrivateDiff paper eq. 63-64) and the AUC metric.

``x = (w, a, b)``: the scoring network's weights and the two scalars that track the mean score of each class;
``y = alpha``, projected onto ``[0, Lambda]``. The score is ``h = sigmoid(net(x))``, so ``h`` lies in (0, 1).
With ``p`` the positive ratio and ``m`` the margin, per sample (labels coded 1 positive, 0 negative):

- ``"v1"`` (LibAUC's default form, eq. 64): ``(1-p)(h-a)^2 [y=1] + p(h-b)^2 [y=0]
  + 2 alpha (p(1-p) m + p h [y=0] - (1-p) h [y=1]) - p(1-p) alpha^2``; strongly concave in alpha with
  modulus ``mu = 2 p (1-p)``;
- ``"v2"`` (class-prior-free): ``E_+[(h-a)^2] + E_-[(h-b)^2] + 2 alpha (m + E_-[h] - E_+[h]) - alpha^2``,
  written per sample with weights ``1/p`` on positives and ``1/(1-p)`` on negatives so that its mean over a
  dataset with positive ratio ``p`` is exactly that objective; ``mu = 2``.

**Sensitivity of the inner maximiser** (:meth:`AUCMargin.y_sensitivity`). Both forms are ``f = q(h,
label) + 2 alpha (c + s(h, label)) - (mu/2) alpha^2`` with ``q`` free of ``alpha``, ``c`` the margin term
(the same for every record) and ``s = p h [y=0] - (1-p) h [y=1]`` (``"v1"``) or ``s = h [y=0] / (1-p) -
h [y=1] / p`` (``"v2"``). With ``h`` in ``[0, 1]``, ``s`` ranges over an interval of width ``1`` (``"v1"``:
``[-(1-p), p]``) or ``1 / (p (1-p))`` (``"v2"``), so two records' ``alpha``-gradients differ by at most twice
that width at every ``alpha``; each record is ``mu``-strongly concave on its own and the mean's curvature is
exactly ``mu`` (its smoothness). The exact maximiser ``Proj_[0, Lambda]((c + mean(s)) / (mu / 2))`` thus
moves by at most ``1 / (n p (1-p))`` when one record is replaced, for both forms: swapping a positive of
score 1 for a negative of score 1 attains it (tight). A non-finite score is read as ``h = 1/2``
(:meth:`AUCMargin.bounded_outputs`), an admissible value.

``p`` is a constructor argument and must be public (e.g. fixed by the data-collection protocol): reading it
off the private training labels would release a statistic of them that no accountant covers.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import rankdata
from torch import Tensor, nn

from ..problems import MinimaxProblem
from ..problems.minimax import YSensitivity

VERSIONS = ("v1", "v2")


class _Scalars(nn.Module):
    """The scalars ``a`` and ``b`` broadcast over the batch: a module of their own, so that per-sample
    gradient code differentiates only this small module for them (not the whole network)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(1))
        self.b = nn.Parameter(torch.zeros(1))

    def forward(self, inputs: Tensor) -> Tensor:
        return torch.cat([self.a, self.b]).expand(inputs.shape[0], 2)


class AUCModel(nn.Module):
    """``net`` (one output per sample) with the AUC-M scalars ``a``, ``b``: the min block ``x = (w, a, b)``.

    The output, per sample, is ``(h, a, b)`` with ``h = sigmoid(net(input))``; :attr:`a` and :attr:`b` are
    ordinary parameters, so every per-sample gradient path (ghost or materialised) covers them.
    """

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.scalars = _Scalars()

    @property
    def a(self) -> nn.Parameter:
        return self.scalars.a

    @property
    def b(self) -> nn.Parameter:
        return self.scalars.b

    def scores(self, inputs: Tensor) -> Tensor:
        """``(B,)`` scores ``h`` in (0, 1)."""
        return torch.sigmoid(self.net(inputs)).reshape(inputs.shape[0])

    def forward(self, inputs: Tensor) -> Tensor:
        return torch.cat([self.scores(inputs)[:, None], self.scalars(inputs)], dim=1)


class AUCMargin(MinimaxProblem):
    """The AUC-M objective on :class:`AUCModel` outputs (see the module documentation).

    Args:
        positive_ratio: the public positive ratio ``p`` of the training data, in (0, 1).
        margin: ``m`` (LibAUC's default 1).
        alpha_max: ``Lambda``: ``alpha`` is projected onto ``[0, Lambda]``. At the maximiser
            ``alpha* = m + E_-[h] - E_+[h] <= m + 1`` for both forms (``h`` in (0, 1)), so the default
            ``Lambda = m + 1`` never cuts the solution off.
        version: ``"v1"`` or ``"v2"``.
    """

    y_dim = 1

    def __init__(
        self,
        positive_ratio: float,
        *,
        margin: float = 1.0,
        alpha_max: float | None = None,
        version: str = "v1",
    ) -> None:
        if not 0 < positive_ratio < 1:
            raise ValueError(f"positive_ratio: must lie in (0, 1), got {positive_ratio}")
        if version not in VERSIONS:
            raise ValueError(f"version: must be one of {VERSIONS}, got {version!r}")
        if not margin >= 0:
            raise ValueError(f"margin: must be >= 0, got {margin}")
        alpha_max = margin + 1.0 if alpha_max is None else alpha_max
        if not alpha_max > 0:
            raise ValueError(f"alpha_max: must be > 0, got {alpha_max}")
        self.p, self.margin, self.version = float(positive_ratio), float(margin), version
        self.diameter = float(alpha_max)
        p = self.p
        self.strong_concavity = 2 * p * (1 - p) if version == "v1" else 2.0
        # |d f / d alpha| <= 2 |linear term| + mu Lambda, with h in [0, 1].
        if version == "v1":
            linear = p * (1 - p) * self.margin + max(p, 1 - p)
        else:
            linear = self.margin + max(1 / p, 1 / (1 - p))
        self.y_lipschitz = 2 * linear + self.strong_concavity * self.diameter

    def loss(self, output: Tensor, target: Tensor, y: Tensor) -> Tensor:
        h, a, b = output[0], output[1], output[2]
        alpha = y[0]
        pos = (target == 1).to(h.dtype)
        neg = 1 - pos
        p = self.p
        if self.version == "v1":
            return (
                (1 - p) * (h - a) ** 2 * pos
                + p * (h - b) ** 2 * neg
                + 2 * alpha * (p * (1 - p) * self.margin + p * h * neg - (1 - p) * h * pos)
                - p * (1 - p) * alpha**2
            )
        wp, wn = pos / p, neg / (1 - p)
        return wp * (h - a) ** 2 + wn * (h - b) ** 2 + 2 * alpha * (self.margin + wn * h - wp * h) - alpha**2

    def project(self, y: Tensor) -> Tensor:
        return y.clamp(0.0, self.diameter)

    def y_sensitivity(self) -> YSensitivity:
        """Twice the width of ``s``'s range over ``h`` in ``[0, 1]``, ``mu`` and ``mu`` (module docs)."""
        p = self.p
        width = 1.0 if self.version == "v1" else 1.0 / (p * (1 - p))
        mu = self.strong_concavity
        return YSensitivity(gradient_range=2 * width, strong_concavity=mu, smoothness=mu)

    def bounded_outputs(self, outputs: Tensor) -> Tensor:
        """Scores clamped to ``[0, 1]`` with a non-finite score read as ``1/2``; ``a`` and ``b``, which do not
        enter ``grad_y f``, with non-finite values read as 0."""
        h = torch.nan_to_num(outputs[:, :1], nan=0.5, posinf=1.0, neginf=0.0).clamp(0.0, 1.0)
        return torch.cat([h, torch.nan_to_num(outputs[:, 1:], nan=0.0, posinf=0.0, neginf=0.0)], dim=1)


def auc_score(scores: np.ndarray | Tensor, labels: np.ndarray | Tensor) -> float:
    """Area under the ROC curve: the probability that a random positive (label 1) scores above a random
    negative, ties counting one half (the Mann-Whitney statistic from average ranks)."""
    s = np.asarray(scores.detach().cpu() if isinstance(scores, Tensor) else scores, dtype=np.float64)
    y = np.asarray(labels.detach().cpu() if isinstance(labels, Tensor) else labels).reshape(-1) == 1
    s = s.reshape(-1)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"AUC needs both classes, got {n_pos} positive and {n_neg} negative labels")
    ranks = rankdata(s)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))
