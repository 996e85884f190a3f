"""``dpvr bench step``: one full optimisation step, private and not, on three small models (CPU).

Cases (``--case``):
  mlp           784-256-128-1 MLP, squared loss, B = 512;
  cnn           2 conv (3x3, 16 and 32 channels, each with ReLU and 2x2 max-pooling) + 2 linear layers on
                1x28x28 inputs, 10 classes, cross-entropy, B = 256;
  transformer   embedding (1000 tokens, width 64), 2 ``nn.TransformerEncoderLayer`` (4 heads, feed-forward
                128, no dropout), mean pooling and a 2-class head, sequences of 64 tokens, B = 64.

Methods, all timed in one run with the rounds interleaved (see :func:`~.timing.interleaved_median_ms`); each
private method updates its own copy of the model, so one method's state never feeds another's:
  non-private                  forward, backward and SGD step (torch);
  opacus-ghost-dp-sgd          Opacus ghost-clipping DP-SGD step (GradSampleModuleFastGradientClipping) on
                               the model after ``ModuleValidator.fix`` (``nn.MultiheadAttention`` becomes
                               Opacus' ``DPMultiheadAttention``); where Opacus is missing or refuses the
                               model, a record says why;
  dpvr-dp-sgd-ghost            dpvr DP-SGD step: GhostClipper.clipped_sum + fused noisy update and step (on
                               a batch that is the whole dataset, a DP-GD round);
  dpvr-diff2-ghost             a DIFF2-GD difference round on the full batch: the clipped sum of same-sample
                               gradient differences at the current and previous iterates
                               (GhostClipper.clipped_diff_sum, the previous iterate's recording reused from
                               the previous round), clip radius C2 * ||x_r - x_{r-1}||, + fused noisy
                               estimator update and step;
  dpvr-diff2-ghost-recompute   the same round recording both points again (``reuse_recording=False``);
  dpvr-fresh-diff-ghost        a difference round on a fresh batch (PrivateDiff, SPIDER): both points
                               recorded on a batch drawn in turn from four;
  dpvr-diff2-materialised      (mlp only) the full-batch round from materialised per-sample gradients at
                               both points (per_sample_grads_at_two_points + clip_accumulate_diff).

Every timed record has ``ms`` and ``ratio_vs_non_private``; dpvr's records also ``ratio_vs_opacus_ghost`` and
``native_share``, the fraction of the step spent inside the native core (measured on separate rounds with
every call into ``dpvr._C`` timed). With ``memory``, every record also has ``peak_mib``, the peak tensor
memory one step allocates above what was live before it (:func:`~.timing.peak_bytes`), and its ratios.
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import cycle

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops
from ..grads import GhostClipper, per_sample_grads_at_two_points
from ..results import Record
from .timing import interleaved_median_ms, peak_bytes

CASES = ("mlp", "cnn", "transformer")
CLIP, CLIP2, SIGMA, LR = 1.0, 10.0, 1.0, 0.05
FRESH_BATCHES = 4  # the fresh-batch round cycles through this many batches
WIDTHS = (784, 256, 128, 1)
BATCH = 512  # the MLP's


def mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for n_in, n_out in zip(WIDTHS[:-1], WIDTHS[1:]):
        layers += [nn.Linear(n_in, n_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2),  # 28 -> 26 -> 13
        nn.Conv2d(16, 32, 3), nn.ReLU(), nn.MaxPool2d(2),  # 13 -> 11 -> 5
        nn.Flatten(), nn.Linear(32 * 5 * 5, 64), nn.ReLU(), nn.Linear(64, 10),
    )


class Encoder(nn.Module):
    """A small transformer encoder classifier: token embedding, encoder layers, mean pooling, linear head."""

    def __init__(self, vocab: int = 1000, width: int = 64, layers: int = 2, classes: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.Sequential(*[
            nn.TransformerEncoderLayer(width, 4, dim_feedforward=2 * width, dropout=0.0, batch_first=True)
            for _ in range(layers)
        ])
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.layers(self.embed(tokens)).mean(dim=1))


def squared(output: Tensor, target: Tensor) -> Tensor:
    """Per-sample loss (the contract of dpvr.grads)."""
    return 0.5 * (output.squeeze(-1) - target) ** 2


def cross_entropy(output: Tensor, target: Tensor) -> Tensor:
    """Per-sample loss (the contract of dpvr.grads)."""
    return F.cross_entropy(output, target)


class HalfSquared(nn.Module):
    """``0.5 (output - target)^2`` on the squeezed output, reduced as ``reduction`` says (as torch's losses,
    whose ``reduction`` Opacus switches to ``"none"`` to get per-sample losses)."""

    def __init__(self) -> None:
        super().__init__()
        self.reduction = "mean"

    def forward(self, output: Tensor, target: Tensor) -> Tensor:
        loss = squared(output, target)
        return loss if self.reduction == "none" else loss.sum() if self.reduction == "sum" else loss.mean()


@dataclass
class Case:
    """One model with its data: ``batches[0]`` is the full batch, the others feed the fresh-batch round."""

    name: str
    model: nn.Module
    batches: list[tuple[Tensor, Tensor]]
    loss: Callable[[Tensor, Tensor], Tensor]  # per sample, for dpvr
    criterion: nn.Module  # batched, mean reduction: the non-private step and Opacus

    @property
    def batch(self) -> int:
        return len(self.batches[0][0])

    @property
    def label(self) -> str:
        return f"{self.name}/B={self.batch}/cpu"


def make_case(name: str, batch: int | None = None) -> Case:
    """The case ``name`` (one of :data:`CASES`) with its default batch size unless ``batch`` is given."""
    torch.manual_seed(0)
    if name == "mlp":
        b = batch or BATCH
        data = [(torch.randn(b, WIDTHS[0]), torch.randn(b)) for _ in range(FRESH_BATCHES)]
        return Case("mlp-784-256-128-1", mlp(), data, squared, HalfSquared())
    if name == "cnn":
        b = batch or 256
        data = [(torch.randn(b, 1, 28, 28), torch.randint(0, 10, (b,))) for _ in range(FRESH_BATCHES)]
        return Case("cnn-2conv-2linear-28x28", cnn(), data, cross_entropy, nn.CrossEntropyLoss())
    if name == "transformer":
        b = batch or 64
        data = [(torch.randint(0, 1000, (b, 64)), torch.randint(0, 2, (b,))) for _ in range(FRESH_BATCHES)]
        return Case("transformer-2layer-seq64", Encoder(), data, cross_entropy, nn.CrossEntropyLoss())
    raise ValueError(f"case: must be one of {CASES}, got {name!r}")


def _non_private(model: nn.Module, case: Case) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = case.batches[0]

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        case.criterion(model(x), y).backward()
        optimizer.step()

    return step


def _opacus_ghost(model: nn.Module, case: Case) -> Callable[[], None] | str:
    """Opacus' ghost-clipping step, or why there is none."""
    try:
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
        from opacus.validators import ModuleValidator
    except ImportError:
        return "opacus is not installed"
    x, y = case.batches[0]
    try:
        module = GradSampleModuleFastGradientClipping(
            ModuleValidator.fix(model), max_grad_norm=CLIP, use_ghost_clipping=True, loss_reduction="mean"
        )
        optimizer = DPOptimizerFastGradientClipping(
            torch.optim.SGD(module.parameters(), lr=LR), noise_multiplier=SIGMA, max_grad_norm=CLIP,
            expected_batch_size=case.batch, loss_reduction="mean",
        )
        criterion = DPLossFastGradientClipping(module, optimizer, copy.deepcopy(case.criterion),
                                               loss_reduction="mean")

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            criterion(module(x), y).backward()
            optimizer.step()

        step()  # Opacus may refuse the model only when it runs
    except Exception as err:  # any refusal is a result to record, not a failure of the benchmark
        return f"opacus refused the model: {type(err).__name__}: {err}"
    return step


