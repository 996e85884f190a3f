"""The DP algorithms. Each owns its sampling, clipping, noise, state and accountant."""

from .base import BudgetExhaustedError, PrivateAlgorithm
from .config import PrivacyConfig, RuntimeConfig
from .diff2 import DIFF2
from .dpsgd import DPGD, DPSGD, LastIterateDPSGD
from .estimator import ClippedSum, DifferenceEstimator, DivergedError, Iterate, Radius
from .gradients import check_loss
from .minimax import DPSGDA, MinimaxAlgorithm, PrivateDiff
from .phased import CertificateError, PhasedOutputPerturbation, PhasedResult
from .prox import L1, ElasticNet, L2Ball
from .records import DatasetRecords, Records, TensorRecords
from .spider import DoubleSpider, RecursiveSpider

__all__ = [
    "DIFF2",
    "DPGD",
    "DPSGD",
    "DPSGDA",
    "LastIterateDPSGD",
    "L1",
    "BudgetExhaustedError",
    "CertificateError",
    "ClippedSum",
    "DatasetRecords",
    "DifferenceEstimator",
    "DivergedError",
    "DoubleSpider",
    "ElasticNet",
    "Iterate",
    "L2Ball",
    "MinimaxAlgorithm",
    "PhasedOutputPerturbation",
    "PhasedResult",
    "PrivacyConfig",
    "PrivateAlgorithm",
    "PrivateDiff",
    "Radius",
    "Records",
    "RecursiveSpider",
    "RuntimeConfig",
    "TensorRecords",
    "check_loss",
]
