"""Losses and saddle problems with the constants their privacy guarantees rest on."""

from .auc import AUCMargin, AUCModel, auc_score
from .divergences import KL, ChiSquare, CressieRead, Divergence, KLRegularisedCVaR, divergence
from .dro import (
    PenalisedDRO,
    WithEta,
    dual_eta_grads,
    dual_loss,
    dual_losses,
    dual_weights,
    indexed_targets,
    kl_compositional,
    project_simplex,
)
from .minimax import MinimaxProblem
from .phased_problems import BilinearSaddle, LogisticRegression, QuadraticSaddle, RobustRegression
from .td import MSPBE, TransitionValues, ValueModel, semi_gradient_td_loss
from .wgan import WGAN, WGANModel

__all__ = [
    "AUCMargin",
    "AUCModel",
    "BilinearSaddle",
    "ChiSquare",
    "CressieRead",
    "Divergence",
    "KL",
    "KLRegularisedCVaR",
    "LogisticRegression",
    "MSPBE",
    "MinimaxProblem",
    "PenalisedDRO",
    "QuadraticSaddle",
    "RobustRegression",
    "TransitionValues",
    "ValueModel",
    "WGAN",
    "WGANModel",
    "WithEta",
    "auc_score",
    "divergence",
    "dual_eta_grads",
    "dual_loss",
    "dual_losses",
    "dual_weights",
    "indexed_targets",
    "kl_compositional",
    "project_simplex",
    "semi_gradient_td_loss",
]
