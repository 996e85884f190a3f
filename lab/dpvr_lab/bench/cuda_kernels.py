"""CUDA kernel benchmark: dpvr's fused kernels against a device-to-device copy, torch eager and Opacus.

``run(sizes)`` returns one record per (size, method), timed with CUDA events on the current stream:

- ``copy``: a device-to-device copy of the per-sample data (B x D values), measured in the same run;
- ``dpvr clip`` / ``dpvr clip diff``: one clip-accumulate call (plain / difference form);
- ``torch clip``: the same clip-accumulate written in torch eager (per-tensor norms, factors, einsum);
- ``dpvr step``: clip-accumulate + noisy update with the parameter step (what one DP-SGD step needs once the
  per-sample gradients exist); ``dpvr step, noise-free (graph)``: the same without noise, captured in a CUDA
  graph and replayed (capturing a noisy update is refused: every replay would add the same noise);
- ``torch step``: the same in torch eager; ``opacus step``: Opacus' ``DPOptimizer.step`` + ``zero_grad`` on
  the same per-sample gradients (clip, accumulate, noise, scale, SGD step), when opacus imports.

``gbps`` counts the per-sample data once (B x D x itemsize; twice that for the difference form) per unit of
time, for the copy as for the kernels, so ``vs_copy`` is the fraction of copy speed per byte read. The copy
also writes what it reads, and the fused clip reads its input twice (norm pass, accumulation pass): both move
about twice the data's bytes. ``vs_opacus`` is Opacus' time over the method's time (steps only).

``dpvr bench kernels --device cuda [--json FILE]`` runs it and prints the table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

CLIP, SIGMA, LR = 1.0, 1.0, 0.1

# The sizes of the kernel benchmark plus the launch-bound case: a small MLP with many tensors at B = 64.
_LAUNCH_BOUND = [(64, 32), (64,)] + [(64, 64), (64,)] * 14 + [(10, 64), (10,)]
_MLP = [(256, 784), (256,), (128, 256), (128,), (1, 128), (1,)]
DEFAULT_SIZES: list[dict[str, Any]] = [
    {"name": "mlp-784-256-128-1", "batch": 256, "shapes": _MLP},
    {"name": "mlp-784-256-128-1", "batch": 1024, "shapes": _MLP},
    {"name": "linear-1024x1024", "batch": 256, "shapes": [(1024, 1024), (1024,)]},
    {"name": "launch-bound-mlp-32-tensors", "batch": 64, "shapes": _LAUNCH_BOUND},
]


def _timer(fn: Callable[[], Any], min_seconds: float, max_iters: int) -> float:
    """Seconds per call of fn, by CUDA events around a loop, after warm-up."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end) / 1e3, 1e-6)
    iters = int(min(max_iters, max(5, min_seconds / once)))
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


class _Case:
    """One benchmark size: per-sample gradients, and flat outputs and parameters with per-tensor views."""

    def __init__(self, batch: int, shapes: Sequence[tuple[int, ...]], dtype: Any) -> None:
        import torch

        self.batch, self.shapes, self.dtype = batch, [tuple(s) for s in shapes], dtype
        self.sizes = [math.prod(s) for s in self.shapes]
        self.params = sum(self.sizes)
        self.grads = [torch.randn(batch, *s, device="cuda", dtype=dtype) for s in self.shapes]
        self.flat = {n: torch.zeros(self.params, device="cuda", dtype=dtype) for n in ("out", "v", "x")}
        split = {n: torch.split(b, self.sizes) for n, b in self.flat.items()}
        self.views = {n: [t.view(s) for t, s in zip(parts, self.shapes)] for n, parts in split.items()}
        self.bytes = batch * self.params * self.grads[0].element_size()


