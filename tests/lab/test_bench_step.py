"""``dpvr bench step``: every case and method runs one tiny round, so the benchmark code cannot rot."""

from __future__ import annotations

import platform

import pytest
import torch

from dpvr_lab.bench import step

DPVR = ["dpvr-make-private-dp-sgd", "dpvr-dp-sgd-bare", "dpvr-dp-sgd-ghost", "dpvr-diff2-ghost",
        "dpvr-diff2-ghost-recompute", "dpvr-fresh-diff-ghost"]


@pytest.mark.slow  # a benchmark run
@pytest.mark.parametrize("case", step.CASES)
def test_each_case_times_every_method(case: str) -> None:
    records = step.run(cases=[case], repeats=1, quick=True, memory=True, batch=4)
    methods = [r.method for r in records]
    assert methods[0] == "non-private" and {"opacus-hooks-dp-sgd", "opacus-ghost-dp-sgd"} <= set(methods)
    assert set(DPVR) <= set(methods)
    assert ("dpvr-diff2-materialised" in methods) == (case == "mlp")
    assert len({r.dataset for r in records}) == 1 and records[0].dataset.endswith("/B=4/cpu")
    for r in records:
        if "skipped" in r.metrics:  # Opacus missing or refusing the model: the reason is recorded
            assert r.method.startswith("opacus") and r.metrics["skipped"]
            continue
        assert r.metrics["ms"] > 0 and r.metrics["ratio_vs_non_private"] > 0, r
        assert r.metrics["peak_mib"] > 0 and r.metrics["memory_vs_non_private"] > 0, r
        if r.method.startswith("dpvr"):
            assert 0 < r.metrics["native_share"] < 1, r
        assert ("ratio_vs_bare" in r.metrics) == (r.method == "dpvr-make-private-dp-sgd"), r