class _Dpvr:
    """One of dpvr's step kinds on its own copy of the model, updated in place by the fused noisy update."""

    def __init__(self, model: nn.Module, case: Case, *, reuse_recording: bool = False) -> None:
        self.model, self.case = model, case
        self.ghost = GhostClipper(model, case.loss, reuse_recording=reuse_recording)
        self.params = list(model.parameters())
        self.flat = [p.data.view(-1) for p in self.params]
        self.prev = [p.detach().clone() for p in self.params]
        self.prev_flat = [p.view(-1) for p in self.prev]
        self.v = [torch.zeros_like(p) for p in self.flat]
        self.generator = ops.NoiseGenerator()
        self.generator.bind(b"bench")  # as the algorithms' generators are: each key hashes its release
        self.move = LR  # ||x_r - x_{r-1}||, updated by every step
        self.fresh = cycle(case.batches)

    def _update(self, sums: Sequence[Tensor], radius: float, *, reset: bool, stream: str) -> None:
        self.move = ops.noisy_update(
            self.v,
            sum=[s.view(-1) for s in sums],
            scale=1.0 / self.case.batch,
            sigma=SIGMA * radius / self.case.batch,
            reset=reset,
            generator=self.generator,
            stream=stream,
            params=self.flat,
            params_prev=self.prev_flat,
            lr=LR,
        )

    def dp_sgd(self) -> None:
        x, y = self.case.batches[0]
        result = self.ghost.clipped_sum(x, y, CLIP)
        self._update(result.sums, CLIP, reset=True, stream="dp-sgd")

    def diff_round(self, *, fresh: bool = False, materialised: bool = False) -> None:
        x, y = next(self.fresh) if fresh else self.case.batches[0]
        radius = CLIP2 * self.move
        now = [p.detach() for p in self.params]
        before = [p.view_as(q) for p, q in zip(self.prev_flat, self.params)]
        if materialised:
            grads, grads_prev = per_sample_grads_at_two_points(self.model, self.case.loss, x, y, now, before)
            sums = [torch.zeros_like(p) for p in self.flat]
            ops.clip_accumulate_diff(grads, grads_prev, radius, sums)
        else:
            sums = self.ghost.clipped_diff_sum(x, y, now, before, radius).sums
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


