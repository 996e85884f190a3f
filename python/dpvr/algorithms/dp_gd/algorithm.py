"""DP-GD: DP-SGD on the full dataset every step (the algorithm of :mod:`dpvr.algorithms.dp_gd`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...optim.base import LossFn
from ...optim.records import Records
from ..dp_sgd.algorithm import DPSGD


class DPGD(DPSGD):
    """DP-GD: :class:`DPSGD` on the full dataset every step (no sampling; replace-one by default).

    Args:
        model: the ``nn.Module`` whose trainable parameters are trained.
        loss_fn: the per-record loss ``(output, target) -> scalar``.
        inputs: the private records' inputs, or :class:`~dpvr.optim.records.Records`.
        targets: the records' targets; omitted with ``Records``.
        **kwargs: :class:`DPSGD`'s keyword arguments (``lr``, ``clip``, ``steps``, ``noise``, ``optimizer``,
            ``privacy``, ``runtime``, ...); ``sampling`` may only be ``"full"`` and ``batch_size`` only
            ``None`` or the dataset size.

    Raises:
        ValueError: a sampled batch is asked for (use :class:`DPSGD`), or as :class:`DPSGD` (e.g.
            ``neighbouring="add-remove"``, under which the full-batch mean's divisor ``n`` is private).
        TypeError: as :class:`DPSGD`.

    Guarantee:
        As :class:`DPSGD` with ``sampling="full"``: the composition of ``steps`` Gaussian mechanisms with
        noise multiplier ``z`` under replace-one (default), behind the budget guard.
    """

    name = "DP-GD"

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        inputs: torch.Tensor | Records,
        targets: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        given = dict(kwargs)  # the binding records the settings given here (as given)
        if kwargs.pop("sampling", "full") != "full" or kwargs.pop("batch_size", None) not in (
            None,
            len(inputs),
        ):
            raise ValueError("DPGD uses the full batch; use DPSGD for sampled batches")
        super().__init__(model, loss_fn, inputs, targets, sampling="full", settings=given, **kwargs)
