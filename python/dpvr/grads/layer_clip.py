"""Per-layer clip radii: each record's gradient on a group of parameters clipped to that group's radius.

A :class:`LayerRadii` is what the clipped sums take in place of one radius (``clip=``): the groups partition
the model's trainable parameters (indices in ``model.parameters()`` order, trainable ones only) and group
``l`` is clipped to ``C_l`` on its own. Each record's clipped vector then has norm at most
``sqrt(sum_l C_l^2)`` (:attr:`LayerRadii.total`), the radius the release prices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torch import nn

from .materialized import trainable_parameters


@dataclass(frozen=True)
class LayerRadii:
    """Groups of trainable parameters (``groups[l]``: indices among the trainable parameters) and their radii.

    Guarantee (of the sums that take it): record i's contribution to group l's parameters has L2 norm at most
    ``radii[l]`` (each group clipped by the kernels' rule, which holds after rounding), so its whole
    contribution has norm at most ``sqrt(sum_l radii[l]^2)``; :attr:`total` is never below that exact value
    (see there).
    """

    groups: tuple[tuple[int, ...], ...]
    radii: tuple[float, ...]
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        if not (len(self.groups) == len(self.radii) == len(self.names)) or not self.groups:
            raise ValueError("LayerRadii: one radius and one name per group, at least one group")
        for name, radius in zip(self.names, self.radii):
            if not (isinstance(radius, float) and math.isfinite(radius) and radius > 0):
                raise ValueError(f"clip[{name!r}]: a radius must be a finite number > 0, got {radius!r}")
        seen = [k for g in self.groups for k in g]
        if len(seen) != len(set(seen)) or any(not g for g in self.groups):
            raise ValueError("LayerRadii: the groups must be non-empty and disjoint")

    @property
    def total(self) -> float:
        """``sqrt(sum_l C_l^2)``: the bound on one record's whole clipped contribution (its add/remove
        sensitivity; replace-one is twice it, which the accountant applies), rounded up: the float64 squares,
        their correctly rounded sum and the square root each err by at most 2^-53 relative, so the result
        times ``1 + 2^-50`` is at least the exact value (the release's noise is priced on it: a hair more
        noise, never less)."""
        return math.sqrt(math.fsum(r * r for r in self.radii)) * (1.0 + 2.0**-50)

    def check_covers(self, count: int) -> None:
        """Raises ``ValueError`` unless the groups cover exactly the ``count`` trainable parameters."""
        if sorted(k for g in self.groups for k in g) != list(range(count)):
            raise ValueError(f"clip: the per-layer groups do not cover the model's {count} trainable "
                             "parameters exactly once")


def layer_radii(model: nn.Module, clip: float | Sequence[float] | Mapping[str, float]) -> LayerRadii:
    """The :class:`LayerRadii` of ``clip`` for ``model``'s trainable parameters (``model.named_parameters()``
    order, those with ``requires_grad``):

    - a number ``C``: one group per parameter tensor, each with ``C / sqrt(k)`` for ``k`` tensors, so the
      total radius is ``C`` (the same privacy as flat clipping at ``C``);
    - a list of ``k`` numbers: one per trainable parameter tensor, in that order;
    - a dict ``{name: C}``: ``name`` a parameter's name (``"fc1.weight"``) or a module's (``"fc1"``: all of
      its trainable parameters, ``""`` the whole model); each parameter goes to the longest name that covers
      it, and every parameter must be covered.

    Raises:
        ValueError: a radius that is not a finite number > 0; a list whose length is not the number of
            trainable parameter tensors; a name that matches no trainable parameter; a parameter no name
            covers.
        TypeError: ``clip`` of another type.
    """
    named = [name for name, _ in trainable_parameters(model)]
    if isinstance(clip, Mapping):
        keys = [str(k) for k in clip]
        groups: dict[str, list[int]] = {k: [] for k in keys}
        for index, name in enumerate(named):
            covering = [k for k in keys if k == "" or name == k or name.startswith(k + ".")]
            if not covering:
                raise ValueError(f"clip: no radius for the trainable parameter {name!r}; name it, or a "
                                 f"module holding it, among {keys}")
            groups[max(covering, key=len)].append(index)
        empty = [k for k, g in groups.items() if not g]
        if empty:
            raise ValueError(f"clip: {empty} name(s) no trainable parameter of the model (trainable: "
                             f"{named})")
        return LayerRadii(tuple(tuple(g) for g in groups.values()),
                          tuple(_radius(clip[k], k) for k in clip), tuple(keys))
    if isinstance(clip, (list, tuple)):
        if len(clip) != len(named):
            raise ValueError(f"clip: per-layer clipping takes one radius per trainable parameter tensor; the "
                             f"model has {len(named)} ({named}), got {len(clip)} radii")
        return LayerRadii(tuple((k,) for k in range(len(named))),
                          tuple(_radius(c, n) for c, n in zip(clip, named)), tuple(named))
    radius = _radius(clip, "clip")
    share = radius / math.sqrt(len(named))
    return LayerRadii(tuple((k,) for k in range(len(named))), (share,) * len(named), tuple(named))


def _radius(value: object, name: str) -> float:
    if isinstance(value, (bool, str)) or not hasattr(value, "__float__"):
        raise TypeError(f"clip[{name!r}]: a radius is a number > 0, got {type(value).__name__} {value!r}")
    radius = float(value)  # type: ignore[arg-type]
    if not (math.isfinite(radius) and radius > 0):
        raise ValueError(f"clip[{name!r}]: a radius must be a finite number > 0, got {value!r}")
    return radius
