"""Record independence by construction in the front door: every refusal with a canary that shows the leak it
prevents (run through dpvr's gradient engine directly, where no front-door check stands in the way), and the
models that now train correctly instead (sequence-first layers, a tied output head) checked against
autograd on one record at a time."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dpvr
from dpvr.optim.gradients import ClippedGradients
from dpvr.trainer.losses import per_sample

CLIP = 1.0
COMMON = dict(algorithm="dp-sgd", epsilon=2.0, batch_size=8, steps=2, lr=0.1, clip=CLIP)


def _features(n: int = 48, d: int = 8, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, d, generator=g), torch.randint(0, 3, (n,), generator=g))


def _clipped_sum(model: nn.Module, loss, x, y, mode: str = "ghost") -> torch.Tensor:
    engine = ClippedGradients(model, loss, mode=mode)
    out = [torch.zeros(p.numel()) for p in model.parameters() if p.requires_grad]
    engine.sum(x, y, CLIP, out)
    return torch.cat(out)


def _norms(model: nn.Module, loss, x: torch.Tensor, y: torch.Tensor, mode: str) -> torch.Tensor:
    engine = ClippedGradients(model, loss, mode=mode)
    out = [torch.zeros(p.numel()) for p in model.parameters() if p.requires_grad]
    norms = torch.zeros(len(x))
    engine.sum(x, y, 1e30, out, norms=norms)
    return norms


def _alone_norms(model: nn.Module, loss, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for i in range(len(x)):
        grads = torch.autograd.grad(loss(model(x[i : i + 1])[0], y[i]), params, allow_unused=True)
        norms.append(torch.sqrt(sum(g.double().square().sum() for g in grads if g is not None)))
    return torch.stack(norms).float()


CE = per_sample(nn.CrossEntropyLoss())


# ---- modules that write what they see --------------------------------------------------------------------


def _instance_norm_model() -> nn.Module:
    torch.manual_seed(0)
    norm = nn.InstanceNorm1d(2, track_running_stats=True)
    return nn.Sequential(nn.Unflatten(1, (2, 4)), norm, nn.Flatten(), nn.Linear(8, 3))


def test_running_statistics_carry_a_canary_into_the_model_and_are_refused_until_fixed() -> None:
    data = _features()
    x, y = data.tensors
    canary = x.clone()
    canary[0] = 1000.0  # one record with a recognisable value
    leaky = _instance_norm_model()
    _clipped_sum(leaky, CE, canary[:8], y[:8])
    assert float(leaky[1].running_mean.abs().max()) > 10  # the canary's value, released without noise

    model = _instance_norm_model()
    with pytest.raises(ValueError, match="'1' \\(InstanceNorm1d\\).*running statistics"):
        dpvr.make_private(model, nn.CrossEntropyLoss(), data, **COMMON)
    assert dpvr.fix(model) == ["1: InstanceNorm1d track_running_stats=True -> False"]
    dpvr.make_private(model, nn.CrossEntropyLoss(), data, **COMMON).run()
    assert not list(model.buffers())


def test_a_module_that_writes_a_buffer_in_forward_is_refused_and_the_users_model_is_untouched() -> None:
    class Remembers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 3)
            self.register_buffer("seen", torch.zeros(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.add_(x.detach().sum(0))
            return self.linear(x)

    data = _features()
    leaky = Remembers()
    _clipped_sum(leaky, CE, *[t[:8] for t in data.tensors])
    assert float(leaky.seen.abs().sum()) > 0  # the batch's sum, in the released state_dict

    model = Remembers()
    with pytest.raises(ValueError, match="writes seen \\(of the model\\)"):
        dpvr.make_private(model, nn.CrossEntropyLoss(), data, **COMMON)
    assert float(model.seen.abs().sum()) == 0  # the checks ran on a copy


def test_embedding_max_norm_renormalises_private_rows_and_is_refused_before_any_forward() -> None:
    torch.manual_seed(0)
    leaky = nn.Embedding(20, 4, max_norm=0.5)
    before = leaky.weight.detach().clone()
    leaky(torch.tensor([7]))
    moved = (leaky.weight.detach() - before).abs().sum(1).nonzero().flatten().tolist()
    assert moved == [7]  # the weights now show that a record held token 7

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 4, max_norm=0.5), nn.Flatten(), nn.Linear(12, 3))
    weights = model[0].weight.detach().clone()
    g = torch.Generator().manual_seed(1)
    tokens = TensorDataset(torch.randint(0, 20, (48, 3), generator=g),
                           torch.randint(0, 3, (48,), generator=g))
    with pytest.raises(ValueError, match="max_norm"):
        dpvr.make_private(model, nn.CrossEntropyLoss(), tokens, **COMMON)
    assert torch.equal(model[0].weight.detach(), weights)


def test_batch_norm_is_refused_with_its_fix_and_fix_makes_the_model_trainable() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    data = _features()
    x, y = data.tensors
    # The leak: in training mode one record's value moves every other record's output (the gradient
    # engines refuse the layer themselves; the front door names it with its fix).
    changed = x[:8].clone()
    changed[0] = 50.0
    assert not torch.allclose(model(x[:8])[1:], model(changed)[1:], atol=1e-2)
    findings = dpvr.validate(model)
    assert [(f.module, f.refused) for f in findings] == [("1", True)]
    with pytest.raises(ValueError, match="BatchNorm1d.*GroupNorm"):
        dpvr.make_private(model, nn.CrossEntropyLoss(), data, **COMMON)
    assert dpvr.fix(model) == ["1: BatchNorm1d(16) -> GroupNorm(8, 16)"]
    assert isinstance(model[1], nn.GroupNorm) and not dpvr.validate(model)
    dpvr.make_private(model, nn.CrossEntropyLoss(), data, **COMMON).run()


def test_validate_names_modules_without_a_ghost_rule_as_slow() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w

    findings = dpvr.validate(nn.Sequential(Scale(), nn.Linear(8, 3)))
    assert [(f.module, f.kind, f.refused) for f in findings] == [("0", "Scale", False)]


# ---- records that influence each other -----------------------------------------------------------------


class _CentredInTraining(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(8, 3)
        self.dropout = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            x = x - x.mean(0)
        return self.linear(self.dropout(x))


def test_mixing_only_in_training_mode_moves_others_gradients_and_is_refused() -> None:
    data = _features()
    x, y = data.tensors
    model = _CentredInTraining().eval()
    alone = torch.cat([model(x[i : i + 1]) for i in range(4)])
    assert torch.allclose(model(x[:4]), alone)  # in evaluation mode: independent
    model.train()
    changed = x[:8].clone()
    changed[0] = 100.0
    torch.manual_seed(1)
    a = _clipped_sum(model, CE, x[:8], y[:8])
    torch.manual_seed(1)
    b = _clipped_sum(model, CE, changed, y[:8])
    assert float((a - b).norm()) > 2 * CLIP  # one record moved the sum beyond the sensitivity bound
    with pytest.raises(ValueError, match="in training mode, a record's output depends on the other records"):
        dpvr.make_private(_CentredInTraining(), nn.CrossEntropyLoss(), data, **COMMON)


def test_dropout_alone_is_accepted() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        trainer = dpvr.make_private(model, nn.CrossEntropyLoss(), _features(), **COMMON)
    assert trainer.algorithm.gradients.mode == "ghost"


def _mixup(batch):
    x, y = torch.utils.data.default_collate(batch)
    return 0.7 * x + 0.3 * x.roll(1, 0), y


def test_a_mixing_collate_moves_two_clipped_terms_and_is_refused_even_when_declared() -> None:
    data = _features()
    x, y = data.tensors
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    records = [data[i] for i in range(8)]
    neighbour = [(torch.full((8,), 30.0), records[0][1]), *records[1:]]
    xa, ya = _mixup(records)
    xb, yb = _mixup(neighbour)
    assert int((xa != xb).any(1).sum()) == 2  # the changed record reaches a second record's input
    # Two clipped terms move, each by up to 2C: the replace-one bound 2C no longer holds.
    terms = [float((_clipped_sum(model, CE, xa[i : i + 1], ya[i : i + 1])
                    - _clipped_sum(model, CE, xb[i : i + 1], yb[i : i + 1])).norm()) for i in range(8)]
    assert sum(t > 0.1 for t in terms) == 2
    with pytest.raises(ValueError, match="mixup"):
        dpvr.make_private(model, nn.CrossEntropyLoss(), DataLoader(data, collate_fn=_mixup), **COMMON)
    with pytest.raises(ValueError, match="declared record-wise, but"):
        dpvr.make_private(model, nn.CrossEntropyLoss(), DataLoader(data, collate_fn=dpvr.recordwise(_mixup)),
                          **COMMON)


def test_pad_collate_pads_to_a_public_length_record_by_record() -> None:
    collate = dpvr.pad_collate(4, value=-1)
    x, y = collate([(torch.tensor([1, 2]), 0), (torch.tensor([3, 4, 5, 6, 7]), 1)])
    assert x.tolist() == [[1, 2, -1, -1], [3, 4, 5, 6]] and y.tolist() == [0, 1]
    assert x[0].tolist() == collate([(torch.tensor([1, 2]), 0)])[0][0].tolist()


# ---- gradients the rules would miss ---------------------------------------------------------------------


class _SequenceFirst(nn.Module):
    """Batch-first at its boundary, sequence-first inside (as torch's transformer layers are by default)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner = nn.Linear(2, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.inner(x.transpose(0, 1))).mean(0))


def test_a_sequence_first_layer_at_batch_size_equal_to_length_is_read_per_record() -> None:
    """A shape check at one batch size would read a sequence-first layer's positions as records when the
    batch is as long as the sequence (per-position gradients: sensitivity several times the bound); the
    clipper learns each position-wise layer's batch dimension from two batch sizes instead."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 8, 2, generator=g), torch.randint(0, 3, (48,), generator=g))
    x, y = data.tensors
    model = _SequenceFirst()
    truth = _alone_norms(model, CE, x[:8], y[:8])
    ghost = _norms(model, CE, x[:8], y[:8], "ghost")  # batch 8 == length 8
    torch.testing.assert_close(ghost, truth, rtol=1e-4, atol=1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        trainer = dpvr.make_private(model, nn.CrossEntropyLoss(), data,
                                    runtime=dpvr.RuntimeConfig(grad_mode="ghost"), **COMMON)
    assert trainer.algorithm.gradients.mode == "ghost"


def test_torchs_transformer_layer_in_its_default_sequence_first_layout_clips_per_record() -> None:
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embedding = nn.Embedding(20, 8)
            self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0)  # batch_first=False
            self.head = nn.Linear(8, 3)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.layer(self.embedding(tokens.transpose(0, 1))).mean(0))

    model = Encoder().double()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 20, (8, 8), generator=g), torch.randint(0, 3, (8,), generator=g)
    loss = per_sample(nn.CrossEntropyLoss())
    engine = ClippedGradients(model, loss, mode="ghost")
    out = [torch.zeros(p.numel(), dtype=torch.float64) for p in model.parameters()]
    norms = torch.zeros(8, dtype=torch.float64)
    engine.sum(x, y, 1e30, out, norms=norms)
    params = list(model.parameters())
    alone = [torch.autograd.grad(loss(model(x[i : i + 1])[0], y[i]), params) for i in range(8)]
    truth = torch.stack([torch.sqrt(sum(t.square().sum() for t in grads)) for grads in alone])
    torch.testing.assert_close(norms, truth, rtol=1e-10, atol=0)
    for k, total in enumerate(out):
        expected = sum(grads[k] for grads in alone).reshape(-1)
        torch.testing.assert_close(total, expected, rtol=1e-10, atol=1e-13)


class _TiedHead(nn.Module):
    """GPT-2's pattern: the output head reads the embedding's weight through ``F.linear``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(12, 6)
        self.mix = nn.Linear(6, 6)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.mix(self.embedding(tokens))).mean(1)
        return F.linear(hidden, self.embedding.weight)


