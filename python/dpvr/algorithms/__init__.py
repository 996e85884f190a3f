"""One home per algorithm: each is a package whose ``__init__`` registers its entry
(:class:`dpvr.registry.AlgorithmSpec`) with its settings schema (a frozen dataclass whose fields are the
settings, from which the entry's arguments are derived), the theorem-derived defaults it binds
(:attr:`AlgorithmSpec.rules`, the formulas in :mod:`dpvr.algorithms.theorems`) and what it supports under data
parallelism (:attr:`AlgorithmSpec.data_parallel`); its ``plan`` module holds its plan (what it releases, as
:mod:`dpvr.privacy` prices it), its ``algorithm`` module the class that runs it, and its ``audit`` module its
audit games. Machinery a family shares sits beside them (:mod:`~dpvr.algorithms.minimax`,
:mod:`~dpvr.algorithms.spider`, :mod:`~dpvr.algorithms.spider_plan`); what every algorithm is built from is
:mod:`dpvr.optim`.

Importing ``dpvr`` imports this package, so :data:`dpvr.registry.REGISTRY` lists the built-in algorithms in
the order below (the order the command line lists them). The entries and plans import no torch (so ``dpvr
account`` starts without it): an entry names its class by import path, and the classes exported here are
imported on first access (PEP 562). An algorithm defined outside dpvr is a module of the same shape, calling
:func:`dpvr.registry.register`.
"""

# ruff: noqa: I001
import importlib

# Each registers its algorithm when imported, in the command line's order (not sorted).
from . import dp_sgd  # noqa: F401
from . import dp_gd  # noqa: F401
from . import diff2  # noqa: F401
from . import dp_sgda  # noqa: F401
from . import private_diff  # noqa: F401
from . import double_spider  # noqa: F401
from . import recursive_spider  # noqa: F401
from . import phased  # noqa: F401
from . import last_iterate  # noqa: F401

# The plans: what each algorithm releases, priced by dpvr.privacy (torch-free).
from .dp_sgd.plan import DPSGDPlan
from .diff2.plan import DIFF2Plan
from .dp_sgda.plan import DPSGDAPlan
from .private_diff.plan import PrivateDiffPlan
from .double_spider.plan import DoubleSpiderPlan
from .recursive_spider.plan import RecursiveSpiderPlan
from .phased.plan import PhasedPlan
from .last_iterate.plan import CyclicDPSGDPlan
from .last_iterate.plan import epsilon_by_epoch

# Public class -> the module that defines it, imported on first access (the classes import torch).
_CLASSES = {
    "DPSGD": "dp_sgd.algorithm",
    "LastIterateDPSGD": "dp_sgd.algorithm",
    "DPGD": "dp_gd.algorithm",
    "DIFF2": "diff2.algorithm",
    "DIFF2BVRLSGD": "diff2.algorithm",
    "MinimaxAlgorithm": "minimax",
    "DPSGDA": "dp_sgda.algorithm",
    "PrivateDiff": "private_diff.algorithm",
    "PrivateDiffOutputY": "private_diff.algorithm",
    "DoubleSpider": "double_spider.algorithm",
    "RecursiveSpider": "recursive_spider.algorithm",
    "PhasedOutputPerturbation": "phased.algorithm",
    "PhasedResult": "phased.algorithm",
    "CertificateError": "phased.problem",
}


def __getattr__(name: str) -> object:
    if name in _CLASSES:
        value = getattr(importlib.import_module(f"{__name__}.{_CLASSES[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CyclicDPSGDPlan",
    "DIFF2Plan",
    "DPSGDAPlan",
    "DPSGDPlan",
    "DoubleSpiderPlan",
    "PhasedPlan",
    "PrivateDiffPlan",
    "RecursiveSpiderPlan",
    "epsilon_by_epoch",
    *_CLASSES,
]
