"""``dpvr bench step``: one full optimisation step, private and not, on small models (CPU or CUDA), and with
``--scale`` on models of about 10^7 parameters (:data:`dpvr_lab.bench.SCALE_DEFAULT`); with ``--case``, also
on GPT-2 small's shape, about 1.24 * 10^8 parameters (:data:`dpvr_lab.bench.SCALE_CASES` lists them all).

Cases (``--case``):
  mlp           784-256-128-1 MLP, squared loss, B = 512;
  cnn           2 conv (3x3, 16 and 32 channels, each with ReLU and 2x2 max-pooling) + 2 linear layers on
                1x28x28 inputs, 10 classes, cross-entropy, B = 256;
  transformer   embedding (1000 tokens, width 64), 2 ``nn.TransformerEncoderLayer`` (4 heads, feed-forward
                128, no dropout), mean pooling and a 2-class head, sequences of 64 tokens, B = 64;
  lstm          embedding (1000 tokens, width 64), one LSTM (hidden 128) and a 2-class head on the last step,
                sequences of 32 tokens, B = 64;
  gpt2          a ``transformers`` GPT-2 (2 layers, width 64, 1000 tokens, tied head) classifying from its
                last position, sequences of 64 tokens, B = 64.

Scale cases (``--scale``, or one of them with ``--case``):
  mlp-wide          784-4096-2048-10 MLP, cross-entropy, B = 256 (1.2 * 10^7 parameters);
  resnet            a ResNet-style CNN (GroupNorm; widths 128, 256, 512, 512) on 3x32x32 inputs, 10 classes,
                    B = 32 (9.9 * 10^6 parameters);
  gpt2-1e7-t{T}     a GPT-2 (6 layers, width 384, 6 heads, 8192 tokens, tied head; 1.4 * 10^7 parameters)
                    as the ``gpt2`` case, sequences of T = 128, 512 or 1024 tokens, B = 8;
  gpt2-1e8-t{T}     GPT-2 small's shape (12 layers, width 768, 12 heads, 50257 tokens, tied head; 1.24 * 10^8
                    parameters) as the ``gpt2`` case, T = 128 or 512, B = 2; only with ``--case``
                    (not in the ``--scale`` default: :data:`dpvr_lab.bench.SCALE_DEFAULT`).
For each GPT-2 size run at several T, the exponents of time and memory in T are fitted
(:func:`sequence_scaling`).

Methods, all timed in one run with the rounds interleaved (see :func:`~.timing.interleaved_median_ms`); each
private method updates its own copy of the model, so one method's state never feeds another's:
  non-private                  forward, backward and SGD step (torch);
  opacus-hooks-dp-sgd          Opacus' DP-SGD step with per-sample gradients from its hooks (GradSampleModule,
                               DPOptimizer), on the same fixed model;
  opacus-ghost-dp-sgd          Opacus ghost-clipping DP-SGD step (GradSampleModuleFastGradientClipping) on
                               the model after ``ModuleValidator.fix`` (``nn.MultiheadAttention`` becomes
                               Opacus' ``DPMultiheadAttention``); where Opacus is missing or refuses the
                               model, a record says why;
  dpvr-make-private-dp-sgd     a step of the trainer ``dpvr.make_private(..., algorithm="dp-sgd",
                               sampling="wor")`` returns: a fixed-size batch of the case's B records drawn
                               without replacement from its four batches, the batch gathered, ghost
                               clipping, the release admitted by the budget guard and written ahead to the
                               run's ledger, the noisy update and the optimizer's step;
  dpvr-dp-sgd-bare             a step of ``dpvr.algorithms.DPSGD(..., sampling="wor")`` built directly on the
                               same records with the same seeds: the same B-record batches step for step, so
                               ``ratio_vs_bare`` (make_private's record) is what the front door adds;
  dpvr-dp-sgd-ghost            dpvr DP-SGD step: GhostClipper.clipped_sum (sums kept in float64, as the
                               algorithms release them) + fused noisy update and step (on a batch that is
                               the whole dataset, a DP-GD round);
  dpvr-diff2-ghost             a DIFF2-GD difference round on the full batch: the clipped sum of same-sample
                               gradient differences at the current and previous iterates
                               (GhostClipper.clipped_diff_sum, the previous iterate's recording reused from
                               the previous round), clip radius C2 * ||x_r - x_{r-1}||, + fused noisy
                               estimator update and step;
  dpvr-diff2-ghost-recompute   the same round recording both points again (``reuse_recording=False``);
  dpvr-fresh-diff-ghost        a difference round on a fresh batch (PrivateDiff, SPIDER): both points
                               recorded on a batch drawn in turn from four;
  dpvr-diff2-materialised      (mlp only) the full-batch round from materialised per-sample gradients at
                               both points (per_sample_grads_at_two_points + clip_accumulate_diff).

Every timed record has ``ms`` and ``ratio_vs_non_private``; dpvr's records also ``ratio_vs_opacus_ghost``,
``ratio_vs_opacus_hooks`` and, on the CPU, ``native_share``, the fraction of the step spent inside the native
core (measured on separate rounds with every call into ``dpvr._C`` timed). On CUDA every round ends with a
device synchronisation (the time is the step's, not its launches'), and every record has ``host_syncs``: the
synchronisations one step makes the host wait for, counted by torch's sync debug mode (reads such as
``float(t)`` and ``t.item()``; the native core's own wait, under ``nonfinite="raise"`` only, is not among
them), and ``host_sync_sites``, the lines that made them. With ``memory``, every record also has
``peak_mib``, the peak tensor memory one step allocates above what was live before it
(:func:`~.timing.peak_bytes`), and its ratios.
"""

from __future__ import annotations

import contextlib
import copy
import math
import multiprocessing
import os
import re
import statistics
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import cached_property, partial
from itertools import cycle
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from dpvr import ops
from dpvr.grads import GhostClipper, per_sample_grads_at_two_points
from dpvr.grads.ghost.cost import FORMS as _FORMS
from dpvr.results import Record

from . import CASES, REAL_CASES, SCALE_CASES
from .timing import device_sync, host_syncs, interleaved_median_ms, peak_bytes

CLIP, CLIP2, SIGMA, LR = 1.0, 10.0, 1.0, 0.05
FRESH_BATCHES = 4  # the fresh-batch round cycles through this many batches
WIDTHS = (784, 256, 128, 1)
BATCH = 512  # the MLP's


def mlp() -> nn.Module:
    layers: list[nn.Module] = []
    for n_in, n_out in zip(WIDTHS[:-1], WIDTHS[1:]):
        layers += [nn.Linear(n_in, n_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2),  # 28 -> 26 -> 13
        nn.Conv2d(16, 32, 3), nn.ReLU(), nn.MaxPool2d(2),  # 13 -> 11 -> 5
        nn.Flatten(), nn.Linear(32 * 5 * 5, 64), nn.ReLU(), nn.Linear(64, 10),
    )