def test_a_tied_head_loses_its_gradient_term_under_hooks_and_is_run_exactly() -> None:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, 12, (48, 5), generator=g), torch.randint(0, 12, (48,), generator=g))
    x, y = data.tensors
    model = _TiedHead()
    truth = _alone_norms(model, CE, x[:6], y[:6])
    ghost = _norms(model, CE, x[:6], y[:6], "ghost")
    assert float(((ghost - truth).abs() / truth).max()) > 0.01
    with pytest.raises(ValueError, match="'embedding.weight'.*tied"):
        dpvr.make_private(model, nn.CrossEntropyLoss(), data, runtime=dpvr.RuntimeConfig(grad_mode="ghost"),
                          **COMMON)
    with pytest.warns(UserWarning, match="materialised"):
        trainer = dpvr.make_private(model, nn.CrossEntropyLoss(), data, **COMMON)
    assert trainer.algorithm.gradients.mode == "materialised"
    torch.testing.assert_close(_norms(model, CE, x[:6], y[:6], "materialised"), truth, rtol=1e-4, atol=1e-6)


# ---- losses -------------------------------------------------------------------------------------------


def test_a_class_weighted_mean_is_rewritten_with_a_public_normaliser() -> None:
    weight = torch.tensor([1.0, 5.0, 0.2])
    criterion = nn.CrossEntropyLoss(weight=weight)
    output, target = torch.randn(3), torch.tensor(1)
    naive = criterion(output[None], target[None])  # on one record the weight cancels: it silently vanishes
    torch.testing.assert_close(naive, F.cross_entropy(output[None], target[None]))
    with pytest.warns(UserWarning, match="averaged over the batch size"):
        loss = per_sample(criterion)
    torch.testing.assert_close(loss(output, target), 5.0 * naive)
    data = TensorDataset(torch.randn(48, 8), torch.zeros(48, dtype=torch.long))  # records share a class
    with pytest.warns(UserWarning, match="total class weight"):
        dpvr.make_private(nn.Linear(8, 3), criterion, data, **COMMON)


