"""The DP algorithms. Each owns its sampling, clipping, noise, state and accountant."""

from .base import BudgetExhaustedError, PrivateAlgorithm
from .diff2 import DIFF2
from .dpsgd import DPGD, DPSGD
from .prox import L1, ElasticNet, L2Ball

__all__ = ["DIFF2", "DPGD", "DPSGD", "L1", "BudgetExhaustedError", "ElasticNet", "L2Ball", "PrivateAlgorithm"]
