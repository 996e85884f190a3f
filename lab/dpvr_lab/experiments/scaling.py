"""Where variance reduction wins as the data grow (issue #32): DIFF2-GD against DP-GD, PrivateDiff against
DP-SGDA and DP Double-SPIDER against DP-SGD on the same dual of distributionally robust training, on
MNIST-1D at growing training sizes ``n``, paired over seeds.

The theory predicts a crossover once ``n epsilon`` is large against the dimension ``d``: PrivateDiff's
gradient norm ``d^(1/3) / (n eps)^(2/3)`` against DP-SGDA's ``d^(1/4) / (n eps)^(1/2)``; DIFF2's squared
gradient norm ``d^(2/3) / (n eps)^(4/3)`` against DP-GD's ``sqrt(d) / (n eps)``; Double-SPIDER's gradient
norm ``(sqrt(d log(1/delta)) / (n eps))^(2/3)`` (DP-DRO Theorem 7) against DP-SGD's ``(sqrt(d) / (n
eps))^(1/2)`` on the same smooth non-convex dual. In
the norm (not squared) all three papers predict the exponent ``-2/3`` in ``n`` for the method against
``-1/2`` for its baseline.

- **Data.** MNIST-1D (:mod:`dpvr.data.mnist1d`, ``pip install "dpvr[mnist1d]"``), generated locally: the
  ``n`` training records (``--sizes``; nested: the set of ``16k`` contains the set of ``4k``), a fixed test
  set of 8,000 records, and two *public* draws from the same generator with seeds of their own: a twin of
  the training set (``n`` records) and a validation set (4,000). The signals are already standardised by
  the generator; nothing is fitted. The minimax paper's AUC task makes digits 0-4 the positive class
  (public ``p = 0.5``). The DRO paper's task is its binary imbalanced "-ST" construction on MNIST-1D
  (digits 5-9 positive, as its MNIST-ST): a cell's ``n`` training records are the first ``0.9 n``
  negatives and the first ``0.1 n`` positives, in generation order, of the first ``2 n`` generated records
  (so the sets nest as ``n`` grows); the public twin and the validation set (2,000) are built the same way
  from their own draws; the test set is the fixed 8,000 cut to the same number of records of each class
  (the first of each, in order). The construction reads labels only, never a signal, and defines the
  private training set the guarantee is about.
- **Models.** ``d``: an MLP 40-16-10 with a softplus hidden layer (``d = 826``) and the per-sample
  cross-entropy for DIFF2 / DP-GD; the same MLP with one output (``d = 675``, with AUC-M's ``a, b``) and
  the AUC-M objective (:class:`~dpvr.objectives.AUCMargin` ``v1``, margin 1, ``alpha`` in ``[0, 2]``) for
  PrivateDiff / DP-SGDA; the same MLP with two outputs (``d = 690``) and the per-sample cross-entropy
  inside the KL-penalised DRO objective ``LAM log mean_i exp(l_i / LAM)`` (``LAM = 1``; the value of
  ``max_p sum_i p_i l_i - LAM KL(p, 1/n)``) for Double-SPIDER / DP-SGD, both on its dual
  ``min_(x, eta) mean_i LAM psi*((l_i(x) - eta) / LAM) + eta``. float32.
- **Methods.** DIFF2 paper: one client (centralised; :class:`~dpvr.algorithms.DIFF2` on the pooled training
  set), ``R`` full-batch rounds (``--rounds``, default 50); DP-GD is DIFF2 with ``restart = 1``;
  DIFF2-GD restarts every ``T = R / 10`` rounds (inside the DIFF2 experiment's grid; ``--restart theorem``:
  Theorem 4.3's ``max(1, tau R)`` at the cell's n, d, epsilon and radii instead) with the difference
  radius ``C2 = 2`` (the median per-sample ``||grad l(x) - grad l(x')|| / ||x - x'||`` measured along a GD
  path on the public twin is 1-1.4, its 90th percentile about 2). Minimax paper: ``--steps`` x-updates
  (default 64) on batches of ``n / 16`` drawn without replacement (4 epochs), ``lr_y = 0.5``; DP-SGDA with
  ``C_x = C_y = C``; PrivateDiff (``y_release="ascent"``, ``T = 2``, ``T2 = 3`` as the paper's Table 2)
  with ``C0 = C1 = C`` and difference radius ``2 ||x_r - x_{r-1}|| + 0.05``. DRO paper: ``--steps``
  x-updates; DP-SGD on ``(x, eta)`` (:class:`~dpvr.objectives.WithEta`, ``eta_0 = 0``) with radius ``C``
  on batches of ``n / 16`` drawn without replacement; Double-SPIDER with the
  refresh radii ``C``, difference coefficients ``(2, 2)``, ``lr_eta = 0.1``, ``max_move = 0.1`` (the DRO
  experiment's settings), and its refresh period ``q`` and batch sizes from DP-DRO Theorems 7 and 8 at the
  cell's ``n, d, epsilon, delta`` and radii (``b1 = n`` on the refresh streams, ``b2`` of order
  ``(n d log(1/delta))^(1/3)`` on the difference streams), as ``make_private`` derives them.
- **Hyper-parameters.** Every method searches the same grid of four points, learning rate x clip radius
  (DIFF2 paper: ``lr`` in {0.5, 2} x ``C1`` in {1, 4}; minimax: ``lr_x`` in {0.3, 1} x ``C`` in {0.5,
  2}; DRO: ``lr`` in {0.05, 0.5} x ``C`` in {0.5, 2}), once per ``(n, epsilon)``: each point runs the
  private algorithm at the target epsilon on the public twin and is scored by the training objective on
  the public validation set (DIFF2 paper: mean cross-entropy; minimax: the primal
  ``Phi(x) = max_alpha L(x, alpha)``, exact for AUC-M; DRO: the KL-penalised objective in closed form).
  The search reads public data only, so the private runs' guarantee covers everything (no tuning outside
  the accounting).
- **Privacy.** ``(epsilon, 1e-6)``-DP, replace-one neighbours, tight accountant calibration (the
  default) of every stream in one accountant; spent epsilon is ``privacy_spent()``.
- **Seeds and pairing.** Seed ``s`` fixes the initialisation, the noise and the batches; method and
  baseline get the same seed's initialisation and the same training set (paired).
- **Metrics.** ``grad_norm``: the norm of the full gradient of the training objective at the output,
  computed on the private training set without noise (DIFF2 paper: of the mean cross-entropy; minimax: of
  ``Phi``, i.e. ``grad_x L(x, alpha*(x))`` by Danskin; DRO: of the KL-penalised objective, i.e.
  ``sum_i softmax_i(l / LAM) grad l_i``) — a diagnostic, not private; ``test_accuracy`` (DIFF2 paper),
  ``test_auc`` (minimax) or ``worst_class_accuracy`` (DRO; ``test_accuracy`` is kept beside it) on the
  test set. Per ``(paper, epsilon, n)``: method - baseline
  per seed, its mean with a 95% t-interval, and one-sided paired t-tests (alternative: the method is
  better). The exponent of the mean gradient norm in ``n`` is fitted by least squares on log-log axes.

Results of each ``(paper, epsilon, n)`` cell are kept under ``OUT/cells/`` (keyed by the protocol), so a
run can be extended with more sizes and re-run to redraw the table and figures without recomputing.
``--quick``: sizes 1,000 and 2,000, 3 seeds, 8 rounds / steps (a smoke test, not a measurement).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dpvr.algorithms import DIFF2, DPSGD, DPSGDA, DoubleSpider, PrivateDiff
from dpvr.data.dataset import Dataset
from dpvr.data.mnist1d import load_mnist1d
from dpvr.objectives import AUCMargin, AUCModel, WithEta, auc_score, divergence, dual_loss, kl_compositional
from dpvr.objectives.dro import cross_entropy as indexed_cross_entropy
from dpvr.ops import NoiseGenerator, torch_threads
from dpvr.optim import DivergedError, PrivacyConfig, RuntimeConfig
from dpvr.persistence import atomic_write
from dpvr.results import Record, document, format_table, write_figure
from dpvr.trainer.defaults import Public, derive

from .common import DIAGNOSTIC_NOTE, derive_seed, diagnostic, mean_std, one_sided_ttest, progress, save

NAME = "scaling"
PAPERS: dict[str, tuple[str, str]] = {
    "diff2": ("DIFF2-GD", "DP-GD"),
    "privatediff": ("PrivateDiff", "DP-SGDA"),
    "dro": ("Double-SPIDER", "DP-SGD (dual)"),
}
"""Paper -> (method, baseline)."""
TEST_METRIC = {"diff2": "test_accuracy", "privatediff": "test_auc", "dro": "worst_class_accuracy"}
THEORY_EXPONENT = {"DIFF2-GD": -2 / 3, "DP-GD": -1 / 2, "PrivateDiff": -2 / 3, "DP-SGDA": -1 / 2,
                   "Double-SPIDER": -2 / 3, "DP-SGD (dual)": -1 / 2}
"""The exponent of the gradient norm (not squared) in ``n`` that each method's rate predicts."""
SIZES = (4000, 16000, 64000)
EPSILONS = (1.0, 4.0)
DELTA = 1e-6
HIDDEN = 16
FEATURES = 40
POSITIVE = (0, 1, 2, 3, 4)  # AUC task: digits 0-4 are positives (public, p = 0.5)
ALPHA_MAX = 2.0
GRIDS: dict[str, tuple[dict[str, float], ...]] = {
    "diff2": tuple({"lr": lr, "clip": c} for lr in (0.5, 2.0) for c in (1.0, 4.0)),
    "privatediff": tuple({"lr": lr, "clip": c} for lr in (0.3, 1.0) for c in (0.5, 2.0)),
    "dro": tuple({"lr": lr, "clip": c} for lr in (0.05, 0.5) for c in (0.5, 2.0)),
}
"""The same grid, learning rate x clip radius, for the method and the baseline of each paper."""
DIFF2_C2 = 2.0
RESTART_FRACTION = 0.1  # DIFF2-GD's T = R / 10
RESTARTS = ("fraction", "theorem")
PD_RESTART, PD_Y_STEPS, PD_C2, PD_C3 = 2, 3, 2.0, 0.05
LR_Y = 0.5
DRO_POSITIVE = (5, 6, 7, 8, 9)  # the DRO paper's MNIST-ST positives
DRO_POSITIVE_SHARE, DRO_POOL = 0.1, 2  # n records from the first DRO_POOL * n generated
DRO_LAM, DRO_LR_ETA, DRO_MAX_MOVE, DRO_DIFFERENCE = 1.0, 0.1, 0.1, (2.0, 2.0)
BATCH_DIVISOR = 16
TUNE_SEED = 10**6  # the seed of the tuning runs (on public data), apart from the evaluation seeds


