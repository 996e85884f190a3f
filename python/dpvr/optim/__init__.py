"""The DP algorithms. Each owns its sampling, clipping, noise, state and accountant."""

from .base import BudgetExhaustedError, PrivateAlgorithm
from .diff2 import DIFF2
from .dpsgd import DPGD, DPSGD
from .minimax import DPSGDA, MinimaxAlgorithm, PrivateDiff
from .phased import CertificateError, PhasedOutputPerturbation, PhasedResult
from .prox import L1, ElasticNet, L2Ball
from .spider import DoubleSpider, RecursiveSpider

__all__ = [
    "DIFF2",
    "DPGD",
    "DPSGD",
    "DPSGDA",
    "L1",
    "BudgetExhaustedError",
    "CertificateError",
    "DoubleSpider",
    "ElasticNet",
    "L2Ball",
    "MinimaxAlgorithm",
    "PhasedOutputPerturbation",
    "PhasedResult",
    "PrivateAlgorithm",
    "PrivateDiff",
    "RecursiveSpider",
]
