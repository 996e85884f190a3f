"""Hugging Face batches through the front door (issue 48, item 1): structured records (a dict of
``input_ids`` and ``attention_mask`` per record, a tuple of tensors, a collator's dict with ``labels``)
through the data path and both gradient paths; a criterion that is any callable on the model's output;
the per-record weighting of a token loss explicit (``dpvr.TokenLoss``) and a token mean noticed; the
record-independence checks on dict records. Models are built from configs with random weights (nothing
downloaded), tiny."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import dpvr
from dpvr.grads import Fields
from dpvr.optim.gradients import ClippedGradients
from dpvr.optim.records import DatasetRecords
from dpvr.trainer import TokenLoss, per_sample
from dpvr.trainer.checks import _synthetic, check_model

tf = pytest.importorskip("transformers")

V, T, N = 40, 10, 32


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


def _padded(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids, a right-padding attention mask (lengths 3..T) and the LM labels (-100 at padding)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (N, T), generator=g)
    lengths = torch.randint(3, T + 1, (N,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, 0), mask, ids.masked_fill(mask == 0, -100)


class PairRecords(Dataset):
    """``({"input_ids", "attention_mask"}, target)``: what a tokenizer's output beside a label gives."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, targets: torch.Tensor) -> None:
        self.ids, self.mask, self.targets = ids, mask, targets

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i]}, self.targets[i]


class CollatorRecords(PairRecords):
    """A Hugging Face dataset's records: one dict with ``labels`` among its fields."""

    def __getitem__(self, i: int):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.targets[i]}


def _classes(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 3, (N,), generator=torch.Generator().manual_seed(seed))


def _changed(before: list[torch.Tensor], model: nn.Module) -> bool:
    return any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


# ---- the data path ---------------------------------------------------------------------------------------


def test_dict_records_load_as_fields_with_their_rows() -> None:
    ids, mask, labels = _padded()
    records = DatasetRecords(PairRecords(ids, mask, labels))
    x, y = records.batch([3, 0, 5])
    assert isinstance(x, Fields) and x.names == ("input_ids", "attention_mask") and len(x) == 3
    assert torch.equal(x["input_ids"], ids[[3, 0, 5]]) and torch.equal(x["attention_mask"], mask[[3, 0, 5]])
    assert torch.equal(y, labels[[3, 0, 5]])
    # A collator's dict: the labels are the target, the other fields the model's keyword inputs.
    x, y = DatasetRecords(CollatorRecords(ids, mask, labels)).full()
    assert x.names == ("input_ids", "attention_mask") and torch.equal(y, labels) and len(x) == N
    # A TensorDataset of (input_ids, attention_mask, labels): positional inputs, the last is the target.
    x, y = dpvr.trainer.dataset_records(TensorDataset(ids, mask, labels)).batch([1, 2])
    assert x.names is None and torch.equal(x.tensors[1], mask[1:3]) and torch.equal(y, labels[1:3])
    # Empty draws keep every field's trailing shape; the fingerprint reads every field.
    assert [tuple(t.shape) for t in records.empty().inputs.tensors] == [(0, T), (0, T)]
    other = mask.clone()
    other[-1, 2] = 1 - other[-1, 2]
    assert (DatasetRecords(PairRecords(ids, other, labels)).content_fingerprint()
            != records.content_fingerprint())


def test_a_dict_record_without_labels_is_refused_naming_the_field() -> None:
    class Unlabelled(PairRecords):
        def __getitem__(self, i: int):
            return {"input_ids": self.ids[i]}

    ids, mask, labels = _padded()
    with pytest.raises(TypeError, match="'labels' field"):
        DatasetRecords(Unlabelled(ids, mask, labels))
    with pytest.raises(ValueError, match="different numbers of rows"):
        Fields({"input_ids": ids, "attention_mask": mask[:3]})


# ---- make_private with no wrapper ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["auto", "materialised"])
def test_bert_with_attention_masks_trains_through_make_private(mode: str) -> None:
    ids, mask, _ = _padded()
    model = _bert()
    before = [p.detach().clone() for p in model.parameters()]
    trainer = dpvr.make_private(model, nn.CrossEntropyLoss(), PairRecords(ids, mask, _classes()),
                                algorithm="dp-sgd", epsilon=2.0, batch_size=8, steps=2, lr=0.1, clip=1.0,
                                runtime=dpvr.RuntimeConfig(grad_mode=mode))
    assert trainer.algorithm.gradients.mode == ("ghost" if mode == "auto" else "materialised")
    assert len(trainer.run()) == 2 and _changed(before, model)