@dataclass(frozen=True)
class Protocol:
    sizes: tuple[int, ...]
    seeds: int
    rounds: int  # DIFF2 paper: full-batch rounds
    steps: int  # minimax paper: x-updates
    restart: str = "fraction"  # DIFF2-GD's period: R / 10, or Theorem 4.3's (RESTARTS)

    def key(self, paper: str, epsilon: float, n: int) -> str:
        """A cell's file stem: paper, budget, size and a digest of everything else that shapes it."""
        settings = {"seeds": self.seeds, "rounds": self.rounds, "steps": self.steps, "grid": GRIDS[paper],
                    "delta": DELTA, "hidden": HIDDEN, "version": 1}
        if self.restart != "fraction":
            settings["restart"] = self.restart
        digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
        return f"{paper}_eps{epsilon:g}_n{n}_{digest}"


DEFAULT = Protocol(sizes=SIZES, seeds=5, rounds=50, steps=64)
QUICK = Protocol(sizes=(1000, 2000), seeds=3, rounds=8, steps=8)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--papers", nargs="+", choices=tuple(PAPERS), default=list(PAPERS),
                        help="which comparisons to run (default: both)")
    parser.add_argument("--sizes", type=int, nargs="+", metavar="N",
                        help=f"training sizes (default: {' '.join(map(str, SIZES))})")
    parser.add_argument("--rounds", type=int, help="DIFF2 paper: full-batch rounds R (default 50)")
    parser.add_argument("--steps", type=int, help="minimax paper: x-updates (default 64)")
    parser.add_argument("--restart", choices=RESTARTS, default="fraction",
                        help="DIFF2-GD's restart period: R / 10 (default) or Theorem 4.3's max(1, tau R) at "
                             "each cell's n, d, epsilon and radii")
    parser.add_argument("--figure-dir", metavar="DIR", help="where the PNG figures go (default: --out)")


