"""Losses and saddle problems with the constants their privacy guarantees rest on."""

from .phased_problems import BilinearSaddle, LogisticRegression, QuadraticSaddle, RobustRegression

__all__ = ["BilinearSaddle", "LogisticRegression", "QuadraticSaddle", "RobustRegression"]