def _methods(case: Case) -> tuple[dict[str, Callable[[], None]], str | None]:
    """The step of every method on ``case`` (each on its own copy of the model), and why Opacus has none."""
    fns: dict[str, Callable[[], None]] = {"non-private": _non_private(copy.deepcopy(case.model), case)}
    opacus = _opacus_ghost(copy.deepcopy(case.model), case)
    if callable(opacus):
        fns["opacus-ghost-dp-sgd"] = opacus
    dp_sgd = _Dpvr(copy.deepcopy(case.model), case)
    fns["dpvr-dp-sgd-ghost"] = dp_sgd.dp_sgd
    for name, reuse in (("dpvr-diff2-ghost", True), ("dpvr-diff2-ghost-recompute", False)):
        diff2 = _Dpvr(copy.deepcopy(case.model), case, reuse_recording=reuse)
        diff2.dp_sgd()  # the restart round: two distinct iterates, and the recording of the first
        fns[name] = diff2.diff_round
    fresh = _Dpvr(copy.deepcopy(case.model), case)
    fresh.dp_sgd()
    fns["dpvr-fresh-diff-ghost"] = lambda: fresh.diff_round(fresh=True)
    if case.name.startswith("mlp"):
        materialised = _Dpvr(copy.deepcopy(case.model), case)
        materialised.dp_sgd()
        fns["dpvr-diff2-materialised"] = lambda: materialised.diff_round(materialised=True)
    return fns, None if callable(opacus) else opacus


