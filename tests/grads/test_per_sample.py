"""Per-sample gradients (dpvr.grads) against a plain loop of torch.autograd.grad, in float64 (and float32 at
two points), equal up to a rounding bound."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dpvr.grads import per_sample_grads, per_sample_grads_at_two_points, trainable_parameters
from dpvr.grads.materialized import _chunk_size
from dpvr.optim.gradients import ClippedGradients

BATCH = 10


def cross_entropy(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output, target)


def squared(output: Tensor, target: Tensor) -> Tensor:
    return 0.5 * (output.squeeze(-1) - target) ** 2


class TokenClassifier(nn.Module):
    """Embedding → LayerNorm → mean over the sequence → Linear; the embedding of token 0 is unused."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(12, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.norm(self.embedding(tokens)).mean(dim=1))


def mlp() -> tuple[nn.Module, Tensor, Tensor]:
    model = nn.Sequential(nn.Linear(5, 8), nn.Softplus(), nn.Linear(8, 1))
    return model, torch.randn(BATCH, 5), torch.randn(BATCH)


def cnn() -> tuple[nn.Module, Tensor, Tensor]:
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.Tanh(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(4 * 3 * 3, 3))
    return model, torch.randn(BATCH, 1, 8, 8), torch.randint(0, 3, (BATCH,))


def token_model() -> tuple[nn.Module, Tensor, Tensor]:
    return TokenClassifier(), torch.randint(1, 12, (BATCH, 7)), torch.randint(0, 3, (BATCH,))


CASES = {
    "mlp": (mlp, squared),
    "cnn": (cnn, cross_entropy),
    "embedding_layernorm": (token_model, cross_entropy),
}

# The longest sum in each case's forward or backward pass: mlp, the hidden width 8; cnn, GroupNorm's group of
# 2 channels x 6 x 6 positions (the convolution's weight gradient sums 36); embedding_layernorm, the mean over
# 7 tokens (LayerNorm sums 6).
ACCUMULATION = {"mlp": 8, "cnn": 72, "embedding_layernorm": 7}

# Rounding: a floating-point sum of n terms errs by at most about n u times the sum of their magnitudes (u the
# unit roundoff, eps / 2), and a per-sample gradient here is a short chain of such sums whose terms are of
# the order of the largest gradient entry. Two evaluations that differ only in the order of their sums (a
# kernel picked for another batch shape, or by another CPU's instruction set: AVX2 against AVX-512) therefore
# agree to within a few ulp of that entry times the accumulation length; ROUNDING_ULPS allows for the chain's
# depth. Observed on one CPU: at most 2.6 ulp of the largest entry (float64 cnn, chunks of 4 against the
# batch); a real bug (a chunk written at the wrong offset, a gradient at the wrong point) is off by the order
# of the entries themselves.
ROUNDING_ULPS = 8