def _zero_features(n: int = 48, d: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.zeros(n, d), torch.randint(0, 3, (n,), generator=g))


def test_identical_private_records_cannot_make_a_mixing_module_pass() -> None:
    """All-zero probe records: replacing some of them by *other private records* (also zero) leaves the batch
    mean at zero, so the old check passed the training-mode centring module; yet one record replaced in a
    batch of 8 moves the clipped sum by 2.94 where 2C = 2 is priced. The replacements are now synthetic:
    refused."""
    data = _zero_features()
    x, y = data.tensors
    model = _CentredInTraining().train()
    changed = x[:8].clone()
    changed[0] = 100.0
    torch.manual_seed(1)
    a = _clipped_sum(model, CE, x[:8], y[:8])
    torch.manual_seed(1)
    b = _clipped_sum(model, CE, changed, y[:8])
    assert float((a - b).norm()) > 2 * CLIP  # 2.94: one replaced record moves the sum beyond the bound 2C
    with pytest.raises(ValueError, match="in training mode, a record's output depends on the other records"):
        dpvr.make_private(_CentredInTraining(), nn.CrossEntropyLoss(), data, **COMMON)


class _CentredInEvaluation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x - x.mean(0) if not self.training else x)


def test_identical_private_records_cannot_hide_mixing_in_evaluation_mode() -> None:
    """On all-zero records a record's output in a batch equals its output alone even when the module centres
    the batch; synthetic records of the probe's shape show the mixing."""
    with pytest.raises(ValueError, match="in evaluation mode, a record.s output depends on the other"):
        dpvr.make_private(_CentredInEvaluation(), nn.CrossEntropyLoss(), _zero_features(), **COMMON)


