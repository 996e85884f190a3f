"""The DP algorithms. Each owns its sampling, clipping, noise, state and accountant."""

from .base import BudgetExhaustedError, PrivateAlgorithm
from .diff2 import DIFF2
from .dpsgd import DPGD, DPSGD
from .phased import CertificateError, PhasedOutputPerturbation, PhasedResult
from .prox import L1, ElasticNet, L2Ball

__all__ = [
    "DIFF2",
    "DPGD",
    "DPSGD",
    "L1",
    "BudgetExhaustedError",
    "CertificateError",
    "ElasticNet",
    "L2Ball",
    "PhasedOutputPerturbation",
    "PhasedResult",
    "PrivateAlgorithm",
]
