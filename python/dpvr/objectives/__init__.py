"""Losses and saddle problems with the constants their privacy guarantees rest on."""

from .auc import AUCMargin, AUCModel, auc_score
from .minimax import MinimaxProblem
from .phased_problems import BilinearSaddle, LogisticRegression, QuadraticSaddle, RobustRegression
from .td import MSPBE, TransitionValues, ValueModel, semi_gradient_td_loss
from .wgan import WGAN, WGANModel

__all__ = [
    "AUCMargin",
    "AUCModel",
    "BilinearSaddle",
    "LogisticRegression",
    "MSPBE",
    "MinimaxProblem",
    "QuadraticSaddle",
    "RobustRegression",
    "TransitionValues",
    "ValueModel",
    "WGAN",
    "WGANModel",
    "auc_score",
    "semi_gradient_td_loss",
]