class Encoder(nn.Module):
    """A small transformer encoder classifier: token embedding, encoder layers, mean pooling, linear head."""

    def __init__(self, vocab: int = 1000, width: int = 64, layers: int = 2, classes: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.Sequential(*[
            nn.TransformerEncoderLayer(width, 4, dim_feedforward=2 * width, dropout=0.0, batch_first=True)
            for _ in range(layers)
        ])
        self.head = nn.Linear(width, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.layers(self.embed(tokens)).mean(dim=1))


class Recurrent(nn.Module):
    """An LSTM classifier: token embedding, one LSTM layer, a linear head on the last step's output."""

    def __init__(self, vocab: int = 1000, width: int = 64, hidden: int = 128, classes: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.lstm(self.embed(tokens))[0][:, -1])


class Decoder(nn.Module):
    """A GPT-2 decoder from ``transformers`` (a config, random weights; Conv1D projections and the tied
    language-model head), classifying a sequence from its last position's logits over ``classes`` tokens.

    The position ids are passed explicitly, one row per record: left to ``transformers`` they are one row
    broadcast over the batch, and per-sample gradients from hooks (Opacus') then see a position embedding
    whose input has batch dimension 1."""

    def __init__(self, vocab: int = 1000, width: int = 64, layers: int = 2, length: int = 64,
                 classes: int = 2, heads: int = 4) -> None:
        super().__init__()
        import transformers

        config = transformers.GPT2Config(vocab_size=vocab, n_positions=length, n_embd=width, n_layer=layers,
                                         n_head=heads, bos_token_id=0, eos_token_id=0, use_cache=False,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.gpt2, self.classes = transformers.GPT2LMHeadModel(config), classes

    def forward(self, tokens: Tensor) -> Tensor:
        b, t = tokens.shape
        positions = torch.arange(t, device=tokens.device).expand(b, t)
        return self.gpt2(tokens, position_ids=positions).logits[:, -1, : self.classes]


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with GroupNorm and a skip connection (a 1x1 projection where the shape
    changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride, 1), nn.GroupNorm(8, c_out), nn.ReLU(),
            nn.Conv2d(c_out, c_out, 3, 1, 1), nn.GroupNorm(8, c_out),
        )
        self.skip = nn.Identity() if c_in == c_out and stride == 1 else nn.Conv2d(c_in, c_out, 1, stride)

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def resnet(widths: Sequence[int] = (128, 256, 512, 512), classes: int = 10) -> nn.Module:
    """A ResNet-style CNN on 3x32x32 inputs: a stem, one residual block per width (stride 2 after the first),
    global average pooling and a linear head (about 10^7 parameters with the default widths)."""
    layers: list[nn.Module] = [nn.Conv2d(3, widths[0], 3, 1, 1), nn.GroupNorm(8, widths[0]), nn.ReLU()]
    for k, (c_in, c_out) in enumerate(zip((widths[0], *widths[:-1]), widths)):
        layers.append(ResidualBlock(c_in, c_out, 1 if k == 0 else 2))
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(widths[-1], classes))


def _groups(channels: int) -> int:
    """GroupNorm's groups: 32 (as ResNets with GroupNorm use), fewer where the width is smaller."""
    return math.gcd(32, channels)


