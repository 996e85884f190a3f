"""DP-SGD: clipped per-sample gradients plus Gaussian noise, one sampled batch per step.

Privacy: ``(epsilon, delta)``-DP under the plan's neighbouring relation (:class:`dpvr.algorithms.DPSGDPlan`),
for every released iterate, given per-sample clipping and that the batches are drawn by the stated scheme.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...registry import AlgorithmSpec, Argument, all_reduced, register, schema_arguments, setting
from .. import _help
from .plan import DPSGDPlan

_SAMPLING = ("poisson", "wor", "full", "random-allocation")


@dataclass(frozen=True)
class DPSGDSettings:
    """The settings of a DP-SGD plan."""

    steps: int = setting(_help.STEPS)
    sampling: str = setting(_help.sampling(_SAMPLING), "poisson", choices=_SAMPLING)
    sample_rate: float | None = setting(
        "sampling rate q, 1/t for random allocation (or give --batch-size and --dataset-size)", None
    )
    batch_size: int | None = setting(
        "batch size b: fixed for wor, expected for poisson (rate b/n) and random-allocation", None
    )
    dataset_size: int | None = setting(
        "number of records n, public (with --batch-size; optional for poisson); under add-remove the size "
        "stated public (public_dataset_size)",
        None,
    )


SPEC = register(
    AlgorithmSpec(
        "dp-sgd",
        "DP-SGD with Poisson sampling, fixed-size batches without replacement, random allocation "
        "(balls-in-bins) or the full batch",
        DPSGDPlan,
        DPSGDPlan,
        schema_arguments(DPSGDSettings),
        "dpvr.algorithms.dp_sgd.algorithm:DPSGD",
        noise=Argument("noise_multiplier", float, _help.NOISE_MULTIPLIER),
        layout="sampled",
        audit_games=("dp-sgd",),
        audit_module="dpvr.algorithms.dp_sgd.audit",
        data_parallel=all_reduced,
    )
)