def test_gpt2_trains_on_a_collators_records_with_a_token_loss() -> None:
    ids, mask, labels = _padded()
    model = _gpt2()
    before = [p.detach().clone() for p in model.parameters()]
    loader = DataLoader(CollatorRecords(ids, mask, labels), batch_size=8)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*mean over the batch's tokens")
        trainer = dpvr.make_private(model, TokenLoss("token", token_weight=1 / T, shift=True), loader,
                                    algorithm="dp-sgd", epsilon=2.0, steps=2, lr=0.1, clip=1.0)
    assert trainer.algorithm.gradients.mode == "ghost"
    assert len(trainer.run()) == 2 and _changed(before, model)


def test_a_function_criterion_is_any_callable_on_the_output() -> None:
    ids, mask, _ = _padded()
    data = PairRecords(ids, mask, _classes())
    common = dict(algorithm="dp-sgd", epsilon=2.0, batch_size=8, steps=1, lr=0.1, clip=1.0)
    # torch's functional losses get the logits, as nn loss modules do
    dpvr.make_private(_bert(), F.cross_entropy, data, **common).run()
    # any other callable gets the ModelOutput
    dpvr.make_private(_bert(), lambda out, y: F.cross_entropy(out.logits, y), data, **common).run()
    with pytest.raises(ValueError, match=r"output\.logits"):
        dpvr.make_private(_bert(), lambda out, y: (out - y).square().mean(), data, **common)


# ---- the per-sample loss of token losses -----------------------------------------------------------------


def _token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each record's summed next-token cross-entropy (-100 ignored) and its token count, in float64."""
    logits, labels = logits[:, :-1].double(), labels[:, 1:]
    sums, counts = [], []
    for row, label in zip(logits, labels):
        keep = label != -100
        sums.append(-torch.log_softmax(row[keep], dim=-1).gather(1, label[keep, None]).sum())
        counts.append(keep.sum())
    return torch.stack(sums), torch.stack(counts).double()