def run_case(case: Case, *, repeats: int, warmup: int, memory: bool = False,
             share_rounds: int = 5) -> list[Record]:
    """Times every method on ``case`` (interleaved) and returns one record per method."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus' notices about secure RNG and hooks
        fns, opacus_missing = _methods(case)
        ms = interleaved_median_ms(fns, repeats=repeats, warmup=warmup)
        peaks = {name: peak_bytes(fn) / 2**20 for name, fn in fns.items()} if memory else {}
    common = {
        "batch": case.batch,
        "d": sum(p.numel() for p in case.model.parameters()),
        "threads": torch.get_num_threads(),
    }
    records = []
    for method, t in ms.items():
        metrics = {"ms": t, **common, "ratio_vs_non_private": t / ms["non-private"]}
        if method.startswith("dpvr"):
            metrics["native_share"] = _native_share(fns[method], share_rounds)
            if "opacus-ghost-dp-sgd" in ms:
                metrics["ratio_vs_opacus_ghost"] = t / ms["opacus-ghost-dp-sgd"]
        if memory:
            metrics["peak_mib"] = peaks[method]
            metrics["memory_vs_non_private"] = peaks[method] / max(peaks["non-private"], 1e-9)
            if method.startswith("dpvr") and "opacus-ghost-dp-sgd" in peaks:
                metrics["memory_vs_opacus_ghost"] = peaks[method] / max(peaks["opacus-ghost-dp-sgd"], 1e-9)
        records.append(Record(method=method, dataset=case.label, metrics=metrics))
    if opacus_missing is not None:
        records.insert(1, Record(method="opacus-ghost-dp-sgd", dataset=case.label,
                                 metrics={**common, "skipped": opacus_missing}))
    return records


# The step costs dpvr aims at, as multiples of the non-private step (time; memory: 1.5x for every step).
TARGETS = {"dpvr-dp-sgd-ghost": 1.3, "dpvr-diff2-ghost": 1.5, "dpvr-fresh-diff-ghost": 2.3}
MEMORY_TARGET = 1.5
_PLOTTED = {
    "opacus-ghost-dp-sgd": "Opacus ghost DP-SGD",
    "dpvr-dp-sgd-ghost": "dpvr DP-SGD",
    "dpvr-diff2-ghost": "dpvr DIFF2 round (reused)",
    "dpvr-diff2-ghost-recompute": "dpvr DIFF2 round (recomputed)",
    "dpvr-fresh-diff-ghost": "dpvr fresh-batch round",
}


def _ratios(shown: dict[str, dict], names: Sequence[str], key: str) -> list[float]:
    """``key`` of each method's metrics; NaN (no bar) for a method the case lacks."""
    return [shown.get(m, {}).get(key, math.nan) for m in names]


def plot(records: Sequence[Record], path: str) -> None:
    """One panel per case: each method's time (and, when measured, peak memory) as a multiple of the
    non-private step, with the targets marked (``|``). The materialised DIFF2 round (tens of times the
    step) is left out so that the others stay readable."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    from ..results import write_figure

    cases = list(dict.fromkeys(r.dataset for r in records))
    names, rows = list(_PLOTTED), range(len(_PLOTTED))  # one row per method in every panel
    fig = Figure(figsize=(4 + 3 * len(cases), 3.8), layout="constrained")
    axes = fig.subplots(1, len(cases), squeeze=False, sharey=True)[0]
    for ax, case in zip(axes, cases):
        shown = {r.method: r.metrics for r in records if r.dataset == case and "ms" in r.metrics}
        ax.barh([y - 0.2 for y in rows], _ratios(shown, names, "ratio_vs_non_private"), height=0.4,
                label="time")
        marked = [(TARGETS[m], y - 0.2) for m, y in zip(names, rows) if m in TARGETS]
        if any("memory_vs_non_private" in metrics for metrics in shown.values()):
            ax.barh([y + 0.2 for y in rows], _ratios(shown, names, "memory_vs_non_private"), height=0.4,
                    label="peak memory", alpha=0.5)
            marked += [(MEMORY_TARGET, y + 0.2) for m, y in zip(names, rows) if m.startswith("dpvr")]
        ax.plot([t for t, _ in marked], [y for _, y in marked], "k|", markersize=12, label="target")
        ax.axvline(1.0, color="grey", linewidth=0.8)
        ax.set_yticks(list(rows), [_PLOTTED[m] for m in names])
        ax.set_xlabel("× the non-private step")
        ax.set_title(case)
        ax.grid(True, axis="x", alpha=0.3)
    axes[0].invert_yaxis()  # shared: the first method on top in every panel
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=3)
    write_figure(path, fig, dpi=120)


def run(*, cases: Sequence[str] = CASES, quick: bool = False, repeats: int = 7, memory: bool = False,
        batch: int | None = None) -> list[Record]:
    """Times each method on each case (``quick``: at most 3 rounds, 1 warm-up); ``batch`` overrides every
    case's batch size (tests run tiny rounds with it). One record per method and case."""
    records = []
    for name in cases:
        records += run_case(make_case(name, batch), repeats=min(repeats, 3) if quick else repeats,
                            warmup=1 if quick else 2, memory=memory, share_rounds=2 if quick else 5)
    return records