class BasicBlock(nn.Module):
    """ResNet-18's block: two 3x3 convolutions without bias, each followed by GroupNorm (BatchNorm mixes the
    records of a batch, which per-sample clipping cannot allow), and a skip connection (a 1x1 convolution
    and GroupNorm where the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.GroupNorm(_groups(c_out), c_out), nn.ReLU(),
            nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False), nn.GroupNorm(_groups(c_out), c_out),
        )
        self.skip = (nn.Identity() if c_in == c_out and stride == 1 else nn.Sequential(
            nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.GroupNorm(_groups(c_out), c_out)))

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def resnet18(widths: Sequence[int] = (64, 128, 256, 512), classes: int = 10) -> nn.Module:
    """ResNet-18 for 3x32x32 images (the CIFAR form: a 3x3 stem, no max-pooling), GroupNorm for BatchNorm:
    four stages of two :class:`BasicBlock` each (stride 2 from the second stage), global average pooling and
    a linear head; 11.2 * 10^6 parameters with the default widths."""
    stem = widths[0]
    layers: list[nn.Module] = [nn.Conv2d(3, stem, 3, 1, 1, bias=False), nn.GroupNorm(_groups(stem), stem),
                               nn.ReLU()]
    c_in = widths[0]
    for k, width in enumerate(widths):
        layers += [BasicBlock(c_in, width, 1 if k == 0 else 2), BasicBlock(width, width, 1)]
        c_in = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(widths[-1], classes))


class LanguageModel(nn.Module):
    """A GPT-2 language model from ``transformers`` (a config, random weights, the head tied to the token
    embedding): next-token logits at every position, shape ``(B, T, vocabulary)``. Position ids are passed
    one row per record (see :class:`Decoder`); dropout is off."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, length: int) -> None:
        super().__init__()
        import transformers

        config = transformers.GPT2Config(vocab_size=vocab, n_positions=length, n_embd=width, n_layer=layers,
                                         n_head=heads, bos_token_id=0, eos_token_id=0, use_cache=False,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        self.gpt2 = transformers.GPT2LMHeadModel(config)

    def forward(self, tokens: Tensor) -> Tensor:
        b, t = tokens.shape
        positions = torch.arange(t, device=tokens.device).expand(b, t)
        return self.gpt2(tokens, position_ids=positions).logits


class Classifier(nn.Module):
    """A BERT sequence classifier from ``transformers`` (``BertForSequenceClassification`` from a config,
    random weights; dropout off), with position and token-type ids passed one row per record."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, length: int,
                 classes: int = 2) -> None:
        super().__init__()
        import transformers

        config = transformers.BertConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=layers,
                                         num_attention_heads=heads, intermediate_size=4 * width,
                                         max_position_embeddings=length, num_labels=classes,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.bert = transformers.BertForSequenceClassification(config)

    def forward(self, tokens: Tensor) -> Tensor:
        b, t = tokens.shape
        positions = torch.arange(t, device=tokens.device).expand(b, t)
        return self.bert(tokens, position_ids=positions, token_type_ids=torch.zeros_like(tokens)).logits


class TokenCrossEntropy(nn.Module):
    """A language model's loss: cross-entropy of ``(B, T, V)`` logits against ``(B, T)`` next tokens,
    averaged over the positions of each record, then reduced over records as ``reduction`` says (``"none"``:
    the per-record losses, which Opacus' ghost clipping asks for)."""

    def __init__(self) -> None:
        super().__init__()
        self.reduction = "mean"

    def forward(self, output: Tensor, target: Tensor) -> Tensor:
        # Class-last, as language models' own losses take it: a (B, V, T) layout puts the log-softmax on a
        # strided dimension (on an H200 about 90 ms of GPT-2 small's B = 16 step under make_private's vmap)
        tokens = F.cross_entropy(output.flatten(0, 1), target.flatten(), reduction="none")
        per_record = tokens.view(target.shape).mean(dim=1)
        if self.reduction == "none":
            return per_record
        return per_record.sum() if self.reduction == "sum" else per_record.mean()


def squared(output: Tensor, target: Tensor) -> Tensor:
    """Per-sample loss (the contract of dpvr.grads)."""
    return 0.5 * (output.squeeze(-1) - target) ** 2


def cross_entropy(output: Tensor, target: Tensor) -> Tensor:
    """Per-sample loss (the contract of dpvr.grads)."""
    return F.cross_entropy(output, target)


class HalfSquared(nn.Module):
    """``0.5 (output - target)^2`` on the squeezed output, reduced as ``reduction`` says (as torch's losses,
    whose ``reduction`` Opacus switches to ``"none"`` to get per-sample losses)."""

    def __init__(self) -> None:
        super().__init__()
        self.reduction = "mean"

    def forward(self, output: Tensor, target: Tensor) -> Tensor:
        loss = squared(output, target)
        return loss if self.reduction == "none" else loss.sum() if self.reduction == "sum" else loss.mean()


@dataclass
class Case:
    """One model with its data: ``batches[0]`` is the full batch, the others feed the fresh-batch round."""

    name: str
    model: nn.Module
    batches: list[tuple[Tensor, Tensor]]
    loss: Callable[[Tensor, Tensor], Tensor]  # per sample, for dpvr
    criterion: nn.Module  # batched, mean reduction: the non-private step and Opacus
    autocast: torch.dtype | None = None  # every method's step runs under torch.autocast in this dtype

    @property
    def batch(self) -> int:
        return len(self.batches[0][0])

    @property
    def device(self) -> torch.device:
        return self.batches[0][0].device

    @property
    def label(self) -> str:
        precision = "" if self.autocast is None else f"/autocast-{str(self.autocast).removeprefix('torch.')}"
        return f"{self.name}/B={self.batch}/{self.device.type}{precision}"


def make_case(name: str, batch: int | None = None, device: str = "cpu", *, reduced: bool = False,
              autocast: torch.dtype | None = None) -> Case:
    """The case ``name`` (one of :data:`CASES`, :data:`SCALE_CASES` or :data:`REAL_CASES`) with its default
    batch size unless ``batch`` is given, its model and data on ``device``. ``reduced``: a real case's
    architecture at a small size (:func:`real_model`); ``autocast``: every method's step runs under
    ``torch.autocast`` in that dtype (as users train in bfloat16), the parameters staying float32."""
    if reduced and name not in REAL_CASES:
        raise ValueError(f"reduced: only the real cases {REAL_CASES} have a reduced size, got {name!r}")
    case = _real_case(name, batch, reduced) if name in REAL_CASES else _make_case(name, batch)
    case.autocast = autocast
    case.model.to(device)
    case.batches = [(x.to(device), y.to(device)) for x, y in case.batches]
    return case


def _make_case(name: str, batch: int | None) -> Case:
    torch.manual_seed(0)
    if name == "mlp":
        b = batch or BATCH
        data = [(torch.randn(b, WIDTHS[0]), torch.randn(b)) for _ in range(FRESH_BATCHES)]
        return Case("mlp-784-256-128-1", mlp(), data, squared, HalfSquared())
    if name == "cnn":
        b = batch or 256
        data = [(torch.randn(b, 1, 28, 28), torch.randint(0, 10, (b,))) for _ in range(FRESH_BATCHES)]
        return Case("cnn-2conv-2linear-28x28", cnn(), data, cross_entropy, nn.CrossEntropyLoss())
    if name == "transformer":
        b = batch or 64
        data = [(torch.randint(0, 1000, (b, 64)), torch.randint(0, 2, (b,))) for _ in range(FRESH_BATCHES)]
        return Case("transformer-2layer-seq64", Encoder(), data, cross_entropy, nn.CrossEntropyLoss())
    if name == "mlp-wide":
        b = batch or 256
        widths = (784, 4096, 2048, 10)
        layers: list[nn.Module] = []
        for n_in, n_out in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(n_in, n_out), nn.ReLU()]
        data = [(torch.randn(b, 784), torch.randint(0, 10, (b,))) for _ in range(FRESH_BATCHES)]
        return Case("mlp-784-4096-2048-10", nn.Sequential(*layers[:-1]), data, cross_entropy,
                    nn.CrossEntropyLoss())
    if name == "resnet":
        b = batch or 32
        data = [(torch.randn(b, 3, 32, 32), torch.randint(0, 10, (b,))) for _ in range(FRESH_BATCHES)]
        return Case("resnet-128-256-512-512-32x32", resnet(), data, cross_entropy, nn.CrossEntropyLoss())
    if name.startswith(("gpt2-1e7-t", "gpt2-1e8-t")):
        length = int(name.removeprefix("gpt2-1e7-t").removeprefix("gpt2-1e8-t"))
        if name.startswith("gpt2-1e7-t"):
            label, b, vocab, width, layers = "gpt2-14M", batch or 8, 8192, 384, 6
        else:  # GPT-2 small's shape (124.4M parameters with its 1024 positions; here ``length`` of them)
            label, b, vocab, width, layers = "gpt2-124M", batch or 2, 50257, 768, 12
        data = [(torch.randint(0, vocab, (b, length)), torch.randint(0, 2, (b,)))
                for _ in range(FRESH_BATCHES)]
        model = Decoder(vocab=vocab, width=width, layers=layers, length=length, heads=layers)
        return Case(f"{label}-seq{length}", model, data, cross_entropy, nn.CrossEntropyLoss())
    if name in ("lstm", "gpt2"):
        b = batch or 64
        length = 32 if name == "lstm" else 64
        data = [(torch.randint(0, 1000, (b, length)), torch.randint(0, 2, (b,)))
                for _ in range(FRESH_BATCHES)]
        model, label = (Recurrent(), "lstm-128-seq32") if name == "lstm" else (Decoder(), "gpt2-2layer-seq64")
        return Case(label, model, data, cross_entropy, nn.CrossEntropyLoss())
    raise ValueError(f"case: must be one of {CASES + SCALE_CASES + REAL_CASES}, got {name!r}")


# name -> (model kind, batch, reduced batch); the sizes of :func:`real_model`.
_REAL = {"gpt2-small-b16": ("gpt2-small", 16, 4), "gpt2-small-b32": ("gpt2-small", 32, 8),
         "resnet18-b256": ("resnet18", 256, 4), "resnet18-b1024": ("resnet18", 1024, 16),
         "bert-base-b32": ("bert-base", 32, 4)}


def real_model(kind: str, reduced: bool = False) -> tuple[nn.Module, int]:
    """The model of a real case and its sequence length (0 for images): ``gpt2-small`` (GPT-2 small: 12
    layers, width 768, 12 heads, 50257 tokens, tied head; T = 512 positions: 1.240 * 10^8 parameters),
    ``resnet18`` (:func:`resnet18`, 1.12 * 10^7) or ``bert-base`` (12 layers, width 768, 12 heads, 30522
    tokens, T = 128 positions, 2 classes: 1.092 * 10^8). ``reduced``: the same architecture at a small size,
    for CPU tests: 2 layers, width 64, 4 heads, 1000 tokens, T = 32 (GPT-2) or 16 (BERT); ResNet-18 with
    stage widths 8, 16, 32, 64."""
    if kind == "gpt2-small":
        length = 32 if reduced else 512
        sizes = dict(vocab=1000, width=64, layers=2, heads=4) if reduced else dict(vocab=50257, width=768,
                                                                                  layers=12, heads=12)
        return LanguageModel(length=length, **sizes), length
    if kind == "bert-base":
        length = 16 if reduced else 128
        sizes = dict(vocab=1000, width=64, layers=2, heads=4) if reduced else dict(vocab=30522, width=768,
                                                                                  layers=12, heads=12)
        return Classifier(length=length, **sizes), length
    if kind == "resnet18":
        return resnet18((8, 16, 32, 64) if reduced else (64, 128, 256, 512)), 0
    raise ValueError(f"kind: must be gpt2-small, resnet18 or bert-base, got {kind!r}")


def _real_case(name: str, batch: int | None, reduced: bool) -> Case:
    torch.manual_seed(0)
    kind, full, small = _REAL[name]
    b = batch or (small if reduced else full)
    model, length = real_model(kind, reduced)
    label = kind + ("-reduced" if reduced else "")
    if kind == "resnet18":
        data = [(torch.randn(b, 3, 32, 32), torch.randint(0, 10, (b,))) for _ in range(FRESH_BATCHES)]
        return Case(label + "-32x32", model, data, cross_entropy, nn.CrossEntropyLoss())
    vocab = model.gpt2.config.vocab_size if kind == "gpt2-small" else model.bert.config.vocab_size
    if kind == "bert-base":
        data = [(torch.randint(0, vocab, (b, length)), torch.randint(0, 2, (b,)))
                for _ in range(FRESH_BATCHES)]
        return Case(f"{label}-seq{length}", model, data, cross_entropy, nn.CrossEntropyLoss())
    # Language modelling: every position predicts a token (the loss reads all T positions).
    data = [(torch.randint(0, vocab, (b, length)), torch.randint(0, vocab, (b, length)))
            for _ in range(FRESH_BATCHES)]
    return Case(f"{label}-lm-seq{length}", model, data, cross_entropy, TokenCrossEntropy())


def _training_step(module: nn.Module, criterion: Callable[[Tensor, Tensor], Tensor],
                   optimizer: torch.optim.Optimizer, case: Case) -> Callable[[], None]:
    """Forward, backward and optimizer step on the case's full batch (the step every baseline times)."""
    x, y = case.batches[0]

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        criterion(module(x), y).backward()
        optimizer.step()

    return step


def _non_private(model: nn.Module, case: Case) -> Callable[[], None]:
    return _training_step(model, case.criterion, torch.optim.SGD(model.parameters(), lr=LR), case)


def _opacus_hooks(model: nn.Module, case: Case) -> Callable[[], None] | str:
    """Opacus' DP-SGD step with hook-computed per-sample gradients, or why there is none."""
    try:
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer
        from opacus.validators import ModuleValidator
    except ImportError:
        return "opacus is not installed"
    try:
        module = GradSampleModule(ModuleValidator.fix(model), loss_reduction="mean")
        if case.autocast is not None:
            # Under autocast Opacus sums bf16 per-sample gradients into a bf16 grad, which torch >= 2.9
            # refuses on a float32 parameter unless the parameter accepts any gradient dtype (its workaround),
            # and which SGD's multi-tensor (foreach) kernels refuse beside float32 parameters on CUDA.
            for p in module.parameters():
                if hasattr(p, "grad_dtype"):
                    p.grad_dtype = None
        inner = torch.optim.SGD(module.parameters(), lr=LR, foreach=None if case.autocast is None else False)
        optimizer = DPOptimizer(inner, noise_multiplier=SIGMA,
                                max_grad_norm=CLIP, expected_batch_size=case.batch, loss_reduction="mean")
        step = _training_step(module, case.criterion, optimizer, case)
        step()  # Opacus may refuse the model only when it runs
    except Exception as err:  # a refusal is a result to record
        return f"opacus refused the model: {type(err).__name__}: {err}"
    return step


def _opacus_ghost(model: nn.Module, case: Case) -> Callable[[], None] | str:
    """Opacus' ghost-clipping step, or why there is none."""
    try:
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
        from opacus.validators import ModuleValidator
    except ImportError:
        return "opacus is not installed"
    try:
        module = GradSampleModuleFastGradientClipping(
            ModuleValidator.fix(model), max_grad_norm=CLIP, use_ghost_clipping=True, loss_reduction="mean"
        )
        optimizer = DPOptimizerFastGradientClipping(
            torch.optim.SGD(module.parameters(), lr=LR), noise_multiplier=SIGMA, max_grad_norm=CLIP,
            expected_batch_size=case.batch, loss_reduction="mean",
        )
        criterion = DPLossFastGradientClipping(module, optimizer, copy.deepcopy(case.criterion),
                                               loss_reduction="mean")
        step = _training_step(module, criterion, optimizer, case)
        step()  # Opacus may refuse the model only when it runs
    except Exception as err:  # any refusal is a result to record, not a failure of the benchmark
        return f"opacus refused the model: {type(err).__name__}: {err}"
    return step


# The seeds of the two DP-SGD runs over the case's four batches (make_private's and the bare algorithm's):
# the same in both, so that they draw the same batches step for step and their times compare one work.
_NOISE_SEED, _SAMPLER_SEED = 47, 11
# Fixed-size batches without replacement: every timed step holds exactly the case's B records, as every
# other method's does (Poisson batches at rate 1/4 held 8, 13 and 11 records against B = 8, so the two
# columns could not be read against the non-private step).
_SAMPLING = "wor"


def _four_batches(case: Case) -> tuple[Tensor, Tensor]:
    """The case's four batches as one dataset (the records the two runs draw their B-record batches from)."""
    return torch.cat([b[0] for b in case.batches]), torch.cat([b[1] for b in case.batches])


def _seeded() -> object:
    """A reproducible runtime (fixed noise and sampler seeds): a benchmark's, never a release's."""
    from dpvr.optim import RuntimeConfig

    return RuntimeConfig(generator=ops.NoiseGenerator(_NOISE_SEED, reproducible=True),
                         sampler_seed=_SAMPLER_SEED)


def _make_private(model: nn.Module, case: Case) -> Callable[[], None]:
    """One step of the trainer that ``dpvr.make_private`` returns for DP-SGD on the case's four batches, on
    a fixed-size batch of exactly the case's B records (``sampling="wor"``)."""
    from torch.utils.data import TensorDataset

    from dpvr.trainer import make_private

    x, y = _four_batches(case)
    trainer = make_private(model, case.criterion, TensorDataset(x, y), algorithm="dp-sgd", epsilon=8.0,
                           batch_size=case.batch, steps=10_000, clip=CLIP, runtime=_seeded(),
                           sampling=_SAMPLING, optimizer=torch.optim.SGD(model.parameters(), lr=LR))

    def step() -> None:
        trainer.step()

    return step


def _bare_dp_sgd(model: nn.Module, case: Case) -> Callable[[], None]:
    """One step of ``dpvr.algorithms.DPSGD`` built directly, as :func:`_make_private` builds it (the same
    records, fixed-size batches of the case's B records, clip radius, budget, optimizer and seeds, so the
    same batches step for step), on the case's own per-record loss: what ``make_private`` costs beyond the
    algorithm is the difference."""
    from dpvr.algorithms import DPSGD
    from dpvr.optim import PrivacyConfig

    x, y = _four_batches(case)
    dtype = next(model.parameters()).dtype
    x = x.to(dtype) if x.is_floating_point() else x  # make_private casts the records to the model's dtype
    algorithm = DPSGD(model, case.loss, x, y, clip=CLIP, steps=10_000, batch_size=case.batch,
                      sampling=_SAMPLING, privacy=PrivacyConfig(epsilon=8.0, delta=1e-5), runtime=_seeded(),
                      optimizer=torch.optim.SGD(model.parameters(), lr=LR))
    return algorithm.step


class _Dpvr:
    """One of dpvr's step kinds on its own copy of the model, updated in place by the fused noisy update."""

    def __init__(self, model: nn.Module, case: Case, *, reuse_recording: bool = False) -> None:
        self.model, self.case = model, case
        self.ghost = GhostClipper(model, case.loss, reuse_recording=reuse_recording)
        self.params = list(model.parameters())
        self.flat = [p.data.view(-1) for p in self.params]
        self.prev = [p.detach().clone() for p in self.params]
        self.prev_flat = [p.view(-1) for p in self.prev]
        self.v = [torch.zeros_like(p) for p in self.flat]
        self.generator = ops.NoiseGenerator()
        self.generator.bind(b"bench")  # as the algorithms' generators are: each key hashes its release
        self.releases = 0
        self.move = LR  # ||x_r - x_{r-1}||, updated by every step
        self.fresh = cycle(case.batches)

    @cached_property
    def stepped(self) -> tuple[list[Tensor], list[Tensor]]:
        """Where a difference round's update writes its iterates and their previous values (see
        :meth:`diff_round`): made at the first round, so the other steps hold no copies of the model."""
        return [p.clone() for p in self.flat], [p.clone() for p in self.flat]

    def _update(self, sums: Sequence[Tensor], radius: float, *, reset: bool, stream: str,
                params: Sequence[Tensor] | None = None, params_prev: Sequence[Tensor] | None = None) -> Any:
        """The fused noisy update of ``params`` (default: the model's, ``prev`` receiving them); returns the
        norm of the parameter step."""
        self.releases += 1  # each release named, as the algorithms' ledgers name theirs
        self.generator.for_release(self.releases.to_bytes(8, "little"))
        return ops.noisy_update(
            self.v,
            sum=[s.view(-1) for s in sums],
            scale=1.0 / self.case.batch,
            sigma=SIGMA * radius / self.case.batch,
            reset=reset,
            generator=self.generator,
            stream=stream,
            params=self.flat if params is None else params,
            params_prev=self.prev_flat if params_prev is None else params_prev,
            lr=LR,
        )

    def dp_sgd(self) -> None:
        x, y = self.case.batches[0]
        # The sums in float64 up to the noise, as DPSGD releases them (``ClippedGradients.sum``; the fused
        # update takes a float64 sum beside float32 values): rounding them to float32 here would time a
        # step no algorithm takes.
        result = self.ghost.clipped_sum(x, y, CLIP, wide=True)
        self.move = self._update(result.sums, CLIP, reset=True, stream="dp-sgd")

    def diff_round(self, *, fresh: bool = False, materialised: bool = False) -> None:
        """One difference round between the model's point and the previous one, timed from the same state
        every time: its update does the full work (the same kernel, flags and sizes) into buffers of its
        own, so the two points, the radius and the noise keep their scale. Stepping the model instead made
        the rounds diverge: the radius follows the last move and the noise the radius, a growth of ``LR
        SIGMA CLIP2 sqrt(d) / B`` per round (about 50 on the ResNet, 230 on GPT-2 14M), so that a bench's
        later rounds timed a diverging model (the ResNet's round went from 2.2 to 3.5 s by the sixth).
        The kept recording is then the model's point, reused as it is in a run, and the previous point is
        recorded: one recording per round either way."""
        x, y = next(self.fresh) if fresh else self.case.batches[0]
        radius = CLIP2 * float(self.move)  # on CUDA a device value: reading it waits for the device
        now = [p.detach() for p in self.params]
        before = [p.view_as(q) for p, q in zip(self.prev_flat, self.params)]
        if materialised:
            grads, grads_prev = per_sample_grads_at_two_points(self.model, self.case.loss, x, y, now, before)
            sums = [torch.zeros_like(p) for p in self.flat]
            ops.clip_accumulate_diff(grads, grads_prev, radius, sums)
        else:
            # float64 up to the noise, as the algorithms' difference rounds release them (ClippedGradients)
            sums = self.ghost.clipped_diff_sum(x, y, now, before, radius, wide=True).sums
        params, params_prev = self.stepped
        self._update(sums, radius, reset=False, stream="difference", params=params, params_prev=params_prev)


class _NativeTimer:
    """Stands in for ``dpvr._C`` and adds up the wall time of every call into it."""

    def __init__(self, module: object) -> None:
        self._module, self.seconds = module, 0.0

    def __getattr__(self, name: str) -> Callable:
        function = getattr(self._module, name)

        def timed(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def _native_share(fn: Callable[[], None], rounds: int) -> float:
    """Fraction of ``fn``'s wall time spent in the native core."""
    from dpvr.ops import ghost, kernels

    saved = kernels._C, ghost._C
    timer = _NativeTimer(saved[0])
    kernels._C = ghost._C = timer
    try:
        start = time.perf_counter()
        for _ in range(rounds):
            fn()
        total = time.perf_counter() - start
    finally:
        kernels._C, ghost._C = saved
    return timer.seconds / total


def _restarted(case: Case, **options: bool) -> _Dpvr:
    """A dpvr step on its own copy after the restart round: two distinct iterates, the first recorded."""
    dpvr_step = _Dpvr(copy.deepcopy(case.model), case, **options)
    dpvr_step.dp_sgd()
    return dpvr_step


def _too_large_to_materialise(case: Case) -> str | None:
    """Why the per-sample gradients of ``case`` cannot be materialised here, or None: they hold
    ``B x d`` numbers, and a method that forms them (Opacus' hooks, a materialised difference round) needs
    two to three such blocks at once; past a third of the device's memory it would be killed, not timed."""
    d = sum(p.numel() for p in case.model.parameters())
    need = case.batch * d * next(case.model.parameters()).element_size()
    if case.device.type == "cuda":
        total = torch.cuda.mem_get_info(case.device)[1]
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if 3 * need <= total:
        return None
    return (f"its per-sample gradients ({case.batch} x {d}) take {need / 2**30:.1f} GiB, more than a third "
            f"of this device's {total / 2**30:.0f} GiB")


# The methods timed on the real cases: the targets (DP-SGD, make_private, the reused DIFF2 round)
# and both Opacus steps; the recomputed and fresh-batch rounds are left out to keep a device visit short.
REAL_METHODS = ("non-private", "opacus-hooks-dp-sgd", "opacus-ghost-dp-sgd", "dpvr-make-private-dp-sgd",
                "dpvr-dp-sgd-bare", "dpvr-dp-sgd-ghost", "dpvr-diff2-ghost")


def _precision(case: Case) -> contextlib.AbstractContextManager:
    """The case's ``torch.autocast`` region (nothing without one)."""
    if case.autocast is None:
        return contextlib.nullcontext()
    return torch.autocast(case.device.type, dtype=case.autocast)


def _under_autocast(fn: Callable[[], None], case: Case) -> Callable[[], None]:
    """``fn`` run inside the case's autocast region, as a user's training loop runs its step."""
    if case.autocast is None:
        return fn

    def step() -> None:
        with _precision(case):
            fn()

    return step


def _builders(case: Case) -> dict[str, Callable[[], Callable[[], None] | str]]:
    """Per method that runs on ``case``, what builds its step (or gives why it has none)."""
    builders: dict[str, Callable[[], Callable[[], None] | str]] = {
        "non-private": lambda: _non_private(copy.deepcopy(case.model), case),
        "opacus-hooks-dp-sgd": lambda: _opacus_hooks(copy.deepcopy(case.model), case),
        "opacus-ghost-dp-sgd": lambda: _opacus_ghost(copy.deepcopy(case.model), case),
        "dpvr-make-private-dp-sgd": lambda: _make_private(copy.deepcopy(case.model), case),
        "dpvr-dp-sgd-bare": lambda: _bare_dp_sgd(copy.deepcopy(case.model), case),
        "dpvr-dp-sgd-ghost": lambda: _Dpvr(copy.deepcopy(case.model), case).dp_sgd,
        "dpvr-diff2-ghost": lambda: _restarted(case, reuse_recording=True).diff_round,
        "dpvr-diff2-ghost-recompute": lambda: _restarted(case).diff_round,
        "dpvr-fresh-diff-ghost": lambda: partial(_restarted(case).diff_round, fresh=True),
    }
    if case.name.startswith("mlp"):
        builders["dpvr-diff2-materialised"] = lambda: partial(_restarted(case).diff_round, materialised=True)
    return builders


def _methods(case: Case, methods: Sequence[str] | None = None,
             ) -> tuple[dict[str, Callable[[], None]], dict[str, str]]:
    """The step of every method on ``case`` (each on its own copy of the model, run once), and why each
    method that has none has none (Opacus missing or refusing the model; per-sample gradients too large
    for this device; a method failing on this device, with its traceback printed: a finding to record, not
    a reason to lose the other methods' figures)."""
    builders = _builders(case)
    if methods is not None:
        unknown = set(methods) - set(builders)
        if unknown:
            raise ValueError(f"methods: unknown {sorted(unknown)}; known: {list(builders)}")
        builders = {name: build for name, build in builders.items() if name in methods}
    too_large = _too_large_to_materialise(case)
    if too_large:
        for name in ("opacus-hooks-dp-sgd", "dpvr-diff2-materialised"):
            if name in builders:
                builders[name] = lambda: too_large  # a reason, recorded as the method's skip
    fns: dict[str, Callable[[], None]] = {}
    missing: dict[str, str] = {}
    for name, build in builders.items():
        try:
            fn = build()  # outside autocast, as a user builds a trainer; then stepped as it will be timed
            if callable(fn):
                with _precision(case):
                    fn()
        except Exception as err:
            if name == "non-private":
                raise
            traceback.print_exc()
            fn = f"failed: {type(err).__name__}: {err}"
        if callable(fn):
            fns[name] = _under_autocast(fn, case)
        else:
            missing[name] = fn
    return fns, missing


def run_case(case: Case, *, repeats: int, warmup: int, memory: bool = False, share_rounds: int = 5,
             methods: Sequence[str] | None = None) -> list[Record]:
    """Times every method on ``case`` (or those named in ``methods``; interleaved) and returns one record
    per method."""
    on_cuda = case.device.type == "cuda"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus' notices about secure RNG and hooks
        fns, missing = _methods(case, methods)
        ms = interleaved_median_ms(fns, repeats=repeats, warmup=warmup, sync=device_sync(case.device))
        peaks = {name: peak_bytes(fn, str(case.device)) / 2**20 for name, fn in fns.items()} if memory else {}
        syncs = {name: host_syncs(fn) for name, fn in fns.items()} if on_cuda else {}
    common = {
        "batch": case.batch,
        "d": sum(p.numel() for p in case.model.parameters()),
        "device": torch.cuda.get_device_name(case.device) if on_cuda else "cpu",
        "threads": torch.get_num_threads(),
        "autocast": None if case.autocast is None else str(case.autocast).removeprefix("torch."),
    }
    records = []
    for method, t in ms.items():
        metrics = {"ms": t, **common, "ratio_vs_non_private": t / ms["non-private"]}
        if on_cuda:
            metrics["host_syncs"], metrics["host_sync_sites"] = syncs[method]
        if method.startswith("dpvr"):
            if not on_cuda:  # on a device the native calls only queue work: their host time says nothing
                metrics["native_share"] = _native_share(fns[method], share_rounds)
            for opacus, key in (("opacus-ghost-dp-sgd", "ratio_vs_opacus_ghost"),
                                ("opacus-hooks-dp-sgd", "ratio_vs_opacus_hooks")):
                if opacus in ms:
                    metrics[key] = t / ms[opacus]
            if method == "dpvr-make-private-dp-sgd" and "dpvr-dp-sgd-bare" in ms:
                metrics["ratio_vs_bare"] = t / ms["dpvr-dp-sgd-bare"]
        if memory:
            metrics["peak_mib"] = peaks[method]
            metrics["memory_vs_non_private"] = peaks[method] / max(peaks["non-private"], 1e-9)
            if method.startswith("dpvr") and "opacus-ghost-dp-sgd" in peaks:
                metrics["memory_vs_opacus_ghost"] = peaks[method] / max(peaks["opacus-ghost-dp-sgd"], 1e-9)
        records.append(Record(method=method, dataset=case.label, metrics=metrics))
    records += [Record(method=m, dataset=case.label, metrics={**common, "skipped": why})
                for m, why in missing.items()]
    return records


def _in_own_process(spec: dict[str, Any], methods: list[str], threads: int, options: dict[str, Any],
                    keep_freed_memory: bool = False) -> list[Record]:
    """:func:`run_case` of ``methods`` on the case ``spec`` describes (:func:`make_case`'s arguments), in
    a fresh process (the target of :func:`run_isolated`'s workers), each record with the process's peak
    resident memory (``max_rss_mib``)."""
    torch.set_num_threads(threads)
    kept = keep_freed_memory and ops.keep_freed_memory()  # False where the C library is not glibc
    records = run_case(make_case(**spec), methods=methods, **options)
    import resource  # here only: a POSIX module, and only these workers read it

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    for r in records:
        r.metrics.update(max_rss_mib=rss, freed_memory="kept" if kept else "returned")
    return records


def run_isolated(spec: dict[str, Any], *, repeats: int, warmup: int, memory: bool = False,
                 share_rounds: int = 5, methods: Sequence[str] | None = None,
                 keep_freed_memory: bool = False) -> list[Record]:
    """:func:`run_case` with each method in a process of its own, timed against a non-private step
    interleaved with it in that process; one record per method, as :func:`run_case` gives.

    Why: a user trains one method per process. Nine methods in one process share the C library's heap, its
    trimming and its page faults, and the cache: the ResNet's DP-SGD step took 1.46 s beside a non-private
    step and a DIFF2 round against 1.34-1.37 s alone. Each method's ratio to the non-private step is its
    own process's; ratios between methods (to Opacus, to the bare step) are ratios of those ratios, and the
    non-private record's time is the median of the processes'. ``spec``: :func:`make_case`'s arguments;
    ``keep_freed_memory``: every process runs :func:`dpvr.ops.keep_freed_memory` first."""
    case = make_case(**spec)
    label, names = case.label, [m for m in (methods or _builders(case)) if m != "non-private"]
    del case  # each process makes its own
    options = {"repeats": repeats, "warmup": warmup, "memory": memory, "share_rounds": share_rounds}
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no heap, cache or threads shared
    own: dict[str, dict[str, Record]] = {}
    for name in tqdm(names, desc=label, unit="method", leave=False):
        with ProcessPoolExecutor(1, mp_context=context) as pool:
            got = pool.submit(_in_own_process, spec, ["non-private", name], torch.get_num_threads(), options,
                              keep_freed_memory)
            own[name] = {r.method: r for r in got.result()}
    timed = {name: rs[name].metrics for name, rs in own.items() if "ms" in rs[name].metrics}
    references = [rs["non-private"].metrics for rs in own.values()]
    reference = dict(references[0]) if references else {}
    if references:
        reference["ms"] = statistics.median(r["ms"] for r in references)
        reference.pop("max_rss_mib", None)  # each process's, with the method timed there
    for name, metrics in timed.items():
        for other, key in (("opacus-ghost-dp-sgd", "ratio_vs_opacus_ghost"),
                           ("opacus-hooks-dp-sgd", "ratio_vs_opacus_hooks")):
            if name.startswith("dpvr") and other in timed:
                metrics[key] = metrics["ratio_vs_non_private"] / timed[other]["ratio_vs_non_private"]
        if name == "dpvr-make-private-dp-sgd" and "dpvr-dp-sgd-bare" in timed:
            metrics["ratio_vs_bare"] = (metrics["ratio_vs_non_private"]
                                        / timed["dpvr-dp-sgd-bare"]["ratio_vs_non_private"])
        if memory and name.startswith("dpvr") and "opacus-ghost-dp-sgd" in timed:
            metrics["memory_vs_opacus_ghost"] = (metrics["peak_mib"]
                                                 / max(timed["opacus-ghost-dp-sgd"]["peak_mib"], 1e-9))
    return ([Record(method="non-private", dataset=label, metrics=reference)] if references else []) + [
        own[name][name] for name in names]


# The step costs dpvr aims at, as multiples of the non-private step (time; memory: 1.5x for every step).
TARGETS = {"dpvr-dp-sgd-ghost": 1.3, "dpvr-diff2-ghost": 1.5, "dpvr-fresh-diff-ghost": 2.3}
MEMORY_TARGET = 1.5
_PLOTTED = {
    "opacus-ghost-dp-sgd": "Opacus ghost DP-SGD",
    "dpvr-dp-sgd-ghost": "dpvr DP-SGD",
    "dpvr-diff2-ghost": "dpvr DIFF2 round (reused)",
    "dpvr-diff2-ghost-recompute": "dpvr DIFF2 round (recomputed)",
    "dpvr-fresh-diff-ghost": "dpvr fresh-batch round",
}


def _ratios(shown: dict[str, dict], names: Sequence[str], key: str) -> list[float]:
    """``key`` of each method's metrics; NaN (no bar) for a method the case lacks."""
    return [shown.get(m, {}).get(key, math.nan) for m in names]


def plot(records: Sequence[Record], path: str) -> None:
    """One panel per case: each method's time (and, when measured, peak memory) as a multiple of the
    non-private step, with the targets marked (``|``). The materialised DIFF2 round (tens of times the
    step) is left out so that the others stay readable."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed

    from dpvr.results import write_figure

    cases = list(dict.fromkeys(r.dataset for r in records))
    names, rows = list(_PLOTTED), range(len(_PLOTTED))  # one row per method in every panel
    fig = Figure(figsize=(4 + 3 * len(cases), 3.8), layout="constrained")
    axes = fig.subplots(1, len(cases), squeeze=False, sharey=True)[0]
    for ax, case in zip(axes, cases):
        shown = {r.method: r.metrics for r in records if r.dataset == case and "ms" in r.metrics}
        ax.barh([y - 0.2 for y in rows], _ratios(shown, names, "ratio_vs_non_private"), height=0.4,
                label="time")
        marked = [(TARGETS[m], y - 0.2) for m, y in zip(names, rows) if m in TARGETS]
        if any("memory_vs_non_private" in metrics for metrics in shown.values()):
            ax.barh([y + 0.2 for y in rows], _ratios(shown, names, "memory_vs_non_private"), height=0.4,
                    label="peak memory", alpha=0.5)
            marked += [(MEMORY_TARGET, y + 0.2) for m, y in zip(names, rows) if m.startswith("dpvr")]
        ax.plot([t for t, _ in marked], [y for _, y in marked], "k|", markersize=12, label="target")
        ax.axvline(1.0, color="grey", linewidth=0.8)
        ax.set_yticks(list(rows), [_PLOTTED[m] for m in names])
        ax.set_xlabel("× the non-private step")
        ax.set_title(case)
        ax.grid(True, axis="x", alpha=0.3)
    axes[0].invert_yaxis()  # shared: the first method on top in every panel
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=3)
    write_figure(path, fig, dpi=120)


_SCALED = {
    "non-private": ("non-private", "C7"),
    "opacus-hooks-dp-sgd": ("Opacus hooks DP-SGD", "C3"),
    "dpvr-dp-sgd-ghost": ("dpvr DP-SGD", "C0"),
    "dpvr-make-private-dp-sgd": ("dpvr make_private DP-SGD", "C9"),
    "dpvr-diff2-ghost": ("dpvr DIFF2 round", "C2"),
}
_GPT2_LABEL = re.compile(r"(gpt2-\d+M)-seq(\d+)/")


def scale_plot(records: Sequence[Record], path: str) -> None:
    """Time and peak memory of one step against the sequence length T (log-log), a line per library's step
    and GPT-2 size (solid: the smaller model), from the records of the ``gpt2-1e*-t*`` cases."""
    from matplotlib.figure import Figure

    from dpvr.results import write_figure

    series: dict[tuple[str, str], list[tuple[int, float, float | None]]] = {}
    for r in records:
        match = _GPT2_LABEL.match(r.dataset)
        if match and r.method in _SCALED and "ms" in r.metrics:
            series.setdefault((match[1], r.method), []).append(
                (int(match[2]), r.metrics["ms"], r.metrics.get("peak_mib")))
    models = sorted({model for model, _ in series}, key=lambda m: int(m.removeprefix("gpt2-")[:-1]))
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    for (model, method), points in sorted(series.items()):
        points.sort()
        name, color = _SCALED[method]
        style = ["-", "--", ":"][models.index(model) % 3]
        label = f"{name}, {model}"
        axes[0].plot([t for t, _, _ in points], [ms / 1e3 for _, ms, _ in points], style, marker="o",
                     color=color, label=label)
        if all(peak is not None for _, _, peak in points):
            axes[1].plot([t for t, _, _ in points], [peak for _, _, peak in points], style, marker="o",
                         color=color, label=label)
    for ax, title in zip(axes, ("time of one step (s)", "peak tensor memory of one step (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    write_figure(path, fig, dpi=120)


def sequence_scaling(records: Sequence[Record]) -> list[tuple[str, float, float | None]]:
    """Per GPT-2 size and method, the exponents of time and peak memory in the sequence length T fitted (least
    squares in log-log) over the records of that one model at several lengths (the ``gpt2-1e7-t*`` cases, and
    apart from them the ``gpt2-1e8-t*`` ones): ``ms ~ T^a``. Each row is named ``method (model)``."""
    import numpy as np

    by_model: dict[tuple[str, str], list[tuple[float, float, float | None]]] = {}
    for r in records:
        match = _GPT2_LABEL.match(r.dataset)
        if match and "ms" in r.metrics:
            by_model.setdefault((match[1], r.method), []).append(
                (float(match[2]), r.metrics["ms"], r.metrics.get("peak_mib")))
    fits = []
    for (model, method), points in by_model.items():
        if len({t for t, _, _ in points}) < 2:
            continue
        t = np.log([p[0] for p in points])
        time_exponent = float(np.polyfit(t, np.log([p[1] for p in points]), 1)[0])
        memory = [p[2] for p in points]
        memory_exponent = (float(np.polyfit(t, np.log(memory), 1)[0])
                           if all(m is not None and m > 0 for m in memory) else None)
        fits.append((f"{method} ({model})", time_exponent, memory_exponent))
    return fits


def run(*, cases: Sequence[str] = CASES, quick: bool = False, repeats: int = 7, memory: bool = False,
        batch: int | None = None, device: str = "cpu", reduced: bool = False,
        autocast: torch.dtype | None = None, isolated: bool = False,
        keep_freed_memory: bool = False) -> list[Record]:
    """Times each method on each case (``quick``: at most 3 rounds, 1 warm-up); ``batch`` overrides every
    case's batch size (tests run tiny rounds with it); ``reduced`` runs the real cases (:data:`REAL_CASES`)
    at a small size, ``autocast`` every step under ``torch.autocast`` in that dtype; ``isolated``: each
    method in a process of its own (:func:`run_isolated`), else all in this one, interleaved;
    ``keep_freed_memory``: :func:`dpvr.ops.keep_freed_memory` in every process that times (in this one,
    for the rest of its life, without ``isolated``). The real cases
    time :data:`REAL_METHODS`, the others every method. One record per method and case."""
    records = []
    if keep_freed_memory and not isolated:
        ops.keep_freed_memory()
    for name in cases:
        spec = {"name": name, "batch": batch, "device": device, "reduced": reduced and name in REAL_CASES,
                "autocast": autocast}
        options = {"repeats": min(repeats, 3) if quick else repeats, "warmup": 1 if quick else 2,
                   "memory": memory, "share_rounds": 2 if quick else 5,
                   "methods": REAL_METHODS if name in REAL_CASES else None}
        if isolated:
            records += run_isolated(spec, **options, keep_freed_memory=keep_freed_memory)
            continue
        case = make_case(**spec)
        records += run_case(case, **options)
        del case
        if device.startswith("cuda"):
            torch.cuda.empty_cache()  # the next case's models start from an empty cache
    return records


def explain(*, cases: Sequence[str] = CASES, batch: int | None = None, device: str = "cpu",
            reduced: bool = False, rounds: int = 3) -> str:
    """Per case, each linear map's (or convolution's) norm form as the ghost clipper chose it for dpvr's
    DP-SGD step: the shapes ``B, T, p, q``, the form, the clipped sum's form (``float64``, ``record32``:
    each record's float32 matrix summed in float64, or ``materialised``), the predicted milliseconds of
    every form (``-``: refused by the memory budget or without steps), then the measured native share of
    the step (``rounds`` steps). Host only: off the host the clipper keeps the memory rule and the native core
    does not run."""
    if not device.startswith("cpu"):
        raise ValueError("--explain: the time-based choice is made on the host only (use --device cpu)")
    lines = []
    for name in cases:
        case = make_case(name, batch, device, reduced=reduced and name in REAL_CASES)
        dpvr_step = _Dpvr(copy.deepcopy(case.model), case)
        dpvr_step.dp_sgd()
        share = _native_share(dpvr_step.dp_sgd, rounds)
        lines.append(f"{case.label}: DP-SGD step, native share {share:.2f}")
        lines.append(f"  {'layer':<40} {'B':>5} {'T':>6} {'p':>6} {'q':>6} {'form':<12} {'sum':<12} "
                     + " ".join(f"{f + ' ms':>14}" for f in _FORMS))
        for layer, choice in dpvr_step.ghost.choices.items():
            b, t, p, q = choice.shapes
            ms = ["-" if math.isinf(choice.seconds[f]) else f"{1e3 * choice.seconds[f]:.3f}" for f in _FORMS]
            predicted = " ".join(f"{m:>14}" for m in ms)
            lines.append(f"  {layer:<40} {b:>5} {t:>6} {p:>6} {q:>6} {choice.form:<12} {choice.sum_form:<12} "
                         f"{predicted}")
        if not dpvr_step.ghost.choices:
            lines.append("  (no linear map or convolution clipped from its activations)")
        del case
    return "\n".join(lines)
