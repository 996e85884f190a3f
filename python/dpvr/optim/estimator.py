"""The gradient-difference (SPIDER-style) estimator that DIFF2, PrivateDiff and both DRO SPIDERs are made of.

One estimator ``v`` of a gradient is kept across steps. A *reset* release sets it to a noisy clipped mean of
per-sample gradients at the current point; a *difference* release adds a noisy clipped mean of same-sample
gradient differences between the current point and the previous one. A difference is clipped at a radius
proportional to how far the iterates moved, and its noise std is proportional to that radius, so every
release has a fixed noise multiplier whatever the step: that is what lets the accountant price each release
as one Gaussian mechanism.

Why the radius is private: it is a function of released iterates (and public constants) only. The iterates
are post-processing of earlier releases, so the radius, and with it the clip bound and the noise std, are
known before the release and do not depend on the record that differs between neighbours.

- :class:`Iterate` holds the point being optimised and the previous one, and how far it moved;
- :class:`Radius` is a stream's clip rule: a constant on reset releases, ``max_j k_j * move_j + offset`` on
  difference releases;
- :class:`DifferenceEstimator` holds ``v`` and makes its releases with the fused native update (noise, sum,
  and optionally the step ``x <- x - lr v``, in one pass).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .. import ops


class DivergedError(RuntimeError):
    """The iterates left every finite region, so no finite clip radius exists for the next release."""


class Iterate:
    """The point ``x_t`` (the live tensors ``params``, updated in place), the previous point ``x_{t-1}``,
    and ``move = ||x_t - x_{t-1}||``, a function of released iterates.

    A step is the algorithm's own SGD step ``x <- x - lr d``, or, given ``optimizer`` (any
    ``torch.optim.Optimizer`` over ``params``), that optimizer's step with ``d`` written into each ``p.grad``
    (momentum, Adam, weight decay: post-processing of the released ``d``, so privacy is unchanged); the move
    is then measured on the parameters after the optimizer's step. ``keep_previous=False`` (an algorithm that
    never forms a difference) keeps no copy of ``x_{t-1}``, and the move of an optimizer's step is then
    ``nan`` (unmeasured)."""

    def __init__(
        self,
        params: Sequence[Tensor],
        optimizer: torch.optim.Optimizer | None = None,
        *,
        keep_previous: bool = True,
    ) -> None:
        self.params = list(params)
        self.optimizer = optimizer
        self.frozen: list[Tensor] = []
        if optimizer is not None:
            given = [p for group in optimizer.param_groups for p in group["params"]]
            trainable = {id(p) for p in self.params}
            missing = len(trainable - {id(p) for p in given})
            if missing:
                raise ValueError(f"optimizer: holds {len(trainable) - missing} of the model's "
                                 f"{len(trainable)} trainable parameters; give it all of them")
            # Frozen parameters may ride along (the usual freeze-some-layers pattern); they get no gradient.
            self.frozen = [p for p in given if id(p) not in trainable]
            if any(p.requires_grad for p in self.frozen):
                raise ValueError("optimizer: holds a trainable parameter that is not the model's")
        self.flat = [p.detach().view(-1) for p in self.params]
        self.previous = [p.detach().clone() for p in self.params] if keep_previous else None
        self.previous_flat = [t.view(-1) for t in self.previous] if keep_previous else None
        self.move = 0.0

    def point(self) -> list[Tensor]:
        return [p.detach() for p in self.params]

    def step(self, direction: Sequence[Tensor], lr: float | None) -> float:
        """``x_{t-1} <- x_t``, then ``x_{t+1} = x_t - lr * direction``, or the optimizer's step on the
        gradient ``direction`` (``lr`` unused); returns (and keeps) the move."""
        with torch.no_grad():
            for prev, p in zip(self.previous or (), self.params):
                prev.copy_(p)
            if self.optimizer is None:
                for p, d in zip(self.params, direction):
                    p.sub_(d.view_as(p), alpha=lr)
                self.move = abs(lr) * global_norm(direction)
            else:
                for p, d in zip(self.params, direction):
                    _set_grad(p, d.view_as(p))
                for p in self.frozen:  # whatever gradient a frozen parameter held is not the release's
                    p.grad = None
                self.optimizer.step()
                self.move = (
                    global_norm([p - q for p, q in zip(self.params, self.previous)])
                    if self.previous is not None
                    else math.nan
                )
        self.check_finite()
        return self.move

    def check_finite(self) -> None:
        """Stops a diverged run: raises :class:`DivergedError` once the (released) step is not finite."""
        if math.isinf(self.move) or (math.isnan(self.move) and self.previous is not None):
            raise DivergedError(
                f"the iterates diverged (step length {self.move:g}); lower the learning rate or the clip "
                "radii, or restart the estimator more often"
            )



def _set_grad(p: Tensor, value: Tensor) -> None:
    """``p.grad`` set to a copy of ``value`` (never the estimator's own buffer, which the optimizer could
    change in place): into the gradient tensor ``p`` already holds where it has the right layout, sparing
    a fresh allocation (and, for large models on the host, its page faults) at every step."""
    g = p.grad
    if (g is None or g.layout != torch.strided or g.shape != p.shape or g.dtype != p.dtype
            or g.device != p.device or not g.is_contiguous()):
        p.grad = value.clone()
    else:
        g.copy_(value)

@dataclass(frozen=True)
class Radius:
    """A stream's clip radius: ``reset`` on a reset release; on a difference release
    ``min(cap, max_j per_move[j] * moves[j] + offset)``, with ``moves`` how far each block of the released
    iterates moved (``per_move`` is the paper's Lipschitz-type constant of the per-sample gradient, one per
    block).

    The cap (the algorithms default it to twice their reset radius: two gradients clipped at that radius
    differ by at most that much) keeps a large step from inflating the next difference's noise, which would
    inflate the next step: without it the noise can feed on itself and the run diverge. It is a public
    constant, so the radius stays a function of released iterates; a capped difference is clipped harder
    (more bias), never less private. ``None``: uncapped."""

    reset: float
    per_move: tuple[float, ...] = ()
    offset: float = 0.0
    cap: float | None = None

    def __post_init__(self) -> None:
        if self.cap is not None and not self.cap > 0:
            raise ValueError(f"max_radius: must be > 0, got {self.cap}")

    def __call__(self, reset: bool, *moves: float) -> float:
        if reset:
            return self.reset
        if len(moves) != len(self.per_move):
            raise ValueError(f"radius: {len(self.per_move)} moves expected, got {len(moves)}")
        radius = max((k * m for k, m in zip(self.per_move, moves)), default=0.0) + self.offset
        if not math.isfinite(radius):
            raise DivergedError(
                f"the iterates diverged (moves {', '.join(f'{m:g}' for m in moves)}), so the difference "
                "radius is not finite; lower the learning rate, or restart more often"
            )
        return radius if self.cap is None else min(radius, self.cap)


@dataclass(frozen=True)
class ClippedSum:
    """A sum of per-record terms that carries its own sensitivity: what a release adds noise to.

    ``tensors`` hold ``sum_i t_i`` over the records of a batch, every term clipped so that adding or removing
    one record moves the sum by at most ``bound`` in L2 (its clip radius; for a one-sided scalar term, half
    its replace-one range, :meth:`one_sided`). The release divides the sum by ``count``, a public number
    (the batch size, or the ``n P`` records a federated mean is over); ``divided=True`` says the tensors
    already hold ``sum / count`` (clients' means). One record therefore moves the released mean by at most
    :attr:`sensitivity` ``= bound / count``, and a noise multiplier ``z`` (the accountant's convention: std
    over that add/remove sensitivity) means the std ``z * sensitivity`` on the released mean.

    The bound travels with the tensors it bounds, from the clipping to the noise, so no call site works out a
    unit or divides a std by a batch size (where a sensitivity bug would hide).
    """

    tensors: Sequence[Tensor]
    bound: float
    count: float = 1.0
    divided: bool = False

    def __post_init__(self) -> None:
        if not (self.bound >= 0 and math.isfinite(self.bound)):
            raise ValueError(f"bound: must be finite and >= 0, got {self.bound}")
        if not (self.count > 0 and math.isfinite(self.count)):
            raise ValueError(f"count: must be finite and > 0, got {self.count}")

    @classmethod
    def replace_one(cls, tensors: Sequence[Tensor], sensitivity: float, count: float = 1.0) -> ClippedSum:
        """A sum that replacing one record moves by at most ``sensitivity`` (e.g. scalar terms confined to
        ``[low, high]``: ``high - low``; an output-perturbed solution: its worst-case sensitivity). The
        replace-one accountant charges twice dpvr's unit, so the unit is half of it. For replace-one plans
        only: under add/remove such a sum has no bound of this form."""
        return cls(tensors, sensitivity / 2.0, count)

    @property
    def scale(self) -> float:
        """The factor the release applies to ``tensors``."""
        return 1.0 if self.divided else 1.0 / self.count

    @property
    def sensitivity(self) -> float:
        """How far one record moves the released mean (add/remove; replace-one: twice this)."""
        return self.bound / self.count

    def std(self, noise_multiplier: float) -> float:
        """The noise std a release of this sum takes at ``noise_multiplier``."""
        if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
            raise ValueError(f"noise_multiplier: must be finite and > 0, got {noise_multiplier}")
        return noise_multiplier * self.sensitivity


def release(
    value: Sequence[Tensor],
    stream: str,
    clipped: ClippedSum,
    *,
    noise_multiplier: float,
    reset: bool,
    generator: ops.NoiseGenerator,
    params: Sequence[Tensor] | None = None,
    params_prev: Sequence[Tensor] | None = None,
    lr: float = 0.0,
) -> float | None:
    """``value <- (0 if reset else value) + clipped.scale * clipped + N(0, (z * clipped.sensitivity)^2 I)``,
    then optionally ``params <- params - lr * value``, in one fused pass (:func:`dpvr.ops.noisy_update`).

    The one place a release's noise std is formed: from the noise multiplier the accountant prices and the
    sensitivity the clipped sum carries. Returns the parameters' move (see ``noisy_update``)."""
    if isinstance(value, Tensor):
        raise TypeError("value: a list of tensors (a bare tensor would be read as a list of its rows)")
    return ops.noisy_update(
        list(value),
        sum=list(clipped.tensors),
        scale=clipped.scale,
        sigma=clipped.std(noise_multiplier),
        reset=reset,
        generator=generator,
        stream=stream,
        params=params,
        params_prev=params_prev,
        lr=lr,
    )


class DifferenceEstimator:
    """The estimator ``v`` (tensors shaped like ``like``) and its releases.

    :meth:`release`: ``v <- (0 if reset else v) + clipped / count + N(0, (z * sensitivity)^2 I)`` (see
    :class:`ClippedSum`), with the noise drawn from ``generator``'s stream ``stream``; given ``iterate`` and
    ``lr``, the step ``x <- x - lr v`` is fused into the same pass and the iterate's previous point and move
    are updated (an iterate with an optimizer steps after the release instead, on the gradient ``v``). The
    caller admits and records the release with its accountant (:meth:`PrivateAlgorithm.releasing`) around
    this call.
    """

    def __init__(self, like: Sequence[Tensor]) -> None:
        self.value = [torch.zeros_like(t) for t in like]

    def release(
        self,
        stream: str,
        clipped: ClippedSum,
        *,
        noise_multiplier: float,
        reset: bool,
        generator: ops.NoiseGenerator,
        iterate: Iterate | None = None,
        lr: float | None = None,
    ) -> None:
        step = iterate is not None and iterate.optimizer is None  # fused: the SGD step in the same pass
        move = release(
            self.value,
            stream,
            clipped,
            noise_multiplier=noise_multiplier,
            reset=reset,
            generator=generator,
            params=iterate.flat if step else None,
            params_prev=iterate.previous_flat if step else None,
            lr=lr if step else 0.0,
        )
        if step:
            iterate.move = float(move)
            iterate.check_finite()
        elif iterate is not None:
            iterate.step(self.value, lr)


def global_norm(tensors: Sequence[Tensor]) -> float:
    """The L2 norm of the concatenation of ``tensors``, in float64."""
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors))


def step_size(lr: float | None, optimizer: torch.optim.Optimizer | None) -> float | None:
    """An algorithm's ``lr``, checked: > 0 for its own SGD step, or ``None`` when ``optimizer`` steps."""
    if optimizer is None:
        if lr is None or not lr > 0:
            raise ValueError(f"lr: must be > 0, got {lr} (or give an optimizer)")
        return float(lr)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if lr is not None:
        raise ValueError("lr: the optimizer's learning rate applies; give lr only without an optimizer")
    return None
