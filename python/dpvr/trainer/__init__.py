"""The PyTorch front door: ``make_private(module, criterion, data, algorithm=..., epsilon=...)``."""

from .collate import pad_collate, recordwise
from .data import dataset_records
from .huggingface import PrivateHFTrainer, make_private_trainer
from .losses import TokenLoss, check_separable, per_sample
from .trainer import ALGORITHMS, PrivateTrainer, make_private
from .validation import Finding, fix, validate

__all__ = [
    "ALGORITHMS",
    "Finding",
    "PrivateHFTrainer",
    "PrivateTrainer",
    "TokenLoss",
    "check_separable",
    "dataset_records",
    "fix",
    "make_private",
    "make_private_trainer",
    "pad_collate",
    "per_sample",
    "recordwise",
    "validate",
]