@pytest.fixture(params=sorted(CASES))
def case_name(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def case(case_name: str) -> tuple[nn.Module, object, Tensor, Tensor]:
    torch.manual_seed(0)
    build, loss_fn = CASES[case_name]
    model, inputs, targets = build()
    model = model.double()
    return model, loss_fn, inputs.double() if inputs.is_floating_point() else inputs, targets.to(
        torch.float64 if targets.is_floating_point() else torch.int64)


def loop_reference(model: nn.Module, loss_fn, inputs: Tensor, targets: Tensor) -> tuple[list[Tensor], Tensor]:
    """Per-sample gradients and losses by one backward pass per sample."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads, losses = [], []
    for x, y in zip(inputs, targets):
        loss = loss_fn(model(x.unsqueeze(0)).squeeze(0), y)
        grads.append(torch.autograd.grad(loss, params))
        losses.append(loss.detach())
    return [torch.stack(per_param) for per_param in zip(*grads)], torch.stack(losses)


def shifted(model: nn.Module, scale: float = 0.1) -> list[Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [p.detach() + scale * torch.randn(p.shape, generator=generator, dtype=p.dtype)
            for p in model.parameters() if p.requires_grad]


def model_at(model: nn.Module, point: list[Tensor]) -> nn.Module:
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p, value in zip((p for p in moved.parameters() if p.requires_grad), point):
            p.copy_(value)
    return moved


def assert_all_equal(actual: list[Tensor], expected: list[Tensor]) -> None:
    """Bit for bit: only for the same computation twice (same shapes, same values, same process), which
    takes the same kernels on any CPU."""
    assert len(actual) == len(expected)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))


def assert_rounding_close(actual: list[Tensor], expected: list[Tensor], length: int) -> None:
    """Equal up to rounding (see ROUNDING_ULPS): within ROUNDING_ULPS x ``length`` ulp of ``actual``'s dtype,
    scaled by the largest entry of each expected tensor; ``expected`` may be a float64 reference."""
    assert len(actual) == len(expected)
    for k, (a, e) in enumerate(zip(actual, expected)):
        assert a.shape == e.shape, k
        bound = ROUNDING_ULPS * length * torch.finfo(a.dtype).eps * float(e.abs().max())
        error = float((a.to(e.dtype) - e).abs().max())
        assert error <= bound, f"tensor {k}: off by {error:.3g}, rounding allows {bound:.3g}"


def test_matches_per_sample_loop(case, case_name) -> None:
    model, loss_fn, inputs, targets = case
    grads, losses = per_sample_grads(model, loss_fn, inputs, targets, return_loss=True)
    expected_grads, expected_losses = loop_reference(model, loss_fn, inputs, targets)
    assert [g.shape[1:] for g in grads] == [p.shape for p in model.parameters()]
    assert_rounding_close(grads, expected_grads, ACCUMULATION[case_name])
    assert_rounding_close([losses], [expected_losses], ACCUMULATION[case_name])
    assert not any(g.requires_grad for g in grads)


def test_explicit_params_evaluate_at_that_point(case, case_name) -> None:
    model, loss_fn, inputs, targets = case
    point = shifted(model)
    before = [p.detach().clone() for p in model.parameters()]
    grads = per_sample_grads(model, loss_fn, inputs, targets, params=point)
    assert_rounding_close(grads, loop_reference(model_at(model, point), loss_fn, inputs, targets)[0],
                          ACCUMULATION[case_name])
    assert_all_equal(list(model.parameters()), before)


def test_chunks_fill_the_outputs_exactly(case) -> None:
    # Bit for bit, portably: each chunk is compared with a call on the same slice (same shape, same values),
    # the same computation, so any CPU takes the same kernels for both.
    model, loss_fn, inputs, targets = case
    per_sample_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for limits in ({"chunk_size": 4}, {"max_memory_bytes": 4 * per_sample_bytes + 1}):
        grads, losses = per_sample_grads(model, loss_fn, inputs, targets, return_loss=True, **limits)
        for start in range(0, BATCH, 4):
            part = slice(start, start + 4)
            expected, expected_losses = per_sample_grads(model, loss_fn, inputs[part], targets[part],
                                                         return_loss=True)
            assert_all_equal([g[part] for g in grads], expected)
            assert torch.equal(losses[part], expected_losses)


def test_chunking_matches_one_call(case, case_name) -> None:
    # Not bitwise: BLAS and convolutions pick kernels by matrix size, so a chunk of 3 and a batch of 10
    # round differently (observed: up to 4e-16 on O(1) values in float64), and which sizes differ depends on
    # the CPU.
    model, loss_fn, inputs, targets = case
    whole, whole_losses = per_sample_grads(model, loss_fn, inputs, targets, return_loss=True)
    for chunk_size in (1, 3):
        grads, losses = per_sample_grads(model, loss_fn, inputs, targets, return_loss=True,
                                         chunk_size=chunk_size)
        assert_rounding_close(grads, whole, ACCUMULATION[case_name])
        assert_rounding_close([losses], [whole_losses], ACCUMULATION[case_name])


def test_two_points(case, case_name) -> None:
    model64, loss_fn, inputs64, targets64 = case
    length = ACCUMULATION[case_name]
    for dtype in (torch.float64, torch.float32):
        model = copy.deepcopy(model64).to(dtype)
        inputs = inputs64.to(dtype) if inputs64.is_floating_point() else inputs64
        targets = targets64.to(dtype) if targets64.is_floating_point() else targets64
        # The float64 reference at exactly the same values (float32 widens exactly).
        reference = copy.deepcopy(model).double()
        inputs_ref = inputs.double() if inputs.is_floating_point() else inputs
        targets_ref = targets.double() if targets.is_floating_point() else targets

        here = [p.detach() for p in model.parameters()]
        # The same computation twice (same point, same shapes): bit for bit on any CPU.
        grads_a, grads_b = per_sample_grads_at_two_points(model, loss_fn, inputs, targets, here, here)
        assert_all_equal(grads_a, grads_b)

        point = shifted(model)
        grads_a, grads_b, losses_a, losses_b = per_sample_grads_at_two_points(
            model, loss_fn, inputs, targets, here, point, chunk_size=4, return_loss=True)
        # Chunks of 4 against the whole batch: a convolution may take another kernel for another batch shape,
        # and which one depends on the CPU, so equal up to rounding, not bit for bit (bitwise held on one CPU
        # and not on another).
        assert_rounding_close(grads_a, per_sample_grads(model, loss_fn, inputs, targets), length)
        expected_a, expected_losses_a = loop_reference(reference, loss_fn, inputs_ref, targets_ref)
        assert_rounding_close(grads_a, expected_a, length)
        assert_rounding_close([losses_a], [expected_losses_a], length)
        expected_b, expected_losses_b = loop_reference(
            model_at(reference, [p.double() for p in point]), loss_fn, inputs_ref, targets_ref)
        assert_rounding_close(grads_b, expected_b, length)
        assert_rounding_close([losses_b], [expected_losses_b], length)
        assert not torch.equal(losses_a, losses_b)


def test_frozen_parameters_are_skipped_in_order() -> None:
    torch.manual_seed(0)
    model, inputs, targets = mlp()
    model[0].bias.requires_grad_(False)
    grads = per_sample_grads(model, squared, inputs, targets)
    assert [g.shape[1:] for g in grads] == [model[0].weight.shape, model[2].weight.shape, model[2].bias.shape]
    assert [name for name, _ in trainable_parameters(model)] == ["0.weight", "2.weight", "2.bias"]


def test_inputs_that_require_grad_give_detached_results() -> None:
    torch.manual_seed(0)
    model, inputs, targets = mlp()
    grads = per_sample_grads(model, squared, inputs.requires_grad_(), targets)
    assert not any(g.requires_grad for g in grads)


@pytest.mark.parametrize("training", [True, False])
def test_batch_norm_is_rejected(training: bool) -> None:
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2 * 6 * 6, 1))
    model.train(training)
    with pytest.raises(ValueError, match=r"'1' \(BatchNorm2d\).*GroupNorm or LayerNorm"):
        per_sample_grads(model, squared, torch.randn(2, 1, 8, 8), torch.randn(2))


def test_model_without_trainable_parameters_is_rejected() -> None:
    model = nn.Linear(3, 1).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        per_sample_grads(model, squared, torch.randn(2, 3), torch.randn(2))


@pytest.mark.parametrize(("inputs", "targets", "message"), [
    (torch.randn(4, 3), torch.randn(5), "same batch size"),
    (torch.randn(0, 3), torch.randn(0), "empty batch"),
    (torch.tensor(1.0), torch.tensor(1.0), "batch dimension"),
])
def test_bad_batches_are_rejected(inputs: Tensor, targets: Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        per_sample_grads(nn.Linear(3, 1), squared, inputs, targets)


def test_bad_params_name_the_index() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    good = [p.detach() for p in model.parameters()]
    inputs, targets = torch.randn(2, 3), torch.randn(2)
    with pytest.raises(ValueError, match="params has 3 tensors, the model has 4"):
        per_sample_grads(model, squared, inputs, targets, params=good[:3])
    with pytest.raises(ValueError, match=r"params\[1\] \(0.bias\) has shape \(3,\), expected \(4,\)"):
        per_sample_grads(model, squared, inputs, targets, params=[good[0], torch.zeros(3), *good[2:]])
    with pytest.raises(ValueError, match=r"params\[2\] \(1.weight\) has dtype torch.float64"):
        per_sample_grads(model, squared, inputs, targets, params=[*good[:2], good[2].double(), good[3]])
    with pytest.raises(ValueError, match=r"params_b\[3\] \(1.bias\) is a list"):
        per_sample_grads_at_two_points(model, squared, inputs, targets, good, [*good[:3], [0.0]])


def test_bad_chunk_limits_are_rejected() -> None:
    with pytest.raises(ValueError, match="chunk_size"):
        per_sample_grads(nn.Linear(3, 1), squared, torch.randn(2, 3), torch.randn(2), chunk_size=0)
    with pytest.raises(ValueError, match="max_memory_bytes"):
        per_sample_grads(nn.Linear(3, 1), squared, torch.randn(2, 3), torch.randn(2), max_memory_bytes=0)


def test_chunk_size_from_memory_budget() -> None:
    assert _chunk_size(100, 400, None, None) == 100
    assert _chunk_size(100, 400, None, 4000) == 10
    assert _chunk_size(100, 400, None, 100) == 1  # never below one sample
    assert _chunk_size(100, 400, 7, 4000) == 7  # the smaller limit wins
    assert _chunk_size(5, 400, 7, None) == 5


@pytest.mark.parametrize("mode", ["ghost", "materialised"])
def test_micro_batches_give_the_batchs_clipped_sums_and_norms(mode) -> None:
    """``chunk_size`` (the physical batch) in every mode: the clipped sums and differences over micro-batches
    are the batch's, to the rounding of the float additions, and the norms are the same numbers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(23, 6, dtype=torch.float64), torch.randint(0, 3, (23,))

    def loss(output, target):
        return nn.functional.cross_entropy(output, target)

    point = [p.detach() for p in model.parameters()]
    previous = [p + 0.05 * torch.randn_like(p) for p in point]
    results = []
    for chunk in (None, 5):
        engine = ClippedGradients(model, loss, mode=mode, chunk_size=chunk)
        sums = [torch.zeros(p.numel(), dtype=torch.float64) for p in point]
        diffs = [torch.zeros(p.numel(), dtype=torch.float64) for p in point]
        norms = torch.zeros(23, dtype=torch.float64)
        engine.sum(x, y, 0.3, sums, norms=norms, weights=torch.linspace(0.5, 1.5, 23, dtype=torch.float64))
        engine.diff_sum(x, y, point, previous, 0.01, diffs)
        results.append((sums, diffs, norms))
    (sums, diffs, norms), (chunked_sums, chunked_diffs, chunked_norms) = results
    torch.testing.assert_close(chunked_norms, norms, rtol=1e-13, atol=0)
    for a, b in zip(sums + diffs, chunked_sums + chunked_diffs):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-15)