# ---- data ------------------------------------------------------------------------------------------------

Pair = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class _Data:
    train: Pair
    twin: Pair  # public: the tuning runs train on it
    validation: Pair  # public: scores the tuning runs
    test: Pair


def _data(paper: str, n: int) -> _Data:
    def tensors(split: str) -> Pair:
        if paper == "dro":
            return _long_tailed(split, n)
        part = load_mnist1d(n, split)  # type: ignore[arg-type]
        targets = torch.as_tensor(part.targets)
        if paper == "privatediff":
            targets = torch.isin(targets, torch.tensor(POSITIVE)).long()
        return torch.as_tensor(part.features, dtype=torch.float32), targets

    return _Data(tensors("train"), tensors("public"), tensors("validation"), tensors("test"))


def _first_of_each_class(targets: np.ndarray, counts: dict[int, int], source: str) -> np.ndarray:
    """The indices of the first ``counts[c]`` records of each class ``c``, in order (reads labels only)."""
    keep = []
    for c, count in counts.items():
        found = np.flatnonzero(targets == c)[:count]
        if len(found) < count:
            raise ValueError(f"{source}: needs {count} records of class {c}, has {len(found)}")
        keep.append(found)
    return np.sort(np.concatenate(keep))


def _long_tailed(split: str, n: int) -> Pair:
    """The DRO paper's binary "-ST" task on MNIST-1D (module documentation): imbalanced ``n`` records for
    ``"train"`` and ``"public"`` (half the validation set's for ``"validation"``), the test set balanced."""
    part: Dataset = load_mnist1d(DRO_POOL * n, split)  # type: ignore[arg-type]
    size = {"test": None, "validation": len(part) // DRO_POOL}.get(split, n)
    binary = np.isin(part.targets, DRO_POSITIVE).astype(np.int64)
    if size is None:
        per_class = int(np.bincount(binary, minlength=2).min())
        counts = {0: per_class, 1: per_class}
    else:
        positives = round(DRO_POSITIVE_SHARE * size)
        counts = {0: size - positives, 1: positives}
    keep = _first_of_each_class(binary, counts, f"MNIST-1D {split} ({len(binary)} records)")
    return torch.as_tensor(part.features[keep], dtype=torch.float32), torch.as_tensor(binary[keep])


# ---- models and objectives -------------------------------------------------------------------------------


def _net(outputs: int, seed: int) -> nn.Sequential:
    torch.manual_seed(derive_seed(seed, 1) % 2**63)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Softplus(), nn.Linear(HIDDEN, outputs))


