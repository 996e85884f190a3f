"""``dpvr bench kernels|step``: measured ratios, printed as a table and optionally written as JSON."""

from __future__ import annotations

import argparse

from ..results import Record, document, format_table, write_json
from ._lab import available, lab
from .flags import with_default


def register(commands: argparse._SubParsersAction) -> None:
    # Without dpvr-lab any case name parses, so that running it says what to install.
    cases = lab("bench", "bench") if available() else None
    case_names = [*cases.CASES, *cases.SCALE_CASES, *cases.REAL_CASES, "all"] if cases else None
    p = commands.add_parser(
        "bench",
        help="benchmark the kernels, a full DP step, or a step's memory against the physical batch",
        description="Time the fused kernels or a full DP step against their references and print the ratios.",
    )
    p.add_argument(
        "what",
        choices=["kernels", "step", "memory", "parallel"],
        help="the fused kernels, a full DP step, one logical step at each physical batch size, or a "
        "data-parallel step on two gloo processes against one process",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help=with_default("where to run the kernels", "cpu"),
    )
    p.add_argument("--quick", action="store_true", help="one small size (seconds)")
    p.add_argument(
        "--repeats", type=int, default=7, help=with_default("timed runs per case (the median is kept)", 7)
    )
    p.add_argument(
        "--case",
        choices=case_names,
        default="all",
        help=with_default(
            "step: the model (an MLP, a small CNN, a small transformer encoder, an LSTM classifier, a small "
            "GPT-2 from transformers)",
            "all",
        ),
    )
    _step_arguments(p)
    p.add_argument(
        "--logical", type=int, default=1024,
        help=with_default("memory: the logical (accounted) batch; the case is --case, default cnn", 1024),
    )
    p.add_argument("--json", metavar="FILE", help="write the records to FILE")
    p.set_defaults(run=run)



def _step_arguments(p: argparse.ArgumentParser) -> None:
    """The flags only ``bench step`` reads."""
    p.add_argument(
        "--memory", action="store_true", help="step: add each step's peak tensor memory and its ratios"
    )
    p.add_argument(
        "--one-process", action="store_true",
        help="step: time every method in this process, interleaved, instead of each in a process of its "
        "own against a non-private step interleaved with it there (methods sharing a process share its "
        "heap and caches, which no user's training does)",
    )
    p.add_argument(
        "--keep-freed-memory", action="store_true",
        help="step: every timing process first lets the C library keep freed memory for reuse "
        "(dpvr.ops.keep_freed_memory: fewer page faults, more resident memory; glibc only)",
    )
    p.add_argument(
        "--scale", action="store_true",
        help="step: the cases that grow instead (a 10^7-parameter MLP and ResNet-style CNN, a 1.4 * 10^7 "
        "GPT-2 at sequence lengths 128, 512 and 1024; minutes), with time and memory fitted against T per "
        "GPT-2 size; GPT-2 small's shape (1.24 * 10^8 parameters: gpt2-1e8-t128, gpt2-1e8-t512) is not in "
        "this set and runs only with --case",
    )
    p.add_argument(
        "--real", action="store_true",
        help="step: the models at the sizes users train on a GPU instead (GPT-2 small as a language model, "
        "T = 512, B = 16 and 32; ResNet-18 with GroupNorm on 32x32 images, B = 256 and 1024; a BERT-base "
        "classifier, T = 128, B = 32), each against non-private and Opacus; one of them with --case",
    )
    p.add_argument(
        "--reduced", action="store_true",
        help="step: the real cases (--real, or one with --case) at a small size, same architectures (seconds "
        "on a CPU: tests and dry runs)",
    )
    p.add_argument(
        "--autocast", choices=["none", "bf16"], default="none",
        help=with_default("step: run every method's step under torch.autocast in bfloat16, the parameters "
                          "and dpvr's norms and clipped sums staying float32", "none"),
    )
    p.add_argument(
        "--explain", action="store_true",
        help="step: instead of timing, print per layer the shapes, the norm form the ghost clipper chose, "
        "the predicted times of every form, and the native share of dpvr's DP-SGD step (host only)",
    )
    p.add_argument("--plot", metavar="PNG", help="step: also plot the methods' ratios and targets to PNG")

