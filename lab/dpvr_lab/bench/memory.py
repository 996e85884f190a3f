"""``dpvr bench memory``: one logical DP-SGD step on a batch larger than the physical batch, against the
physical batch size (the memory a step needs is set by the physical batch; the release is the logical one's).

For each physical batch size ``p`` (dividing the logical batch ``B``), one logical step of:
  dpvr-dp-sgd-ghost        ghost clipping of the B records ``p`` at a time (``RuntimeConfig.chunk_size``:
                           :class:`~dpvr.optim.gradients.ClippedGradients` adds the micro-batches' clipped
                           sums), then one fused noisy update;
  opacus-hooks-dp-sgd      Opacus' DP-SGD (GradSampleModule, DPOptimizer) with its ``BatchMemoryManager``
                           splitting the logical batch into physical batches of ``p`` (the optimizer steps
                           once, after the last);
  opacus-ghost-dp-sgd      Opacus' ghost clipping with its ``BatchMemoryManager`` (where Opacus supports it).

Each record has ``ms`` (median of the interleaved rounds), ``peak_mib`` (the step's peak tensor memory above
what was live before it, :func:`~.timing.peak_bytes`) and ``memory_vs_logical``: the peak against the same
method's at ``p = B``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence

import torch
from torch.utils.data import DataLoader, TensorDataset

from dpvr import ops
from dpvr.optim.gradients import ClippedGradients
from dpvr.results import Record

from .step import CLIP, LR, SIGMA, Case, make_case
from .timing import interleaved_median_ms, peak_bytes


def _dpvr(case: Case, physical: int) -> Callable[[], None]:
    model = copy.deepcopy(case.model)
    engine = ClippedGradients(model, case.loss, mode="ghost", chunk_size=physical)
    flat = [p.data.view(-1) for p in model.parameters()]
    sums = [torch.zeros_like(f) for f in flat]
    v = [torch.zeros_like(f) for f in flat]
    generator = ops.NoiseGenerator()
    generator.bind(b"bench-memory")
    x, y = case.batches[0]
    releases = iter(range(1 << 62))

    def step() -> None:
        for s in sums:
            s.zero_()
        engine.sum(x, y, CLIP, sums)
        generator.for_release(next(releases).to_bytes(8, "little"))
        ops.noisy_update(v, sum=sums, scale=1.0 / len(x), sigma=SIGMA * CLIP / len(x), reset=True,
                         generator=generator, stream="dp-sgd", params=flat, lr=LR)

    return step


def _opacus(case: Case, physical: int, ghost: bool) -> Callable[[], None] | str:
    try:
        from opacus import GradSampleModule
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizer, DPOptimizerFastGradientClipping
        from opacus.utils.batch_memory_manager import BatchMemoryManager
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
        from opacus.validators import ModuleValidator
    except ImportError:
        return "opacus is not installed"
    x, y = case.batches[0]
    logical = len(x)
    model = ModuleValidator.fix(copy.deepcopy(case.model))
    options = dict(noise_multiplier=SIGMA, max_grad_norm=CLIP, expected_batch_size=logical,
                   loss_reduction="mean")
    try:
        if ghost:
            module = GradSampleModuleFastGradientClipping(model, max_grad_norm=CLIP, use_ghost_clipping=True,
                                                          loss_reduction="mean")
            optimizer = DPOptimizerFastGradientClipping(torch.optim.SGD(module.parameters(), lr=LR),
                                                        **options)
            criterion = DPLossFastGradientClipping(module, optimizer, copy.deepcopy(case.criterion),
                                                   loss_reduction="mean")
        else:
            module = GradSampleModule(model, loss_reduction="mean")
            optimizer = DPOptimizer(torch.optim.SGD(module.parameters(), lr=LR), **options)
            criterion = case.criterion
        loader = DataLoader(TensorDataset(x, y), batch_size=logical)

        def step() -> None:
            with BatchMemoryManager(data_loader=loader, max_physical_batch_size=physical,
                                    optimizer=optimizer) as batches:
                for inputs, targets in batches:
                    optimizer.zero_grad(set_to_none=True)
                    loss = criterion(module(inputs), targets)
                    loss.backward()
                    optimizer.step()

        step()
    except Exception as err:  # a refusal is a result to record
        return f"opacus refused: {type(err).__name__}: {err}"
    return step


def run(*, case: str = "cnn", logical: int = 1024, physicals: Sequence[int] = (128, 256, 512, 1024),
        repeats: int = 5) -> list[Record]:
    """Times each method at each physical batch size on one logical step of ``logical`` records."""
    bench = make_case(case, logical)
    records = []
    peaks: dict[str, float] = {}
    for physical in sorted(physicals, reverse=True):  # the logical batch first: the ratios' reference
        if logical % physical:
            raise ValueError(f"physical batch {physical} must divide the logical batch {logical}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Opacus' notices
            built = {"dpvr-dp-sgd-ghost": _dpvr(bench, physical),
                     "opacus-hooks-dp-sgd": _opacus(bench, physical, ghost=False),
                     "opacus-ghost-dp-sgd": _opacus(bench, physical, ghost=True)}
            fns = {name: fn for name, fn in built.items() if callable(fn)}
            ms = interleaved_median_ms(fns, repeats=repeats, warmup=1)
            for name, fn in fns.items():
                peak = peak_bytes(fn) / 2**20
                peaks.setdefault(name, peak)
                metrics = {"ms": ms[name], "peak_mib": peak, "physical": physical, "logical": logical,
                           "memory_vs_logical": peak / max(peaks[name], 1e-9)}
                records.append(Record(method=name, dataset=f"{bench.name}/B={logical}/p={physical}",
                                      metrics=metrics))
            for name, why in built.items():
                if not callable(why):
                    records.append(Record(method=name, dataset=f"{bench.name}/B={logical}/p={physical}",
                                          metrics={"skipped": why}))
    return records