def _model(paper: str, seed: int) -> nn.Module:
    return {"diff2": lambda: _net(10, seed), "dro": lambda: _net(2, seed),
            "privatediff": lambda: AUCModel(_net(1, seed))}[paper]()


def dimension(paper: str) -> int:
    """``d``: the number of trained parameters of ``paper``'s model."""
    return sum(p.numel() for p in _model(paper, 0).parameters() if p.requires_grad)


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """One sample's loss (the per-sample contract of :mod:`dpvr.grads`)."""
    return F.cross_entropy(output[None], target[None])


_PROBLEM = AUCMargin(0.5, alpha_max=ALPHA_MAX)


def _best_alpha(model: AUCModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``alpha*(x) = argmax_{alpha in [0, Lambda]} L(x, alpha)``: AUC-M is a concave quadratic in alpha,
    ``L(alpha) = L(0) + g alpha - p (1 - p) alpha^2``, so the maximiser is ``g / (2 p (1 - p))`` clamped."""
    zero = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    with torch.enable_grad():
        (slope,) = torch.autograd.grad(_PROBLEM.objective(model(x).double(), y, zero), [zero])
    p = _PROBLEM.p
    return (slope / (2 * p * (1 - p))).clamp(0.0, ALPHA_MAX).detach()


def _objective(paper: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The training objective at the model: mean cross-entropy, or AUC-M's primal ``Phi(x)``."""
    if paper == "diff2":
        return F.cross_entropy(model(x).double(), y)
    if paper == "dro":
        losses = F.cross_entropy(model(x).double(), y, reduction="none")
        return kl_compositional(losses, DRO_LAM, 0.0)  # the penalised objective: rho = 0
    alpha = _best_alpha(model, x, y)  # type: ignore[arg-type]
    return _PROBLEM.objective(model(x).double(), y, alpha)


def _evaluate(paper: str, model: nn.Module, data: _Data) -> dict[str, float]:
    params = [p for p in model.parameters() if p.requires_grad]
    with torch.enable_grad():
        value = _objective(paper, model, *data.train)
        grads = torch.autograd.grad(value, params)
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    out = {"grad_norm": norm, "train_objective": float(value.detach())}
    with torch.no_grad():
        x, y = data.test
        if paper in ("diff2", "dro"):
            correct = (model(x).argmax(dim=1) == y).double()
            out["test_accuracy"] = float(correct.mean())
            if paper == "dro":
                out["worst_class_accuracy"] = min(float(correct[y == c].mean()) for c in (0, 1))
        else:
            scores = model.scores(x)  # type: ignore[operator]
            out["test_auc"] = float(auc_score(scores, y)) if bool(torch.isfinite(scores).all()) else math.nan
    return {k: (v if math.isfinite(v) else math.nan) for k, v in out.items()}


# ---- runs ------------------------------------------------------------------------------------------------


def _algorithm(
    paper: str, method: str, point: dict[str, float], model: nn.Module, train: Pair, epsilon: float,
    protocol: Protocol, seed: int,
) -> DIFF2 | DPSGD | DPSGDA | DoubleSpider | PrivateDiff:
    privacy = PrivacyConfig(epsilon=epsilon, delta=DELTA)
    generator = NoiseGenerator(derive_seed(seed, 2), reproducible=True)
    # DIFF2's full-batch rounds by ghost clipping (4.4x faster at 256k; the released values are the same to
    # float rounding), the other papers' per-sample gradients materialised as when their tables were run.
    mode = "auto" if paper == "diff2" else "materialised"
    runtime = RuntimeConfig(generator=generator, sampler_seed=derive_seed(seed, 3), grad_mode=mode)
    lr, clip = point["lr"], point["clip"]
    if method in ("DP-GD", "DIFF2-GD"):
        radii = {"restart": clip, "difference": DIFF2_C2}
        restart = 1 if method == "DP-GD" else diff2_restart(protocol, radii, len(train[0]), model, epsilon)
        return DIFF2(model, _cross_entropy, [train], lr=lr, steps=protocol.rounds, restart=restart,
                     clip=radii, privacy=privacy, runtime=runtime)
    batch = max(1, len(train[0]) // BATCH_DIVISOR)
    if paper == "dro":
        return _dro_algorithm(method, lr, clip, model, train, epsilon, protocol, batch, privacy, runtime)
    if method == "DP-SGDA":
        return DPSGDA(model, _PROBLEM, *train, lr=lr, lr_y=LR_Y, steps=protocol.steps, batch_size=batch,
                      clip={"x": clip, "y": clip}, privacy=privacy, runtime=runtime)
    return PrivateDiff(model, _PROBLEM, *train, lr=lr, lr_y=LR_Y, steps=protocol.steps, restart=PD_RESTART,
                       y_steps=PD_Y_STEPS, batch_size=batch,
                       clip={"y": clip, "checkpoint": clip, "difference": (PD_C2, PD_C3)},
                       privacy=privacy, runtime=runtime)


def _dro_algorithm(
    method: str, lr: float, clip: float, model: nn.Module, train: Pair, epsilon: float, protocol: Protocol,
    batch: int, privacy: PrivacyConfig, runtime: RuntimeConfig,
) -> DPSGD | DoubleSpider:
    """DP-SGD or Double-SPIDER on the dual of the KL-penalised problem; Double-SPIDER with the theorems'
    refresh period and batch sizes (:func:`spider_schedule`)."""
    x, y = train
    div = divergence("kl")
    if method == "DP-SGD (dual)":  # ``model`` is trained in place inside the wrapper that adds ``eta``
        return DPSGD(WithEta(model), dual_loss(div, DRO_LAM), x, y, lr=lr, steps=protocol.steps,
                     batch_size=batch, sampling="wor", clip=clip, privacy=privacy, runtime=runtime)
    radii = {"eta-refresh": clip, "eta-difference": DRO_DIFFERENCE, "x-refresh": clip,
             "x-difference": DRO_DIFFERENCE}
    restart, sizes = spider_schedule(protocol, radii, len(x), model, epsilon)
    return DoubleSpider(model, indexed_cross_entropy, x, y, divergence=div, lam=DRO_LAM, steps=protocol.steps,
                        restart=restart, batch_sizes=sizes, lr=lr, lr_eta=DRO_LR_ETA, max_move=DRO_MAX_MOVE,
                        clip=radii, privacy=privacy, runtime=runtime)


def spider_schedule(protocol: Protocol, radii: dict[str, Any], n: int, model: nn.Module,
                    epsilon: float) -> tuple[int, dict[str, int]]:
    """Double-SPIDER's refresh period and batch sizes by DP-DRO Theorems 7 and 8, as ``make_private``
    derives them (:mod:`dpvr.trainer.defaults`)."""
    derived = derive("double-spider", {"clip": radii}, _public(model, n, epsilon, protocol.steps))
    return int(derived["restart"].value), dict(derived["batch_sizes"].value)


def diff2_restart(protocol: Protocol, radii: dict[str, float], n: int, model: nn.Module,
                  epsilon: float) -> int:
    """DIFF2-GD's restart period: ``R / 10`` (at least 2), or Theorem 4.3's ``max(1, tau R)`` as
    ``make_private`` derives it (:mod:`dpvr.trainer.defaults`; 1 makes DIFF2-GD DP-GD)."""
    if protocol.restart == "fraction":
        return max(2, round(RESTART_FRACTION * protocol.rounds))
    public = _public(model, n, epsilon, protocol.rounds)
    return int(derive("diff2", {"clip": radii}, public)["restart"].value)


def _public(model: nn.Module, n: int, epsilon: float, steps: int) -> Public:
    """The public quantities a theorem's setting reads, for one client holding ``n`` records."""
    d = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return Public(n=n, clients=1, dimension=d, epsilon=epsilon, delta=DELTA, steps=steps)


def _train(
    paper: str, method: str, point: dict[str, float], init: nn.Module, train: Pair, epsilon: float,
    protocol: Protocol, seed: int,
) -> tuple[nn.Module, float, bool]:
    """Runs ``method`` on ``train``: ``(model, spent epsilon, completed)``; a diverged run stops early."""
    model = copy.deepcopy(init)
    alg = _algorithm(paper, method, point, model, train, epsilon, protocol, seed)
    total = protocol.rounds if paper == "diff2" else protocol.steps
    completed = True
    try:
        for _ in range(total):
            alg.step()
    except DivergedError:
        completed = False
    completed = completed and all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return model, alg.privacy_spent().epsilon, completed


def _tune(paper: str, method: str, data: _Data, epsilon: float, protocol: Protocol,
          tick: Callable[[], None]) -> tuple[dict[str, float], list[float]]:
    """The grid point with the smallest validation objective after a private run on the public twin, and
    every point's score (``inf`` for a run that diverged)."""
    init = _model(paper, TUNE_SEED)
    scores = []
    for j, point in enumerate(GRIDS[paper]):
        model, _, completed = _train(paper, method, point, init, data.twin, epsilon, protocol,
                                     derive_seed(TUNE_SEED, j))
        score = math.inf
        if completed:
            with torch.no_grad():
                score = float(_objective(paper, model, *data.validation))
        scores.append(score if math.isfinite(score) else math.inf)
        tick()
    return dict(GRIDS[paper][int(np.argmin(scores))]), scores


def _cell(
    paper: str, epsilon: float, n: int, protocol: Protocol, tick: Callable[[], None]
) -> dict[str, Any]:
    """Both methods of ``paper`` at ``(epsilon, n)``: the tuning and one record per seed."""
    data = _data(paper, n)
    cell: dict[str, Any] = {"paper": paper, "epsilon": epsilon, "n": n, "methods": {}}
    for method in PAPERS[paper]:
        point, scores = _tune(paper, method, data, epsilon, protocol, tick)
        seeds = []
        for seed in range(protocol.seeds):
            init = _model(paper, seed)  # the same initialisation for method and baseline: paired
            noise_seed = derive_seed(seed, round(epsilon * 1e6), n)
            model, spent, completed = _train(paper, method, point, init, data.train, epsilon, protocol,
                                             noise_seed)
            seeds.append({"seed": seed, "spent_epsilon": spent, "completed": completed,
                          **_evaluate(paper, model, data)})
            tick()
        cell["methods"][method] = {"selected": point, "validation_scores": scores, "seeds": seeds}
    return cell


# ---- statistics ------------------------------------------------------------------------------------------


def paired_summary(method: Sequence[float], baseline: Sequence[float], *, lower_is_better: bool) -> dict:
    """Method - baseline per seed: mean, 95% t-interval and the one-sided paired p-value of "the method
    is better" (:func:`~.common.one_sided_ttest`)."""
    from scipy import stats

    diff = np.asarray(method, dtype=np.float64) - np.asarray(baseline, dtype=np.float64)
    mean, std = mean_std(diff)
    half = math.nan
    if diff.size > 1:
        half = float(stats.t.ppf(0.975, diff.size - 1) * std / math.sqrt(diff.size))
    better, worse = (method, baseline) if lower_is_better else (baseline, method)
    p = one_sided_ttest(better, worse, paired=True)
    return {"mean": mean, "ci_low": mean - half, "ci_high": mean + half, "p": p}


def crossover(sizes: Sequence[int], pvalues: Sequence[float], alpha: float = 0.05) -> int | None:
    """The smallest size from which every larger size run has ``p < alpha``; ``None`` if the largest has
    not."""
    found = None
    for n, p in sorted(zip(sizes, pvalues), reverse=True):
        if not p < alpha:
            break
        found = n
    return found


def fitted_exponent(sizes: Sequence[int], values: Sequence[float]) -> float:
    """Least-squares slope of ``log(value)`` against ``log(n)``."""
    x, y = np.log(np.asarray(sizes, dtype=np.float64)), np.log(np.asarray(values, dtype=np.float64))
    if x.size < 2 or not np.isfinite(y).all():
        return math.nan
    return float(np.polyfit(x, y, 1)[0])


# ---- the experiment --------------------------------------------------------------------------------------


def _protocol(args: argparse.Namespace) -> Protocol:
    base = QUICK if args.quick else DEFAULT
    protocol = Protocol(
        sizes=tuple(sorted(set(args.sizes))) if args.sizes else base.sizes,
        seeds=base.seeds if args.seeds is None else args.seeds,
        rounds=base.rounds if args.rounds is None else args.rounds,
        steps=base.steps if args.steps is None else args.steps,
        restart=getattr(args, "restart", "fraction"),
    )
    if protocol.seeds < 2 or protocol.rounds < 1 or protocol.steps < 1 or min(protocol.sizes) < BATCH_DIVISOR:
        raise ValueError(f"--seeds must be at least 2, --rounds and --steps at least 1 and every size at "
                         f"least {BATCH_DIVISOR}")
    return protocol


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the experiment (see the module documentation); returns the result document."""
    if args.dataset:
        raise ValueError("scaling runs on generated MNIST-1D only: choose sizes with --sizes, not --dataset")
    protocol = _protocol(args)
    epsilons = tuple(args.epsilon or EPSILONS)
    papers = list(dict.fromkeys(args.papers))
    cells_dir = os.path.join(args.out, "cells")
    os.makedirs(cells_dir, exist_ok=True)
    per_cell = {p: 2 * (len(GRIDS[p]) + protocol.seeds) for p in papers}
    total = sum(per_cell[p] for p in papers) * len(epsilons) * len(protocol.sizes)
    cells: dict[tuple[str, float, int], dict[str, Any]] = {}
    with torch_threads(1), progress(total, NAME) as bar:
        for n in protocol.sizes:  # the smallest sizes first: something complete exists early
            for paper in papers:
                for epsilon in epsilons:
                    path = os.path.join(cells_dir, protocol.key(paper, epsilon, n) + ".json")
                    bar.set_postfix_str(f"{paper} eps {epsilon:g} n {n}")
                    if os.path.isfile(path):
                        with open(path) as stored:
                            cells[(paper, epsilon, n)] = json.load(stored)
                        bar.update(per_cell[paper])
                        continue
                    cell = _cell(paper, epsilon, n, protocol, bar.update)
                    atomic_write(path, json.dumps(cell, indent=1, default=float).encode())
                    cells[(paper, epsilon, n)] = cell
    records = _records(cells)
    analysis = _analysis(cells, papers, epsilons, protocol)
    config = {
        "papers": {p: list(PAPERS[p]) for p in papers},
        "dimension": {p: dimension(p) for p in papers},
        "epsilons": list(epsilons),
        "delta": DELTA,
        "protocol": dataclasses.asdict(protocol),
        "grids": {p: list(GRIDS[p]) for p in papers},
        "clients": 1,
        "hyperparameter_tuning": "on public data only (a public twin of the training set, scored on a public "
                                 "validation set): covered by the guarantee",
        "quick": bool(args.quick),
    }
    doc = document(NAME, config, records)
    doc["analysis"] = analysis
    _report(analysis, papers, epsilons, protocol)
    paths = save(doc, records, args.out)
    paths += _plots(analysis, papers, epsilons, args.figure_dir or args.out)
    print("\nwrote " + ", ".join(paths))
    return doc


def _records(cells: dict[tuple[str, float, int], dict[str, Any]]) -> list[Record]:
    records = []
    for (paper, epsilon, n), cell in cells.items():
        for method, found in cell["methods"].items():
            for s in found["seeds"]:
                values = {k: v for k, v in s.items() if k not in ("seed", "spent_epsilon")}
                diagnostics = {k: values.pop(k) for k in ("grad_norm", "train_objective")}
                metrics = {"n": n, "paper": paper, **values, "selected": found["selected"],
                           "diagnostics": {"private": False, **diagnostics}}
                dataset = f"mnist1d_{n}" + ("_st" if paper == "dro" else "")
                records.append(Record(method, dataset, epsilon, DELTA, s["seed"], s["spent_epsilon"],
                                      metrics))
    return records


def _analysis(cells: dict[tuple[str, float, int], dict[str, Any]], papers: Sequence[str],
              epsilons: Sequence[float], protocol: Protocol) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for paper in papers:
        method, baseline = PAPERS[paper]
        test = TEST_METRIC[paper]
        for epsilon in epsilons:
            rows = []
            for n in protocol.sizes:
                found = cells[(paper, epsilon, n)]["methods"]
                a, b = found[method]["seeds"], found[baseline]["seeds"]
                rows.append({
                    "n": n,
                    "grad_norm": {m: mean_std(s["grad_norm"] for s in found[m]["seeds"])
                                  for m in (method, baseline)},
                    test: {m: mean_std(s[test] for s in found[m]["seeds"]) for m in (method, baseline)},
                    "selected": {m: found[m]["selected"] for m in (method, baseline)},
                    "diff_grad_norm": paired_summary([s["grad_norm"] for s in a], [s["grad_norm"] for s in b],
                                                     lower_is_better=True),
                    f"diff_{test}": paired_summary([s[test] for s in a], [s[test] for s in b],
                                                   lower_is_better=False),
                })
            sizes = [r["n"] for r in rows]
            out[f"{paper}/eps{epsilon:g}"] = {
                "paper": paper, "epsilon": epsilon, "method": method, "baseline": baseline, "rows": rows,
                "crossover": {
                    "grad_norm": crossover(sizes, [r["diff_grad_norm"]["p"] for r in rows]),
                    test: crossover(sizes, [r[f"diff_{test}"]["p"] for r in rows]),
                },
                "exponent": {
                    m: {"fitted": fitted_exponent(sizes, [r["grad_norm"][m][0] for r in rows]),
                        "theory": THEORY_EXPONENT[m]}
                    for m in (method, baseline)
                },
            }
    return out


def _report(analysis: dict[str, Any], papers: Sequence[str], epsilons: Sequence[float],
            protocol: Protocol) -> None:
    for paper in papers:
        method, baseline = PAPERS[paper]
        test = TEST_METRIC[paper]
        rows, summary = [], []
        for epsilon in epsilons:
            found = analysis[f"{paper}/eps{epsilon:g}"]
            for r in found["rows"]:
                rows.append([
                    epsilon, r["n"],
                    *(f"{r['grad_norm'][m][0]:.4g} ± {r['grad_norm'][m][1]:.2g}" for m in (method, baseline)),
                    r["diff_grad_norm"]["p"],
                    *(f"{r[test][m][0]:.4g} ± {r[test][m][1]:.2g}" for m in (method, baseline)),
                    r[f"diff_{test}"]["p"],
                ])
            cross = found["crossover"]
            summary.append([
                epsilon, cross["grad_norm"] or f"none up to {max(protocol.sizes)}",
                cross[test] or f"none up to {max(protocol.sizes)}",
                *(f"{found['exponent'][m]['fitted']:.2f} (theory {found['exponent'][m]['theory']:.2f})"
                  for m in (method, baseline)),
            ])
        print(f"\n{paper}: {method} vs {baseline}, d = {dimension(paper)}")
        print(format_table(
            ["epsilon", "n", f"{method} grad norm", f"{baseline} grad norm", "p grad",
             f"{method} {test}", f"{baseline} {test}", f"p {test}"], rows))
        print()
        print(format_table(["epsilon", "wins from n (grad norm, p<0.05)", f"wins from n ({test})",
                            f"{method} exponent", f"{baseline} exponent"], summary))
    print(f"\nmean ± std over {protocol.seeds} seeds; p: one-sided paired t-test, alternative: the method is "
          f"better than its baseline. Grad norm {DIAGNOSTIC_NOTE}\n"
          "Hyper-parameters were selected on public data only (a public twin of the training set, scored on "
          "a public validation set), so the guarantee covers them.")


def _plots(analysis: dict[str, Any], papers: Sequence[str], epsilons: Sequence[float], out: str) -> list[str]:
    """Per paper: the gradient norm of each method against ``n`` (log-log), then method - baseline against
    ``n`` for the gradient norm and the test metric, with 95% confidence intervals."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed
    from matplotlib.ticker import LogFormatterSciNotation, NullLocator

    os.makedirs(out, exist_ok=True)
    paths = []
    for paper in papers:
        method, baseline = PAPERS[paper]
        test = TEST_METRIC[paper]
        fig = Figure(figsize=(14, 4.2), layout="tight")
        axes = fig.subplots(1, 3)
        sizes = [r["n"] for r in analysis[f"{paper}/eps{epsilons[0]:g}"]["rows"]]
        for k, epsilon in enumerate(epsilons):
            found = analysis[f"{paper}/eps{epsilon:g}"]
            for name, style in ((method, "-"), (baseline, "--")):
                values = [r["grad_norm"][name][0] for r in found["rows"]]
                slope = found["exponent"][name]["fitted"]
                axes[0].plot(sizes, values, style, marker="o", color=f"C{k}",
                             label=f"{name}, eps {epsilon:g} (slope {slope:.2f})")
        axes[0].set_xscale("log")
        axes[0].set_yscale("log")
        theory = ", ".join(f"{m} {THEORY_EXPONENT[m]:.2f}" for m in (method, baseline))
        axes[0].set_title(diagnostic("full-gradient norm") + f"\nmean over seeds; theory slopes: {theory}",
                          fontsize=9)
        minor = LogFormatterSciNotation(labelOnlyBase=False, minor_thresholds=(2, 1))
        axes[0].yaxis.set_minor_formatter(minor)
        axes[0].tick_params(axis="y", which="minor", labelsize=7)
        axes[0].legend(fontsize=7)
        for ax, (metric, title) in zip(axes[1:], (
            ("grad_norm", diagnostic("full-gradient norm") + "\nmethod - baseline (lower: method better)"),
            (test, f"{test.replace('_', ' ')}\nmethod - baseline (higher: method better)"),
        )):
            for k, epsilon in enumerate(epsilons):
                rows = analysis[f"{paper}/eps{epsilon:g}"]["rows"]
                shifted = np.array(sizes, dtype=np.float64) * (1 + 0.04 * (k - 0.5))
                diff = [r[f"diff_{metric}"] for r in rows]
                mean = np.array([d["mean"] for d in diff])
                errors = np.array([[d["mean"] - d["ci_low"] for d in diff],
                                   [d["ci_high"] - d["mean"] for d in diff]])
                ax.errorbar(shifted, mean, yerr=errors, marker="o", capsize=3, label=f"epsilon = {epsilon:g}")
            ax.axhline(0.0, color="black", linewidth=0.8)
            ax.set_xscale("log")
            ax.set_title(title, fontsize=9)
            ax.legend(fontsize=8)
        for ax in axes:
            ax.set_xticks(sizes, [f"{n / 1000:g}k" if n >= 1000 else str(n) for n in sizes])
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xlabel("training records n")
            ax.grid(True, alpha=0.3)
        fig.suptitle(f"{method} vs {baseline} on MNIST-1D (d = {dimension(paper)}), paired over seeds, "
                     "95% CI", fontsize=10)
        path = os.path.join(out, f"scaling-{paper}.png")
        write_figure(path, fig, dpi=110)
        paths.append(path)
    return paths