def run(args: argparse.Namespace) -> int:
    host = lab("bench.host", "bench")
    if args.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    if args.explain and args.what != "step":
        raise ValueError("--explain: only 'bench step' explains its choices")
    if args.plot and args.what != "step":
        raise ValueError("--plot: only 'bench step' draws a figure")
    if args.what != "step" and (args.real or args.reduced or args.autocast != "none"):
        raise ValueError("--real, --reduced, --autocast: only 'bench step' takes them")
    if args.device == "cuda" and args.what == "kernels":
        return _run_cuda(args)
    runs = {"step": _step, "parallel": _parallel, "memory": _memory, "kernels": _kernels}
    measured = runs[args.what](args)
    if measured is None:  # explained, not timed
        return 0
    records, headers, metrics = measured
    rows = [[r.dataset, r.method, *(r.metrics.get(m) for m in metrics)] for r in records]
    print(host.line())
    print(format_table(headers, rows))
    if args.json:
        settings = vars(args) | {"run": None, "host": host.describe()}
        write_json(args.json, document(f"bench-{args.what}", settings, records))
    return 0


_Measured = tuple[list[Record], list[str], list[str]]  # the records, the table's headers and their metrics


def _step(args: argparse.Namespace) -> _Measured | None:
    bench, step = lab("bench", "bench"), lab("bench.step", "bench")
    if args.scale and args.real:
        raise ValueError("--scale, --real: choose one set of cases")
    real = bench.REAL_CASES
    everything = real if args.real else bench.SCALE_DEFAULT if args.scale else bench.CASES
    cases = everything if args.case == "all" else (args.case,)
    if args.reduced and not set(cases) <= set(real):
        raise ValueError(f"--reduced: only the real cases have a reduced size ({', '.join(real)}); "
                         f"got {', '.join(c for c in cases if c not in real)}")
    if args.explain:
        print(step.explain(cases=cases, device=args.device, reduced=args.reduced))
        return None
    import torch  # here only: the command line starts without torch

    autocast = torch.bfloat16 if args.autocast == "bf16" else None
    records = step.run(cases=cases, quick=args.quick, repeats=args.repeats, memory=args.memory,
                       device=args.device, reduced=args.reduced, autocast=autocast,
                       isolated=not args.one_process, keep_freed_memory=args.keep_freed_memory)
    headers = ["case", "method", "ms", "x non-private", "x opacus ghost", "x opacus hooks"]
    metrics = ["ms", "ratio_vs_non_private", "ratio_vs_opacus_ghost", "ratio_vs_opacus_hooks"]
    headers.append("host syncs" if args.device == "cuda" else "native share")
    metrics.append("host_syncs" if args.device == "cuda" else "native_share")
    if args.memory:
        headers += ["peak MiB", "mem x non-private", "mem x opacus ghost"]
        metrics += ["peak_mib", "memory_vs_non_private", "memory_vs_opacus_ghost"]
    if not args.one_process:
        headers.append("process max RSS MiB")
        metrics.append("max_rss_mib")
    if args.plot:
        step.plot(records, args.plot)
    fits = step.sequence_scaling(records)
    if fits:
        print(format_table(["method", "time ~ T^a", "peak memory ~ T^b"], [[m, a, b] for m, a, b in fits]))
    return records, [*headers, "note"], [*metrics, "skipped"]


def _parallel(args: argparse.Namespace) -> _Measured:
    parallel = lab("bench.parallel", "bench")
    records = parallel.run(case="mlp" if args.case == "all" else args.case, steps=args.repeats)
    return records, ["case", "method", "ms", "x one process"], ["ms", "ratio_vs_one_process"]


def _memory(args: argparse.Namespace) -> _Measured:
    memory = lab("bench.memory", "bench")
    physicals = [args.logical // k for k in (8, 4, 2, 1) if args.logical % k == 0]
    records = memory.run(case="cnn" if args.case == "all" else args.case, logical=args.logical,
                         physicals=physicals, repeats=args.repeats)
    return (records, ["case", "method", "ms", "peak MiB", "mem x logical", "note"],
            ["ms", "peak_mib", "memory_vs_logical", "skipped"])


def _kernels(args: argparse.Namespace) -> _Measured:
    kernels = lab("bench.kernels", "bench")
    records = kernels.run(quick=args.quick, repeats=args.repeats)
    return (records, ["case", "method", "ms", "GB/s", "of roofline", "vs torch", "vs opacus"],
            ["ms", "gbps", "roofline_fraction", "speedup_vs_torch_eager", "speedup_vs_opacus"])


def _run_cuda(args: argparse.Namespace) -> int:
    cuda_kernels = lab("bench.cuda_kernels", "bench")

    raw = cuda_kernels.run(min_seconds=0.05 if args.quick else 0.2)
    print(cuda_kernels.markdown(raw))
    if args.json:
        records = [Record(method=r["method"], dataset=f"{r['size']}/B={r['batch']}", metrics=r) for r in raw]
        write_json(args.json, document(f"bench-{args.what}-cuda", vars(args) | {"run": None}, records))
    return 0
