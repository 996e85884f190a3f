"""What every DP algorithm is built from: the protocol (:class:`PrivateAlgorithm`, its budget guard, run
ledger and binding), its configs, the records and their samplers, clipped per-sample gradients and the
difference estimator. The algorithms themselves live in :mod:`dpvr.algorithms`, one home each."""

from .base import BudgetExhaustedError, PrivateAlgorithm
from .config import PrivacyConfig, RuntimeConfig
from .estimator import ClippedSum, DifferenceEstimator, DivergedError, Iterate, Radius
from .gradients import check_loss
from .prox import L1, ElasticNet, L2Ball
from .records import DatasetRecords, Records, TensorRecords

__all__ = [
    "L1",
    "BudgetExhaustedError",
    "ClippedSum",
    "DatasetRecords",
    "DifferenceEstimator",
    "DivergedError",
    "ElasticNet",
    "Iterate",
    "L2Ball",
    "PrivacyConfig",
    "PrivateAlgorithm",
    "Radius",
    "Records",
    "RuntimeConfig",
    "TensorRecords",
    "check_loss",
]