def _dpvr_methods(case: _Case) -> dict[str, tuple[Callable[[], Any], int]]:
    import torch

    import dpvr

    gen = dpvr.NoiseGenerator()
    prev = [torch.randn_like(g) for g in case.grads]
    out, v, x = case.views["out"], case.views["v"], case.views["x"]

    def step(sigma: float = SIGMA * CLIP / case.batch) -> Any:
        case.flat["out"].zero_()
        dpvr.clip_accumulate(case.grads, CLIP, out)
        return dpvr.noisy_update(
            v, generator=gen, stream="bench", sigma=sigma, sum=out, scale=1 / case.batch, reset=True,
            params=x, lr=LR,
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(0.0)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(0.0)
    return {
        "dpvr clip": (lambda: dpvr.clip_accumulate(case.grads, CLIP, out), case.bytes),
        "dpvr clip diff": (lambda: dpvr.clip_accumulate_diff(case.grads, prev, CLIP, out), 2 * case.bytes),
        "dpvr step": (step, case.bytes),
        "dpvr step, noise-free (graph)": (graph.replay, case.bytes),
    }


def _torch_methods(case: _Case) -> dict[str, tuple[Callable[[], Any], int]]:
    import torch

    flat = [g.reshape(case.batch, -1) for g in case.grads]
    out = [o.view(-1) for o in case.views["out"]]
    x = [p.view(-1) for p in case.views["x"]]

    def factors() -> Any:
        norms = torch.stack([f.norm(dim=1) for f in flat], dim=1).norm(dim=1)
        return (CLIP / (norms + 1e-6)).clamp(max=1.0)

    def clip() -> None:
        c = factors()
        for f, o in zip(flat, out):
            o.add_(c @ f)

    def step() -> None:
        c = factors()
        for f, p in zip(flat, x):
            s = c @ f
            s.add_(torch.randn_like(s), alpha=SIGMA * CLIP)
            p.sub_(s, alpha=LR / case.batch)

    return {"torch clip": (clip, case.bytes), "torch step": (step, case.bytes)}


def _opacus_methods(case: _Case) -> dict[str, tuple[Callable[[], Any], int]]:
    try:
        from opacus.optimizers import DPOptimizer
    except ImportError:
        return {}
    import torch

    params = [torch.nn.Parameter(torch.zeros(s, device="cuda", dtype=case.dtype)) for s in case.shapes]
    sgd = torch.optim.SGD(params, lr=LR)
    opt = DPOptimizer(sgd, noise_multiplier=SIGMA, max_grad_norm=CLIP, expected_batch_size=case.batch)

    def step() -> None:
        for p, g in zip(params, case.grads):
            p.grad_sample = g.view(g.shape)  # a fresh view: Opacus refuses a per-sample gradient used twice
        opt.step()
        opt.zero_grad(set_to_none=True)

    return {"opacus step": (step, case.bytes)}


def run(
    sizes: Sequence[dict[str, Any]] | None = None,
    *,
    dtype: str = "float32",
    min_seconds: float = 0.2,
    max_iters: int = 200,
) -> list[dict[str, Any]]:
    """Times every method at every size (``{"name", "batch", "shapes"}``) on the current CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("bench kernels --device cuda: torch sees no CUDA device")
    import dpvr

    if not dpvr.backends()["cuda_available"]:
        raise RuntimeError("bench kernels --device cuda: this build of dpvr has no usable CUDA backend")
    torch_dtype = getattr(torch, dtype)
    device = torch.cuda.get_device_name()
    records: list[dict[str, Any]] = []
    for size in sizes or DEFAULT_SIZES:
        case = _Case(int(size["batch"]), size["shapes"], torch_dtype)
        src = torch.cat([g.reshape(-1) for g in case.grads])
        dst = torch.empty_like(src)
        methods: dict[str, tuple[Callable[[], Any], int]] = {"copy": (partial(dst.copy_, src), case.bytes)}
        methods.update(_dpvr_methods(case))
        methods.update(_torch_methods(case))
        methods.update(_opacus_methods(case))
        times = {name: _timer(fn, min_seconds, max_iters) for name, (fn, _) in methods.items()}
        copy_gbps = case.bytes / times["copy"] / 1e9
        for name, (_, nbytes) in methods.items():
            gbps = nbytes / times[name] / 1e9
            record = {
                "device": device,
                "size": size["name"],
                "batch": case.batch,
                "tensors": len(case.shapes),
                "params": case.params,
                "dtype": dtype,
                "method": name,
                "ms": times[name] * 1e3,
                "bytes": nbytes,
                "gbps": gbps,
                "vs_copy": gbps / copy_gbps,
            }
            if "step" in name and "opacus step" in times:
                record["vs_opacus"] = times["opacus step"] / times[name]
            records.append(record)
        del case, src, dst, methods
        torch.cuda.empty_cache()
    return records


def markdown(records: Sequence[dict[str, Any]]) -> str:
    """The records as a markdown table (for README.md)."""
    lines = [
        f"GPU: {records[0]['device']}" if records else "",
        "",
        "| size | B | tensors | method | ms | GB/s | vs copy | vs Opacus |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in records:
        vs_opacus = f"{r['vs_opacus']:.1f}x" if "vs_opacus" in r else ""
        cells = [r["size"], r["batch"], r["tensors"], r["method"], f"{r['ms']:.3f}", f"{r['gbps']:.0f}"]
        cells += [f"{100 * r['vs_copy']:.0f}%", vs_opacus]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)