def test_synthetic_records_keep_shape_dtype_and_range_and_differ_from_a_constant_probe() -> None:
    from dpvr.trainer.checks import _synthetic

    model = nn.Sequential(nn.Embedding(50, 4))
    tokens = torch.full((8, 5), 7, dtype=torch.int32)
    drawn = _synthetic(model, tokens, 0)
    assert drawn.shape == tokens.shape and drawn.dtype == torch.int32
    assert int(drawn.min()) >= 7 and int(drawn.max()) <= 49 and len(drawn.unique()) > 1
    images = torch.rand(8, 1, 4, 4, dtype=torch.float64)
    drawn = _synthetic(model, images, 1)
    assert drawn.dtype == torch.float64 and float(drawn.min()) >= float(images.min())
    assert float(drawn.max()) <= float(images.max()) and not torch.equal(drawn, _synthetic(model, images, 2))
    zeros = _synthetic(model, torch.zeros(8, 3), 0)
    assert float(zeros.abs().max()) > 0.1  # a constant probe: the range is widened, never the probe itself


class _RoundsByBatchSize(nn.Module):
    """Independent records whose outputs move with the batch's size at reduced precision only: a stand-in for
    a GPU kernel that picks its algorithm (and so its rounding) by batch size under autocast or TF32."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 3)
        self.seen: list[tuple[bool, bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        reduced = (torch.is_autocast_enabled("cpu"), torch.get_float32_matmul_precision() != "highest",
                   torch.backends.cudnn.allow_tf32)
        self.seen.append(reduced)
        out = self.linear(x).float()
        return out + 1e-2 * len(x) if any(reduced) else out


@pytest.mark.parametrize("precision", ["autocast", "tf32", "medium"])
def test_the_checks_run_in_exact_float32_and_leave_the_callers_precision_as_it_was(precision: str) -> None:
    """Under the caller's autocast, TF32 or bfloat16 matmul passes a record's output in a batch and alone
    differ by rounding; the checks test structure in exact float32, so an independent model is accepted (it
    was refused), and the caller's settings are restored after, exactly."""
    from dpvr.trainer.checks import check_model

    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = torch.get_float32_matmul_precision(), cudnn.allow_tf32
    x, y = _features().tensors
    model = _RoundsByBatchSize()
    try:
        if precision == "tf32":
            matmul.allow_tf32 = cudnn.allow_tf32 = True
        if precision == "medium":
            torch.set_float32_matmul_precision("medium")
        before = torch.get_float32_matmul_precision(), cudnn.allow_tf32
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
            check_model(model, x[:16], y[:16], nn.CrossEntropyLoss())
            assert torch.is_autocast_enabled("cpu") == (precision == "autocast")
        assert (torch.get_float32_matmul_precision(), cudnn.allow_tf32) == before
    finally:
        torch.set_float32_matmul_precision(saved[0])
        cudnn.allow_tf32 = saved[1]
    assert model.seen == []  # the checks ran on a copy
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
        if precision != "autocast":
            torch.set_float32_matmul_precision("high" if precision == "tf32" else "medium")
        try:
            assert not torch.allclose(model(x[:4]), torch.cat([model(x[i : i + 1]) for i in range(4)]))
        finally:
            torch.set_float32_matmul_precision(saved[0])