def test_token_loss_weightings_against_a_float64_reference() -> None:
    _, _, labels = _padded()
    logits = torch.randn(N, T, V, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    sums, counts = _token_losses(logits, labels)
    record = TokenLoss("record", shift=True)
    token = TokenLoss("token", token_weight=0.25, shift=True)
    torch.testing.assert_close(record.per_record(logits, labels), sums / counts, rtol=1e-12, atol=0)
    torch.testing.assert_close(token.per_record(logits, labels), 0.25 * sums, rtol=1e-12, atol=0)
    # One record's loss, as dpvr clips it, is the criterion on a batch of one.
    one = per_sample(token)(logits[4], labels[4])
    torch.testing.assert_close(one, 0.25 * sums[4], rtol=1e-12, atol=0)
    # The two weightings differ on these records (lengths 3..10): the choice matters.
    assert float((sums / counts).mean()) != pytest.approx(float((0.25 * sums).mean()), rel=1e-3)
    with pytest.raises(ValueError, match="token_weight"):
        TokenLoss("token")


def test_a_token_mean_criterion_is_noticed_not_only_at_initialisation() -> None:
    """nn.CrossEntropyLoss on padded LM labels is a mean over the batch's tokens; dpvr trains each record's
    own token mean. At initialisation every token's loss is about log V, so the two agree there: the check
    perturbs the outputs to see the difference, and warns naming the choice."""
    ids, mask, labels = _padded()
    targets = torch.cat([labels[:, 1:], torch.full((N, 1), -100)], dim=1)  # pre-shifted next tokens
    model = _gpt2()
    with torch.no_grad():  # token mean and record mean agree at initialisation (the old check's blind spot)
        logits = model(input_ids=ids[:8], attention_mask=mask[:8]).logits
        token_mean = F.cross_entropy(logits.flatten(0, 1), targets[:8].flatten())
        record_mean = torch.stack([F.cross_entropy(logits[i], targets[i]) for i in range(8)]).mean()
    assert abs(float(token_mean - record_mean)) < 1e-3
    with pytest.warns(UserWarning, match="mean over the batch's tokens.*TokenLoss"):
        dpvr.make_private(model, nn.CrossEntropyLoss(), PairRecords(ids, mask, targets), algorithm="dp-sgd",
                          epsilon=2.0, batch_size=8, steps=1, lr=0.1, clip=1.0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*mean over the batch's tokens")
        dpvr.make_private(_gpt2(), TokenLoss("record"), PairRecords(ids, mask, targets), algorithm="dp-sgd",
                          epsilon=2.0, batch_size=8, steps=1, lr=0.1, clip=1.0)


def test_a_criterion_coupling_records_is_still_refused() -> None:
    ids, mask, _ = _padded()

    def centred(out, y):  # subtracts the batch's mean logit: couples records
        logits = out.logits
        return F.cross_entropy(logits - logits.mean(0, keepdim=True), y)

    with pytest.raises(ValueError, match="couples records"):
        dpvr.make_private(_bert(), centred, PairRecords(ids, mask, _classes()), algorithm="dp-sgd",
                          epsilon=2.0, batch_size=8, steps=1, lr=0.1, clip=1.0)


# ---- both gradient paths against autograd, masks included ------------------------------------------------


@pytest.mark.parametrize("mode", ["ghost", "materialised"])
def test_per_sample_norms_and_sums_with_masks_match_float64_autograd(mode: str) -> None:
    ids, mask, _ = _padded()
    y = _classes()[:5]
    model = _bert().double().eval()
    x = Fields({"input_ids": ids[:5], "attention_mask": mask[:5]})
    loss = per_sample(nn.CrossEntropyLoss())
    params = [p for p in model.parameters() if p.requires_grad]
    truth = []
    for i in range(5):
        out = model(input_ids=ids[i : i + 1], attention_mask=mask[i : i + 1])
        grads = torch.autograd.grad(F.cross_entropy(out.logits, y[i : i + 1]), params, allow_unused=True)
        truth.append([torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)])
    clip = 0.5
    engine = ClippedGradients(model, loss, mode=mode)
    assert engine.mode == mode
    sums = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    norms = torch.zeros(5, dtype=torch.float64)
    engine.sum(x, y, clip, sums, norms=norms)
    want_norms = torch.stack([torch.sqrt(sum(g.square().sum() for g in r)) for r in truth])
    torch.testing.assert_close(norms, want_norms, rtol=1e-9, atol=1e-12)
    factors = torch.clamp(clip / want_norms, max=1.0)
    for k, s in enumerate(sums):
        torch.testing.assert_close(s, sum(f * r[k] for f, r in zip(factors, truth)).reshape(-1),
                                   rtol=1e-8, atol=1e-10)
    # The mask is each record's own: a padded token changed changes no gradient.
    other = ids[:5].clone()
    other[mask[:5] == 0] = 7
    again = [torch.zeros(p.numel(), dtype=torch.float64) for p in params]
    engine.sum(Fields({"input_ids": other, "attention_mask": mask[:5]}), y, clip, again)
    for s, t in zip(sums, again):
        torch.testing.assert_close(s, t, rtol=1e-9, atol=1e-12)


# ---- record independence on dict records -----------------------------------------------------------------


def test_synthetic_dict_records_keep_each_fields_kind() -> None:
    ids, mask, _ = _padded()
    x = Fields({"input_ids": ids[:8], "attention_mask": mask[:8]})
    fake = _synthetic(_gpt2(), x, 0)
    assert fake.names == x.names
    assert set(fake["attention_mask"].unique().tolist()) == {0, 1}  # a mask stays a mask
    assert int(fake["input_ids"].max()) < V and not torch.equal(fake["input_ids"], x["input_ids"])


def test_a_model_mixing_records_through_a_dict_input_is_refused() -> None:
    class Pooled(nn.Module):
        """Averages token embeddings over the *batch's* unmasked tokens: one record moves the others."""

        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(V, 8), nn.Linear(8, 3)

        def forward(self, input_ids, attention_mask):
            h = self.embed(input_ids) * attention_mask[..., None]
            centre = h.sum((0, 1)) / attention_mask.sum()
            return self.head(h.mean(1) - centre)

    ids, mask, _ = _padded()
    x = Fields({"input_ids": ids[:8], "attention_mask": mask[:8]})
    with pytest.raises(ValueError, match="depends on the other records"):
        check_model(Pooled(), x, _classes()[:8], per_sample(nn.CrossEntropyLoss()))
