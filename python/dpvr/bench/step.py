"""``dpvr bench step``: one full optimisation step of a 784-256-128-1 MLP (B = 512, CPU), private and not.

Methods, all timed in one run with the rounds interleaved (see :func:`~.timing.interleaved_median_ms`):
  non-private               forward, backward and SGD step (torch);
  opacus-ghost-dp-sgd       Opacus ghost-clipping DP-SGD step (GradSampleModuleFastGradientClipping);
  dpvr-dp-sgd-ghost         dpvr DP-SGD step: GhostClipper.clipped_sum + fused noisy update and step;
  dpvr-diff2-ghost          a DIFF2 difference round: the clipped sum of same-sample gradient differences
                            at the current and previous iterates (GhostClipper.clipped_diff_sum), clip
                            radius C2 * ||x_r - x_{r-1}||, + fused noisy estimator update and step;
  dpvr-diff2-materialised   the same round from materialised per-sample gradients at both points
                            (per_sample_grads_at_two_points + clip_accumulate_diff).
Every record has ``ms`` and ``ratio_vs_non_private``; dpvr's records also ``ratio_vs_opacus_ghost`` and
``native_share``, the fraction of the step spent inside the native core (measured on separate rounds with
every call into ``dpvr._C`` timed). On a batch of 512 that is the whole dataset, ``dpvr-dp-sgd-ghost`` is a
DP-GD round.
"""

from __future__ import annotations

import copy
import time
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .. import ops
from ..grads import GhostClipper, per_sample_grads_at_two_points
from ..results import Record
from .timing import interleaved_median_ms

BATCH = 512
WIDTHS = (784, 256, 128, 1)
CLIP, CLIP2, SIGMA, LR = 1.0, 10.0, 1.0, 0.05


def mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for n_in, n_out in zip(WIDTHS[:-1], WIDTHS[1:]):
        layers += [nn.Linear(n_in, n_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def squared(output: Tensor, target: Tensor) -> Tensor:
    """Per-sample loss (the contract of dpvr.grads)."""
    return 0.5 * (output.squeeze(-1) - target) ** 2


def _non_private(model: nn.Module, x: Tensor, y: Tensor) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        (0.5 * (model(x).squeeze(-1) - y) ** 2).mean().backward()
        optimizer.step()

    return step


def _opacus_ghost(model: nn.Module, x: Tensor, y: Tensor) -> Callable[[], None] | None:
    try:
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
    except ImportError:
        return None
    module = GradSampleModuleFastGradientClipping(
        model, max_grad_norm=CLIP, use_ghost_clipping=True, loss_reduction="mean"
    )
    optimizer = DPOptimizerFastGradientClipping(
        torch.optim.SGD(module.parameters(), lr=LR),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        expected_batch_size=BATCH,
        loss_reduction="mean",
    )
    criterion = DPLossFastGradientClipping(
        module, optimizer, nn.MSELoss(reduction="mean"), loss_reduction="mean"
    )

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        criterion(module(x).squeeze(-1), y).backward()
        optimizer.step()

    return step


class _Dpvr:
    """dpvr's steps on one model: its parameters are updated in place by the fused noisy update."""

    def __init__(self, model: nn.Module, x: Tensor, y: Tensor) -> None:
        self.model, self.x, self.y = model, x, y
        self.ghost = GhostClipper(model, squared)
        self.params = list(model.parameters())
        self.flat = [p.data.view(-1) for p in self.params]
        self.prev = [p.detach().clone() for p in self.params]
        self.prev_flat = [p.view(-1) for p in self.prev]
        self.v = [torch.zeros_like(p) for p in self.flat]
        self.generator = ops.NoiseGenerator()
        self.generator.bind(b"bench")  # as the algorithms' generators are: each key hashes its release
        self.move = LR  # ||x_r - x_{r-1}||, updated by every step

    def _update(self, sums: list[Tensor], radius: float, *, reset: bool, stream: str) -> None:
        self.move = ops.noisy_update(
            self.v,
            sum=[s.view(-1) for s in sums],
            scale=1.0 / BATCH,
            sigma=SIGMA * radius / BATCH,
            reset=reset,
            generator=self.generator,
            stream=stream,
            params=self.flat,
            params_prev=self.prev_flat,
            lr=LR,
        )

    def dp_sgd(self) -> None:
        result = self.ghost.clipped_sum(self.x, self.y, CLIP)
        self._update(result.sums, CLIP, reset=True, stream="dp-sgd")

    def diff_round(self, materialised: bool) -> None:
        radius = CLIP2 * self.move
        now = [p.detach() for p in self.params]
        before = [p.view_as(q) for p, q in zip(self.prev_flat, self.params)]
        if materialised:
            grads, grads_prev = per_sample_grads_at_two_points(
                self.model, squared, self.x, self.y, now, before
            )
            sums = [torch.zeros_like(p) for p in self.flat]
            ops.clip_accumulate_diff(grads, grads_prev, radius, sums)
        else:
            sums = self.ghost.clipped_diff_sum(self.x, self.y, now, before, radius).sums
        self._update(sums, radius, reset=False, stream="difference")


class _NativeTimer:
    """Stands in for ``dpvr._C`` and adds up the wall time of every call into it."""

    def __init__(self, module: object) -> None:
        self._module, self.seconds = module, 0.0

    def __getattr__(self, name: str) -> Callable:
        function = getattr(self._module, name)

        def timed(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def _native_share(fn: Callable[[], None], rounds: int) -> float:
    """Fraction of ``fn``'s wall time spent in the native core."""
    from ..ops import ghost, kernels

    saved = kernels._C, ghost._C
    timer = _NativeTimer(saved[0])
    kernels._C = ghost._C = timer
    try:
        start = time.perf_counter()
        for _ in range(rounds):
            fn()
        total = time.perf_counter() - start
    finally:
        kernels._C, ghost._C = saved
    return timer.seconds / total


def run(*, quick: bool = False, repeats: int = 7) -> list[Record]:
    """Times each method (``quick``: at most 3 rounds, 1 warm-up) and returns one record per method."""
    torch.manual_seed(0)
    x, y = torch.randn(BATCH, WIDTHS[0]), torch.randn(BATCH)
    base = mlp()
    dpvr_model = copy.deepcopy(base)
    ours = _Dpvr(dpvr_model, x, y)
    ours.dp_sgd()  # a first step, so the difference rounds see two distinct iterates
    fns: dict[str, Callable[[], None]] = {"non-private": _non_private(copy.deepcopy(base), x, y)}
    opacus = _opacus_ghost(copy.deepcopy(base), x, y)
    if opacus is not None:
        fns["opacus-ghost-dp-sgd"] = opacus
    fns["dpvr-dp-sgd-ghost"] = ours.dp_sgd
    fns["dpvr-diff2-ghost"] = lambda: ours.diff_round(materialised=False)
    fns["dpvr-diff2-materialised"] = lambda: ours.diff_round(materialised=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus' notices about secure RNG and hooks
        ms = interleaved_median_ms(
            fns, repeats=min(repeats, 3) if quick else repeats, warmup=1 if quick else 2
        )
    d = sum(p.numel() for p in base.parameters())
    records = []
    for method, t in ms.items():
        metrics = {
            "ms": t,
            "batch": BATCH,
            "d": d,
            "threads": torch.get_num_threads(),
            "ratio_vs_non_private": t / ms["non-private"],
        }
        if method.startswith("dpvr"):
            metrics["native_share"] = _native_share(fns[method], 2 if quick else 5)
            if "opacus-ghost-dp-sgd" in ms:
                metrics["ratio_vs_opacus_ghost"] = t / ms["opacus-ghost-dp-sgd"]
        records.append(Record(method=method, dataset=f"mlp-784-256-128-1/B={BATCH}/cpu", metrics=metrics))
    return records
