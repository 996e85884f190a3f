"""Hugging Face ``transformers`` models (built from configs, random weights, nothing downloaded) through the
front door without wrappers: structured outputs, broadcast position embeddings, GPT-2's Conv1D projections
and tied head, frozen layers. Per-sample norms and clipped sums and differences are checked against
autograd on one record at a time in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import dpvr
from dpvr.optim.gradients import ClippedGradients

tf = pytest.importorskip("transformers")

V, T, N = 40, 10, 48


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=V, n_positions=T, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
                           eos_token_id=0)
    return tf.GPT2LMHeadModel(config)


def _bert() -> nn.Module:
    torch.manual_seed(0)
    config = tf.BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=32, max_position_embeddings=T, num_labels=3)
    return tf.BertForSequenceClassification(config)


def _distilbert() -> nn.Module:
    torch.manual_seed(0)
    config = tf.DistilBertConfig(vocab_size=V, dim=16, n_layers=2, n_heads=2, hidden_dim=32,
                                 max_position_embeddings=T, num_labels=3)
    return tf.DistilBertForSequenceClassification(config)


def _language_model_loss(output, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, -2), target.flatten())


def _tokens(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (N, T), generator=g), torch.randint(0, 3, (N,), generator=g)


CASES = {
    "gpt2": (_gpt2, lambda ids, _: TensorDataset(ids[:, :-1], ids[:, 1:]), _language_model_loss, "ghost"),
    "bert": (_bert, TensorDataset, nn.CrossEntropyLoss(), "ghost"),
    "distilbert": (_distilbert, TensorDataset, nn.CrossEntropyLoss(), "ghost"),
}


@pytest.mark.parametrize("name", CASES)
def test_a_transformers_model_trains_through_make_private_without_a_wrapper(name: str) -> None:
    build, dataset, criterion, mode = CASES[name]
    model = build()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = dpvr.make_private(model, criterion, dataset(*_tokens()), algorithm="dp-sgd", epsilon=2.0,
                                batch_size=8, steps=2, lr=0.1, clip=1.0)
    assert trainer.algorithm.gradients.mode == mode  # ghost clipping, the tied head included
    infos = trainer.run()
    assert len(infos) == 2
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def _per_sample(model: nn.Module, loss, x: torch.Tensor, y: torch.Tensor) -> list[list[torch.Tensor]]:
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for i in range(len(x)):
        grads = torch.autograd.grad(loss(_first(model(x[i : i + 1])), y[i]), params, allow_unused=True)
        out.append([torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)])
    return out


def _first(output):
    return type(output)({k: v[0] for k, v in output.items() if isinstance(v, torch.Tensor)})


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_per_sample_norms_sums_and_differences_match_float64_autograd(name: str) -> None:
    build, dataset, criterion, _ = CASES[name]
    model = build().double().eval()
    x, y = dataset(*_tokens()).tensors
    x, y = x[:6], y[:6]
    loss = dpvr.trainer.per_sample(criterion)
    truth = _per_sample(model, loss, x, y)
    engine = ClippedGradients(model, loss, mode="ghost")
    params = [p for p in model.parameters() if p.requires_grad]
    clip = 0.5
    sums = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    norms = torch.zeros(len(x), dtype=torch.float64)
    engine.sum(x, y, clip, sums, norms=norms)
    expected_norms = torch.stack([torch.sqrt(sum(g.square().sum() for g in record)) for record in truth])
    torch.testing.assert_close(norms, expected_norms, rtol=1e-9, atol=1e-12)
    factors = torch.clamp(clip / expected_norms, max=1.0)
    for k, s in enumerate(sums):
        want = sum(f * record[k] for f, record in zip(factors, truth)).reshape(-1)
        torch.testing.assert_close(s, want, rtol=1e-8, atol=1e-10)
    # The same-sample difference between two points.
    previous = [p.detach() + 0.01 * torch.randn_like(p) for p in params]
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, q in zip(params, previous):
            p.copy_(q)
    before = _per_sample(model, loss, x, y)
    with torch.no_grad():
        for p, q in zip(params, saved):
            p.copy_(q)
    diffs = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    engine.diff_sum(x, y, saved, previous, clip, diffs)
    gaps = [[a - b for a, b in zip(r, r0)] for r, r0 in zip(truth, before)]
    gap_norms = torch.stack([torch.sqrt(sum(g.square().sum() for g in record)) for record in gaps])
    factors = torch.clamp(clip / gap_norms, max=1.0)
    for k, s in enumerate(diffs):
        want = sum(f * record[k] for f, record in zip(factors, gaps)).reshape(-1)
        torch.testing.assert_close(s, want, rtol=1e-7, atol=1e-10)


def test_frozen_layers_train_with_an_optimizer_over_every_parameter() -> None:
    model = _bert()
    for p in model.bert.embeddings.parameters():
        p.requires_grad_(False)
    frozen = [p.detach().clone() for p in model.bert.embeddings.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)  # the usual pattern: all parameters
    trainer = dpvr.make_private(model, nn.CrossEntropyLoss(), TensorDataset(*_tokens()), algorithm="dp-sgd",
                                epsilon=2.0, batch_size=8, steps=2, clip=1.0, optimizer=optimizer)
    trainer.run()
    assert all(torch.equal(a, b) for a, b in zip(frozen, model.bert.embeddings.parameters()))
    foreign = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="not the model's"):
        dpvr.make_private(model, nn.CrossEntropyLoss(), TensorDataset(*_tokens()), algorithm="dp-sgd",
                          epsilon=2.0, batch_size=8, steps=2, clip=1.0, optimizer=foreign)
