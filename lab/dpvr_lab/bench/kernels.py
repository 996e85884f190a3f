"""``dpvr bench kernels``: the fused kernels against a read-bandwidth roofline, torch eager and Opacus.

For each size, per-sample gradients of a model's parameter shapes are generated once; every method then does
the same work on the same tensors:
  clip    — per-sample global norms, clip factors, clipped sum;
  diff    — the same on same-sample differences of two gradient sets;
  dp-step — clip, Gaussian noise and the SGD parameter step (Opacus: ``DPOptimizer.step``).
Throughput is bytes of per-sample data (read once) per second; the roofline is a reduction over the same
bytes with all threads (torch ``sum``), measured in the same run.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from dpvr import ops
from dpvr.results import Record

from .timing import median_ms

MLP_SHAPES = [(256, 784), (256,), (128, 256), (128,), (1, 128), (1,)]


@dataclass(frozen=True)
class Case:
    name: str
    shapes: list[tuple[int, ...]]
    batch: int


def cases(quick: bool) -> list[Case]:
    if quick:
        return [Case("mlp-784-256-128-1", MLP_SHAPES, 64)]
    return [
        Case("mlp-784-256-128-1", MLP_SHAPES, 256),
        Case("mlp-784-256-128-1", MLP_SHAPES, 1024),
        Case("linear-1024x1024", [(1024, 1024), (1024,)], 256),
    ]


def _torch_clip(grads: list[torch.Tensor], clip: float) -> list[torch.Tensor]:
    batch = grads[0].shape[0]
    norms = torch.stack([g.reshape(batch, -1).norm(dim=1) for g in grads], dim=1).norm(dim=1)
    factor = (clip / (norms + 1e-6)).clamp(max=1.0)
    return [torch.einsum("i,i...->...", factor, g) for g in grads]


def _opacus_step(params: list[torch.nn.Parameter], grads: list[torch.Tensor], clip: float):
    try:
        from opacus.optimizers import DPOptimizer
    except ImportError:
        return None
    optimizer = DPOptimizer(
        torch.optim.SGD(params, lr=0.1),
        noise_multiplier=1.0,
        max_grad_norm=clip,
        expected_batch_size=grads[0].shape[0],
    )

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for p, g in zip(params, grads):
            if hasattr(g, "_processed"):  # Opacus marks consumed per-sample gradients
                del g._processed
            p.grad_sample = g
        optimizer.step()

    return step


def bench_case(case: Case, repeats: int) -> list[Record]:
    torch.manual_seed(0)
    batch = case.batch
    grads = [torch.randn(batch, *s) for s in case.shapes]
    grads_prev = [torch.randn(batch, *s) for s in case.shapes]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in case.shapes]
    flat_params = [p.data.view(-1) for p in params]
    out = [torch.zeros(s).view(-1) for s in case.shapes]
    v = [torch.zeros(s).view(-1) for s in case.shapes]
    clip = 1.0
    d = sum(p.numel() for p in params)
    nbytes = batch * d * 4
    gen = ops.NoiseGenerator()

    def dpvr_clip() -> None:
        ops.clip_accumulate(grads, clip, out)

    def dpvr_diff() -> None:
        ops.clip_accumulate_diff(grads, grads_prev, clip, out)

    def dpvr_step() -> None:
        for o in out:
            o.zero_()
        ops.clip_accumulate(grads, clip, out)
        ops.noisy_update(
            v,
            sum=out,
            scale=1.0 / batch,
            sigma=clip / batch,
            reset=True,
            generator=gen,
            stream="bench",
            params=flat_params,
            lr=0.1,
        )

    def torch_step() -> None:
        with torch.no_grad():
            summed = _torch_clip(grads, clip)
            for p, s in zip(params, summed):
                noisy = (s + torch.randn_like(s) * clip) / batch
                p.add_(noisy, alpha=-0.1)

    timings = {
        ("roofline", "read"): median_ms(lambda: [g.sum() for g in grads], repeats=repeats),
        ("clip", "dpvr"): median_ms(dpvr_clip, repeats=repeats),
        ("clip", "torch-eager"): median_ms(lambda: _torch_clip(grads, clip), repeats=repeats),
        ("diff", "dpvr"): median_ms(dpvr_diff, repeats=repeats),
        ("diff", "torch-eager"): median_ms(
            lambda: _torch_clip([g - h for g, h in zip(grads, grads_prev)], clip), repeats=repeats
        ),
        ("dp-step", "dpvr"): median_ms(dpvr_step, repeats=repeats),
        ("dp-step", "torch-eager"): median_ms(torch_step, repeats=repeats),
    }
    opacus = _opacus_step(params, grads, clip)
    if opacus is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            timings[("dp-step", "opacus")] = median_ms(opacus, repeats=repeats)

    roofline_gbps = nbytes / timings[("roofline", "read")] / 1e6
    records = []
    for (kernel, method), ms in timings.items():
        data = nbytes * (2 if kernel == "diff" else 1)
        gbps = data / ms / 1e6
        metrics = {
            "kernel": kernel,
            "batch": batch,
            "d": d,
            "ms": ms,
            "gbps": gbps,
            "roofline_fraction": gbps / roofline_gbps,
        }
        if method == "dpvr":
            for peer in ("torch-eager", "opacus"):
                if (kernel, peer) in timings:
                    metrics[f"speedup_vs_{peer.replace('-', '_')}"] = timings[(kernel, peer)] / ms
        records.append(Record(method=f"{kernel}/{method}", dataset=f"{case.name}/B={batch}", metrics=metrics))
    return records


def run(*, quick: bool = False, repeats: int = 7, progress: bool = True) -> list[Record]:
    from tqdm import tqdm

    records: list[Record] = []
    for case in tqdm(cases(quick), desc="bench kernels", disable=not progress):
        records += bench_case(case, repeats)
    return records
