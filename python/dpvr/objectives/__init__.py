"""Losses and saddle problems with the constants their privacy guarantees rest on."""

from .auc import AUCMargin, AUCModel, auc_score
from .minimax import MinimaxProblem
from .phased_problems import BilinearSaddle, LogisticRegression, QuadraticSaddle, RobustRegression

__all__ = [
    "AUCMargin",
    "AUCModel",
    "BilinearSaddle",
    "LogisticRegression",
    "MinimaxProblem",
    "QuadraticSaddle",
    "RobustRegression",
    "auc_score",
]