def test_a_mixing_model_is_still_refused_under_the_callers_autocast() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.raises(ValueError, match="in evaluation mode, a record.s output depends on the other"):
        dpvr.make_private(_CentredInEvaluation(), nn.CrossEntropyLoss(), _zero_features(), **COMMON)


@pytest.mark.skipif(not hasattr(torch.backends, "fp32_precision"), reason="torch < 2.9: no such settings")
def test_the_checks_and_the_rounding_bounds_read_torchs_per_backend_precision_settings() -> None:
    """A caller on torch's per-backend precision settings (which make torch refuse its legacy getters): the
    checks set and restore those, and a run's rounding bound reads them (TF32's unit), instead of failing."""
    from dpvr.grads.ghost.norms import reduced_precision_unit
    from dpvr.trainer.checks import exact_float32

    b = torch.backends
    knobs = [b.cuda.matmul, b.cudnn.conv, b.mkldnn.matmul, b.mkldnn.conv]
    saved = [b.fp32_precision, *(k.fp32_precision for k in knobs)]
    try:
        b.fp32_precision = b.cuda.matmul.fp32_precision = "tf32"
        with pytest.raises(RuntimeError):
            torch.get_float32_matmul_precision()  # torch refuses the legacy getter in this state
        before = [k.fp32_precision for k in knobs]
        assert reduced_precision_unit(False, torch.device("cpu")) == 2.0 ** -11
        with exact_float32():
            assert [k.fp32_precision for k in knobs] == ["ieee"] * 4
            assert reduced_precision_unit(True, torch.device("cuda")) == 0.0
        assert [k.fp32_precision for k in knobs] == before
        b.mkldnn.matmul.fp32_precision = "bf16"
        assert reduced_precision_unit(False, torch.device("cpu")) == 2.0 ** -8
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        trainer = dpvr.make_private(model, nn.CrossEntropyLoss(), _features(), **COMMON)
        trainer.step()
    finally:
        b.fp32_precision = saved[0]
        for k, value in zip(knobs, saved[1:]):
            k.fp32_precision = value
