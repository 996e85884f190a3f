"""Where one step's time goes: every method of ``dpvr bench step`` under torch's profiler.

    python bench/step_profile.py [--device cuda] [--case cnn] [--rounds 5] [--autocast bf16] [--reduced]

The real cases (``dpvr bench step --real``: ``--case gpt2-small-b16`` ...) profile the methods they time;
``--reduced`` runs them at their small size (dry runs), ``--autocast bf16`` every step under bf16 autocast.

For each method: wall ms per step, device kernels launched per step and their summed device time (CUDA only),
and the operators with the most host time (self time, summed over the rounds). On a GPU a step whose kernels
take a fraction of its wall time is bound by the host: Python, operator dispatch and launches.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from dpvr_lab.bench import REAL_CASES, step


def profile_method(fn, rounds: int, on_cuda: bool) -> tuple[float, float, float, list[tuple[str, float]]]:
    """(wall ms, kernels per step, device ms per step, top host operators) over ``rounds`` steps."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    fn()
    sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(rounds):
            fn()
        sync()
        wall = (time.perf_counter() - start) * 1e3 / rounds
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    device_ms = sum(e.device_time_total for e in kernels) / 1e3 / rounds if on_cuda else 0.0
    top = sorted(prof.key_averages(), key=lambda a: a.self_cpu_time_total, reverse=True)[:6]
    top_ms = [(a.key, a.self_cpu_time_total / 1e3 / rounds) for a in top]
    return wall, len(kernels) / rounds, device_ms, top_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--case", default="all", choices=[*step.CASES, *REAL_CASES, "all"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--autocast", choices=["none", "bf16"], default="none")
    parser.add_argument("--reduced", action="store_true", help="a real case at its small size")
    args = parser.parse_args()
    on_cuda = args.device == "cuda"
    autocast = torch.bfloat16 if args.autocast == "bf16" else None
    for name in step.CASES if args.case == "all" else (args.case,):
        real = name in REAL_CASES
        case = step.make_case(name, device=args.device, reduced=args.reduced and real, autocast=autocast)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fns, _ = step._methods(case, step.REAL_METHODS if real else None)
            print(f"\n## {case.label}")
            print("| method | wall ms | kernels | device ms | busy | top host operators (ms per step) |")
            print("| --- | ---: | ---: | ---: | ---: | --- |")
            for method, fn in fns.items():
                if method == "dpvr-diff2-materialised":
                    continue
                wall, kernels, device_ms, top = profile_method(fn, args.rounds, on_cuda)
                ops = ", ".join(f"{k} {ms:.2f}" for k, ms in top)
                busy = device_ms / wall
                print(f"| {method} | {wall:.2f} | {kernels:.0f} | {device_ms:.2f} | {busy:.0%} | {ops} |")


if __name__ == "__main__":
    main()
