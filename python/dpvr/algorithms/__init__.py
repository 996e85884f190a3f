"""One home per algorithm: each module holds its algorithm's registry entry
(:class:`dpvr.registry.AlgorithmSpec`, registered from that module), its settings schema (a frozen dataclass
whose fields are the settings, from which the entry's arguments are derived), the theorem-derived defaults it
binds (:attr:`AlgorithmSpec.rules`, the formulas in :mod:`dpvr.algorithms.theorems`), what it supports under
data parallelism (:attr:`AlgorithmSpec.data_parallel`) and its audit games.

Importing ``dpvr`` imports this package, so :data:`dpvr.registry.REGISTRY` lists the built-in algorithms in
the order below (the order the command line lists them). An algorithm defined outside dpvr is one module of
the same shape, calling :func:`dpvr.registry.register`.

The classes that run the algorithms stay in :mod:`dpvr.optim` for now, named by import path
(``"dpvr.optim:DIFF2"``) and imported on demand: this package imports no torch, so ``dpvr account`` starts
without it.
"""

# Each registers its algorithm when imported, in the command line's order (not sorted).
from . import (  # noqa: I001, F401
    dp_sgd,
    dp_gd,
    diff2,
    dp_sgda,
    private_diff,
    double_spider,
    recursive_spider,
    phased,
    last_iterate,
)