@pytest.mark.slow  # Opacus on a small GPT-2
def test_opacus_hooks_steps_the_gpt2_case() -> None:
    """The decoder passes one row of position ids per record (``transformers`` broadcasts one row over the
    batch, which Opacus' per-sample hooks cannot stack); Opacus' ghost clipping refuses the tied head."""
    import copy
    import warnings

    pytest.importorskip("opacus")
    case = step.make_case("gpt2", batch=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert callable(step._opacus_hooks(copy.deepcopy(case.model), case))
        assert "tying" in step._opacus_ghost(copy.deepcopy(case.model), case)


def test_the_sequence_exponents_are_fitted_per_gpt2_size() -> None:
    from dpvr.results import Record
    from dpvr_lab.bench import SCALE_CASES, SCALE_DEFAULT

    assert {"gpt2-1e8-t128", "gpt2-1e8-t512"} <= set(SCALE_CASES) - set(SCALE_DEFAULT)
    records = [Record(method="m", dataset=f"gpt2-14M-seq{t}/B=8/cpu",
                      metrics={"ms": 3.0 * t, "peak_mib": t**2, "batch": 8}) for t in (128, 512, 1024)]
    records += [Record(method="m", dataset=f"gpt2-124M-seq{t}/B=2/cpu",
                       metrics={"ms": 2 * t**1.5, "peak_mib": 2 * t**0.5, "batch": 2}) for t in (128, 512)]
    records += [Record(method="m", dataset="gpt2-2layer-seq64/B=64/cpu", metrics={"ms": 1.0, "batch": 64}),
                Record(method="m", dataset="gpt2-124M-seq9/B=2/cpu", metrics={"skipped": "no", "batch": 2})]
    fits = {name: (a, b) for name, a, b in step.sequence_scaling(records)}
    assert fits.keys() == {"m (gpt2-14M)", "m (gpt2-124M)"}  # one fit per model, never across them
    assert fits["m (gpt2-14M)"] == pytest.approx((1.0, 2.0))
    assert fits["m (gpt2-124M)"] == pytest.approx((1.5, 0.5))


@pytest.mark.slow  # a benchmark run
def test_the_plot_draws_every_case(tmp_path) -> None:
    records = step.run(cases=["mlp", "cnn"], repeats=1, quick=True, memory=True, batch=4)
    records = [r for r in records if not (r.dataset.startswith("cnn") and r.method.startswith("opacus"))]
    path = tmp_path / "step.png"
    step.plot(records, str(path))  # a case without one of the methods draws the others
    assert path.read_bytes().startswith(b"\x89PNG")


@pytest.mark.slow  # the step benchmark's machinery (performance, not privacy)
def test_the_diff2_round_reuses_its_recording() -> None:
    """The benchmarked full-batch DIFF2 round records one point; the recompute variant records two."""
    case = step.make_case("mlp", batch=4)
    fns, _ = step._methods(case)
    forwards = dict.fromkeys(("dpvr-diff2-ghost", "dpvr-diff2-ghost-recompute"), 0)
    for name in forwards:
        model = fns[name].__self__.model
        model.register_forward_pre_hook(lambda *_, name=name: forwards.__setitem__(name, forwards[name] + 1))
        fns[name]()
        fns[name]()
    assert forwards == {"dpvr-diff2-ghost": 2, "dpvr-diff2-ghost-recompute": 4}


@pytest.mark.slow  # a process per method
def test_each_method_runs_in_a_process_of_its_own() -> None:
    """``isolated``: one record per method, each timed against its own process's non-private step, and the
    ratios between methods are ratios of those ratios."""
    spec = {"name": "mlp", "batch": 4}
    methods = ["non-private", "opacus-ghost-dp-sgd", "dpvr-dp-sgd-ghost", "dpvr-diff2-ghost"]
    records = step.run_isolated(spec, repeats=1, warmup=1, share_rounds=1, methods=methods,
                                keep_freed_memory=True)
    assert [r.method for r in records] == methods
    assert len({r.dataset for r in records}) == 1
    got = {r.method: r.metrics for r in records}
    assert got["non-private"]["ratio_vs_non_private"] == 1.0 and got["non-private"]["ms"] > 0
    assert "max_rss_mib" not in got["non-private"]  # a process's peak, with the method timed there
    for name in methods[1:]:  # each process kept its freed memory (glibc), as asked
        assert got[name]["freed_memory"] == ("kept" if platform.libc_ver()[0] == "glibc" else "returned")
        assert got[name]["max_rss_mib"] > 10
    for name in methods[2:]:
        assert got[name]["ms"] > 0 and 0 < got[name]["native_share"] <= 1
        assert got[name]["ratio_vs_opacus_ghost"] == pytest.approx(
            got[name]["ratio_vs_non_private"] / got["opacus-ghost-dp-sgd"]["ratio_vs_non_private"])


def test_the_difference_rounds_are_timed_from_the_same_state() -> None:
    """Every timed difference round starts from the same two points and radius (its update writes buffers
    of its own), so a bench's later rounds time what its first did, never a diverging model."""
    case = step.make_case("mlp", batch=4)
    dpvr_step = step._restarted(case, reuse_recording=True)
    points = [p.detach().clone() for p in dpvr_step.model.parameters()]
    previous, move = [p.clone() for p in dpvr_step.prev], dpvr_step.move
    for _ in range(3):
        dpvr_step.diff_round()
        assert dpvr_step.move == move
        assert all(torch.equal(p, q) for p, q in zip(dpvr_step.model.parameters(), points))
        assert all(torch.equal(p, q) for p, q in zip(dpvr_step.prev, previous))
    assert not all(torch.equal(p, q.view(-1)) for p, q in zip(dpvr_step.stepped[0], points))  # the update ran


@pytest.mark.parametrize("case", ["mlp", "gpt2"])
def test_bare_and_make_private_steps_are_timed_on_batches_of_the_case_size(case: str) -> None:
    """The bare ``DPSGD`` and ``make_private`` columns time steps on B records, as every other column does
    (on Poisson batches their steps had 8, 13 and 11 records against B = 8), and on the same records step
    for step in both, so that ``ratio_vs_bare`` compares one work. Counted by the model's forward: one
    recording per step, whose input holds the step's batch."""
    import copy
    import warnings

    import torch

    bench = step.make_case(case, batch=4)
    seen: dict[str, list] = {}
    for method, build in (("make-private", step._make_private), ("bare", step._bare_dp_sgd)):
        model = copy.deepcopy(bench.model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn = build(model, bench)
        batches = seen[method] = []
        model.register_forward_pre_hook(lambda module, args, batches=batches: batches.append(args[0].clone()))
        for _ in range(5):
            fn()
    assert [len(x) for x in seen["bare"]] == [bench.batch] * 5
    assert [len(x) for x in seen["make-private"]] == [bench.batch] * 5
    assert all(torch.equal(a, b) for a, b in zip(seen["make-private"], seen["bare"]))
    assert len({tuple(x.flatten().tolist()) for x in seen["bare"]}) > 1  # drawn afresh at every step


@pytest.mark.slow  # the step benchmark's machinery (performance, not privacy)
def test_peak_memory_counts_a_steps_own_allocations() -> None:
    import torch

    from dpvr_lab.bench.timing import peak_bytes

    resident = torch.ones(1 << 20)
    assert peak_bytes(lambda: resident.sum()) < 1 << 16
    assert (1 << 24) <= peak_bytes(lambda: torch.ones(1 << 22) + 1) < 3 << 24  # two 16 MiB temporaries
    # A step that frees its previous call's block before allocating a new one: the free of a block from
    # before the call (even one allocated under an earlier profile) must not offset the new allocation.
    state = {"buffer": torch.ones(1 << 22)}

    def replace() -> None:
        state["buffer"] = None
        state["buffer"] = torch.ones(1 << 22)

    assert [peak_bytes(replace) >> 20 for _ in range(3)] == [16, 16, 16]


@pytest.mark.slow  # the step benchmark's machinery (performance, not privacy)
def test_ghost_steps_hold_little_beyond_a_non_private_step() -> None:
    """Peak memory of the CNN's private steps (allocations, deterministic): a recording's tensors are freed
    once they are not needed — a layer's outputs after the forward, a materialised layer's inputs and
    output gradients once its per-sample matrices are formed (before the second point is recorded)."""
    import warnings

    from dpvr_lab.bench.timing import peak_bytes

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fns, _ = step._methods(step.make_case("cnn", 32))
    peaks = {}
    for name in ("non-private", "dpvr-dp-sgd-ghost", "dpvr-fresh-diff-ghost"):
        fns[name]()
        peaks[name] = peak_bytes(fns[name])
    assert peaks["dpvr-dp-sgd-ghost"] <= 1.3 * peaks["non-private"]
    assert peaks["dpvr-fresh-diff-ghost"] <= 1.5 * peaks["non-private"]


@pytest.mark.slow  # a benchmark run
def test_the_memory_bench_times_each_method_at_each_physical_batch() -> None:
    from dpvr_lab.bench import memory

    records = memory.run(case="mlp", logical=512, physicals=(128, 512), repeats=1)
    assert {r.metrics.get("physical") for r in records if "skipped" not in r.metrics} == {128, 512}
    dpvr_peaks = {r.metrics["physical"]: r.metrics["peak_mib"] for r in records
                  if r.method == "dpvr-dp-sgd-ghost"}
    assert dpvr_peaks[128] < dpvr_peaks[512]  # the micro-batch sets the peak
    assert all(r.metrics["ms"] > 0 for r in records if "skipped" not in r.metrics)


@pytest.mark.slow  # spawns two processes
def test_the_parallel_bench_times_one_and_two_processes() -> None:
    from dpvr_lab.bench import parallel

    one, two = parallel.run(case="mlp", batch=64, steps=2)
    assert one.metrics["ms"] > 0 and two.metrics["ms"] > 0
    assert two.metrics["ratio_vs_one_process"] == pytest.approx(two.metrics["ms"] / one.metrics["ms"])


def test_methods_that_materialise_are_skipped_where_the_per_sample_gradients_cannot_fit(monkeypatch) -> None:
    """Opacus' hooks and the materialised round hold B x d numbers: on a host with too little memory they are
    recorded as skipped, with the sizes, instead of the benchmark being killed."""
    case = step.make_case("mlp")  # 512 x 234k float32: 0.45 GiB
    gib = 2**30

    def host(total: int):
        monkeypatch.setattr(step.os, "sysconf", lambda name: {"SC_PAGE_SIZE": 4096}.get(name, total // 4096))

    host(64 * gib)
    assert step._too_large_to_materialise(case) is None
    host(1 * gib)
    why = step._too_large_to_materialise(case)
    assert why is not None and "512 x" in why and "0.4 GiB" in why and "1 GiB" in why


def test_the_scale_figure_draws_time_and_memory_against_the_length(tmp_path) -> None:
    from dpvr.results import Record

    records = [Record(method=m, dataset=f"gpt2-{size}-seq{t}/B=2/cpu",
                      metrics={"ms": k * t, "peak_mib": k * t / 10, "batch": 2})
               for k, m in enumerate(("non-private", "dpvr-dp-sgd-ghost", "opacus-hooks-dp-sgd"), start=1)
               for size in ("14M", "124M") for t in (128, 512)]
    records.append(Record(method="dpvr-diff2-ghost", dataset="gpt2-14M-seq128/B=2/cpu",
                          metrics={"skipped": "x"}))  # a method without a time draws nothing
    path = tmp_path / "scale.png"
    step.scale_plot(records, str(path))
    assert path.stat().st_size > 10_000


def test_the_real_cases_have_the_sizes_users_train() -> None:
    """GPT-2 small, ResNet-18 and BERT-base at their published sizes (built on the meta device: no memory),
    and each case's batch and sequence length as the issue names them."""
    import torch

    from dpvr_lab.bench import REAL_CASES

    sizes = {}
    for kind in ("gpt2-small", "resnet18", "bert-base"):
        with torch.device("meta"):
            model, length = step.real_model(kind)
        sizes[kind] = (sum(p.numel() for p in model.parameters()), length)
        assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    # GPT-2 small: 124.4M with its 1024 positions, here 512; BERT-base: 109.5M with 512 positions, here 128.
    assert sizes == {"gpt2-small": (124_046_592, 512), "resnet18": (11_173_962, 0),
                     "bert-base": (109_188_866, 128)}
    batches = {name: (step._REAL[name][0], step._REAL[name][1]) for name in REAL_CASES}
    assert batches == {"gpt2-small-b16": ("gpt2-small", 16), "gpt2-small-b32": ("gpt2-small", 32),
                       "resnet18-b256": ("resnet18", 256), "resnet18-b1024": ("resnet18", 1024),
                       "bert-base-b32": ("bert-base", 32)}
    with torch.device("meta"):
        gpt2, _ = step.real_model("gpt2-small")
    head, embedding = gpt2.gpt2.lm_head.weight, gpt2.gpt2.transformer.wte.weight
    assert head is embedding  # the tied head


def test_only_real_cases_have_a_reduced_size() -> None:
    with pytest.raises(ValueError, match="reduced: only the real cases"):
        step.make_case("mlp", reduced=True)


@pytest.mark.slow  # a benchmark run (15-35 s: three reduced models, six methods each)
@pytest.mark.parametrize("autocast", [None, "bf16"])
def test_each_real_case_runs_reduced_on_the_cpu(autocast) -> None:
    """Every real case at its reduced size times the non-private step, both Opacus steps (or records why
    Opacus refuses) and dpvr's DP-SGD, make_private and DIFF2 steps, with peak memory; under bf16 autocast
    the forward runs in bfloat16 while dpvr's sums stay float32."""
    import torch

    from dpvr_lab.bench import REAL_CASES

    dtype = torch.bfloat16 if autocast else None
    cases = ["gpt2-small-b16", "resnet18-b256", "bert-base-b32"]
    records = step.run(cases=cases, repeats=1, quick=True, memory=True, reduced=True, autocast=dtype)
    assert set(cases) <= set(REAL_CASES)
    for label in {r.dataset for r in records}:
        methods = {r.method: r.metrics for r in records if r.dataset == label}
        assert set(methods) == set(step.REAL_METHODS), label
        assert label.endswith("/cpu" + ("/autocast-bfloat16" if autocast else "")), label
        for method, metrics in methods.items():
            if "skipped" in metrics:  # Opacus refusing the model (tied head, bf16 gradients): the reason
                assert method.startswith("opacus") and metrics["skipped"], (label, method)
                continue
            assert metrics["ms"] > 0 and metrics["peak_mib"] > 0, (label, method)
            assert metrics["autocast"] == ("bfloat16" if autocast else None)
    batches = {r.dataset.split("/")[0]: r.metrics["batch"] for r in records}
    assert batches == {"gpt2-small-reduced-lm-seq32": 4, "resnet18-reduced-32x32": 4,
                       "bert-base-reduced-seq16": 4}


def test_a_case_under_autocast_runs_its_forward_in_bfloat16() -> None:
    """The benchmark's autocast region reaches the model: the recorded dtype of a Linear's output."""
    import torch

    case = step.make_case("bert-base-b32", reduced=True, autocast=torch.bfloat16)
    seen = []
    layer = case.model.bert.classifier
    layer.register_forward_hook(lambda module, args, output: seen.append(output.dtype))
    fns, _ = step._methods(case, ["non-private", "dpvr-dp-sgd-ghost"])
    seen.clear()
    for fn in fns.values():
        fn()
    assert seen and set(seen) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in case.model.parameters())


@pytest.mark.gpu
def test_make_private_dp_sgd_steps_without_host_syncs_on_cuda() -> None:
    """On CUDA a make_private DP-SGD step makes the host wait for the device nowhere (torch's sync debug
    mode counts reads of device values); its non-finite count is a 0-d device tensor holding the count,
    and a batch whose every record is NaN still warns, at a later sum, from the count's pinned copy."""
    import warnings

    import torch
    from torch.utils.data import TensorDataset

    from dpvr import make_private
    from dpvr.optim.gradients import ClippedGradients
    from dpvr.trainer.losses import per_sample
    from dpvr_lab.bench.timing import host_syncs

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).cuda()
    x, y = torch.randn(256, 8), torch.randint(0, 2, (256,))
    trainer = make_private(model, torch.nn.CrossEntropyLoss(), TensorDataset(x, y), algorithm="dp-sgd",
                           epsilon=8.0, batch_size=64, steps=100, clip=1.0,
                           optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.step()  # warm-up: first-step allocations
    syncs, sites = host_syncs(trainer.step, rounds=3)
    assert syncs == 0, sites
    info = trainer.step()
    assert isinstance(info["nonfinite"], torch.Tensor) and info["nonfinite"].device.type == "cuda"
    assert int(info["nonfinite"]) == 0

    # A batch whose every record is NaN: make_private refuses such data when it is built (its loss check),
    # so the warning is the gradient engine's, on a device count read later from its pinned copy.
    engine = ClippedGradients(model, per_sample(torch.nn.CrossEntropyLoss()), mode="ghost")
    nan = torch.full((64, 8), float("nan"), device="cuda")
    labels = torch.randint(0, 2, (64,), device="cuda")
    out = [torch.zeros(p.numel(), device="cuda") for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counts = []
        for _ in range(3):
            counts.append(engine.sum(nan, labels, 1.0, out, replace=True))
            torch.cuda.synchronize()  # the copies have arrived: the next sum's check reads them
    assert [int(c) for c in counts] == [64, 64, 64]
    assert sum("non-finite gradients and were dropped" in str(w.message) for w in caught) == 1


def test_explain_lists_every_linear_maps_form_and_the_native_share() -> None:
    from dpvr.grads.ghost import cost

    text = step.explain(cases=["cnn"], batch=4, rounds=1)
    rows = [line.split() for line in text.splitlines()[2:]]
    # the two convolutions and the two linear layers, with B = 4 and a form of the cost model each
    assert [r[0] for r in rows] == ["0.weight", "3.weight", "7.weight", "9.weight"]
    assert all(r[1] == "4" and r[5] in cost.FORMS for r in rows)
    # the clipped sum's form beside it: the matrices' own for a materialised part, else a SUM_FORMS one
    assert all(r[6] == "materialised" if r[5] == "materialise" else r[6] in cost.SUM_FORMS for r in rows)
    assert [r[2] for r in rows[2:]] == ["1", "1"] and all(r[7] == "-" for r in rows[2:])  # no steps
    share = float(text.splitlines()[0].rsplit(" ", 1)[1])
    assert 0.0 < share < 1.0
    with pytest.raises(ValueError, match="host only"):
        step.explain(cases=["cnn"], device="cuda")
