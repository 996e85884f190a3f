"""PrivateDiff Minimax (Zhang et al.), section 9.1.4: DP transfer learning for AUC, PrivateDiff vs DP-SGDA.

The paper pre-trains a ResNet-20 on CIFAR-100 (public) and fine-tunes it privately on CIFAR-10 (balanced,
imbalanced, heavy-tailed) for AUC (its Table 3). The same setting with the data at hand:

- **Public and private parts.** Per seed, scikit-learn's digits (pixels mapped from their declared range
  0..16 onto [0, 1], no statistic of the data fitted) are split 70/30 into train and test;
  ``PUBLIC_CLASSES`` (4) of the 10 classes, drawn at random, are the public part (all their images); the
  other 6 are private. The private classes are split at random into 3 positive and 3 negative ones.
- **Variants** (training split only; the test split stays as it is, except the imbalanced test set,
  subsampled to 0.5 positives as in the AUC experiment): ``transfer-balanced``; ``transfer-imbalanced``
  (positives subsampled to 0.1); ``transfer-heavy-tailed`` (CIFAR10-ST style: of the first half of the
  private class codes only the last ``TAIL_KEEP`` training images each are kept).
- **Pre-training** (non-private, public data only): the AUC experiment's 256-128 ReLU MLP with a 4-way
  softmax head, cross-entropy, Adam (lr 1e-3, batches of 64, ``--pretrain-epochs``). Its hidden layers are
  then the start of every private run; the head is replaced by a fresh one-output layer (public
  initialisation) and the whole network is fine-tuned.
- **Fine-tuning**: exactly the AUC experiment's methods, objective, privacy accounting and learning-rate
  selection (:mod:`dpvr_lab.experiments.auc`): non-private SGDA, DP-SGDA and PrivateDiff on AUC-M ``v1``. The
  positive ratio ``p`` is public: 0.1 for the imbalanced variant, the share of positive classes (0.5)
  otherwise (the heavy-tailed cut changes the real ratio; ``p`` stays the protocol's). As there, train AUC
  and gradient norm are diagnostics, not private.
  **The learning-rate selection uses the private training data and is not covered by the accounting.**
- **Privacy**: ``(epsilon, delta)``-DP for the private part, ``delta = 1/n^1.1``; the pre-training reads
  public data only, so it costs nothing.

Scale: default epsilons {0.5, 1, 5, 10} (Table 3), the AUC experiment's digits protocol (60 epochs, batch
256, 5 seeds); ``--quick``: 30 epochs, 2 seeds, epsilon 1 and 10.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from typing import Any

import numpy as np
import torch
from torch import nn

from dpvr.data import DIGITS_RANGE, Dataset, binarize, load, long_tail, split_classes, subsample_to_ratio
from dpvr.data import train_test_split as split_train_test
from dpvr.objectives import AUCMargin, AUCModel
from dpvr.ops import torch_threads
from dpvr.results import Record, document

from . import auc
from .common import derive_seed, progress, save

NAME = "transfer"
DATASETS = ("transfer-balanced", "transfer-imbalanced", "transfer-heavy-tailed")
PUBLIC_CLASSES = 4
TAIL_KEEP = 10  # images kept per cut class (CIFAR10-ST keeps 100 of 5000; ~125 digits per class here)
PRETRAIN_EPOCHS = 30
PREPROCESSING = f"pixels, {DIGITS_RANGE.description}; no statistic of the data is fitted"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    auc.add_arguments(parser)
    parser.add_argument(
        "--pretrain-epochs", type=int, default=PRETRAIN_EPOCHS, help="epochs of public pre-training"
    )


@dataclasses.dataclass
class _Split:
    public: tuple[torch.Tensor, torch.Tensor]  # features, class index among the public classes
    private: auc._Data


def _split(name: str, seed: int) -> _Split:
    digits = DIGITS_RANGE(load("digits"))
    train, test = split_train_test(digits, test_fraction=0.3, seed=derive_seed(seed, 1))
    order = np.random.default_rng(derive_seed(seed, 2)).permutation(digits.num_classes)
    public, private = np.sort(order[:PUBLIC_CLASSES]), np.sort(order[PUBLIC_CLASSES:])
    positive = private[list(split_classes(len(private), seed=derive_seed(seed, 3)))]

    def part(d: Dataset, classes: np.ndarray) -> Dataset:
        return d.subset(np.flatnonzero(np.isin(d.targets, classes)))

    pub = torch.cat([torch.as_tensor(part(d, public).features, dtype=torch.float32) for d in (train, test)])
    pub_targets = np.concatenate([part(d, public).targets for d in (train, test)])
    pub_labels = torch.as_tensor(np.searchsorted(public, pub_targets))
    train, test = part(train, private), part(test, private)
    ratio = len(positive) / len(private)  # the share of positive classes: public
    if name == "transfer-heavy-tailed":
        train = long_tail(train, TAIL_KEEP, classes=private[: len(private) // 2])
    train, test = binarize(train, positive), binarize(test, positive)
    if name == "transfer-imbalanced":
        train = subsample_to_ratio(train, auc.IMBALANCED_TRAIN, seed=derive_seed(seed, 4))
        test = subsample_to_ratio(test, auc.IMBALANCED_TEST, seed=derive_seed(seed, 5))
        ratio = auc.IMBALANCED_TRAIN

    def tensors(d: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.as_tensor(d.features, dtype=torch.float32), torch.as_tensor(d.targets)

    return _Split((pub, pub_labels), auc._Data(tensors(train), tensors(test), ratio))


def _pretrained(public: tuple[torch.Tensor, torch.Tensor], epochs: int, seed: int) -> AUCModel:
    """The AUC experiment's model whose hidden layers were trained (non-privately) on the public classes."""
    model = auc._model(public[0].shape[1], seed)
    trunk = list(model.net)[:-1]
    classifier = nn.Sequential(*trunk, nn.Linear(auc.HIDDEN[-1], PUBLIC_CLASSES))  # shares the trunk
    optimiser = torch.optim.Adam(classifier.parameters(), lr=1e-3)
    shuffle = torch.Generator().manual_seed(derive_seed(seed, 6) % 2**63)
    for _ in range(epochs):
        for batch in torch.randperm(len(public[0]), generator=shuffle).split(64):
            optimiser.zero_grad()
            nn.functional.cross_entropy(classifier(public[0][batch]), public[1][batch]).backward()
            optimiser.step()
    return model


def _accuracy(model: AUCModel, public: tuple[torch.Tensor, torch.Tensor]) -> float:
    """Public-class accuracy of the pre-trained trunk with a least-squares linear read-out (a sanity check
    that pre-training learned features; public data only)."""
    with torch.no_grad():
        features = nn.Sequential(*list(model.net)[:-1])(public[0]).double()
        onehot = nn.functional.one_hot(public[1], PUBLIC_CLASSES).double()
        readout = torch.linalg.lstsq(features, onehot).solution
        return float(((features @ readout).argmax(1) == public[1]).double().mean())


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the experiment (see the module documentation); returns the result document."""
    epsilons = tuple(args.epsilon or ((1.0, 10.0) if args.quick else auc.EPSILONS))
    names = list(args.dataset or DATASETS)
    unknown = sorted(set(names) - set(DATASETS))
    if unknown:
        raise ValueError(f"--dataset: unknown {unknown}; known: {', '.join(DATASETS)}")
    base = auc.QUICK if args.quick else auc.SCALED
    protocol = dataclasses.replace(
        base,
        epochs=args.epochs or base.epochs,
        batch_size=args.batch_size or base.batch_size,
        seeds=args.seeds or base.seeds,
        shares=None if args.shares == "equal" else args.shares,
    )
    protocols = dict.fromkeys(names, protocol)
    methods = auc.selected_methods(args)
    total = len(names) * protocol.seeds * len(protocol.lr_pairs) * (1 + (len(methods) - 1) * len(epsilons))
    found: dict[tuple[str, float | None, str], list[auc._Run]] = {}
    records: list[Record] = []
    deltas: dict[str, float] = {}
    public_accuracy: dict[str, list[float]] = {}
    with torch_threads(1), progress(total, NAME) as bar:
        for name in names:
            for seed in range(protocol.seeds):
                split = _split(name, seed)
                data = split.private
                deltas[name] = data.delta
                init = _pretrained(split.public, args.pretrain_epochs, seed)
                public_accuracy.setdefault(name, []).append(_accuracy(init, split.public))
                problem = AUCMargin(data.positive_ratio)
                for epsilon in (None, *epsilons):
                    for method in methods[1:] if epsilon is not None else methods[:1]:
                        bar.set_postfix_str(f"{name} seed {seed} eps {epsilon} {method}")
                        noise_seed = derive_seed(seed, auc.METHODS.index(method), round((epsilon or 0) * 1e6))
                        best = auc._tune(
                            method, copy.deepcopy(init), problem, data, protocol, epsilon, noise_seed, bar
                        )
                        found.setdefault((name, epsilon, method), []).append(best)
                        records.append(auc.run_record(best, method, name, epsilon, data.delta, seed))
    config = {
        "datasets": names,
        "preprocessing": PREPROCESSING,
        "epsilons": list(epsilons),
        "delta": "1/n^1.1 (n: private training records)",
        "deltas": deltas,
        "public_classes": PUBLIC_CLASSES,
        "tail_keep": TAIL_KEEP,
        "pretrain_epochs": args.pretrain_epochs,
        "public_readout_accuracy": public_accuracy,
        "model": f"MLP {auc.HIDDEN[0]}-{auc.HIDDEN[1]} ReLU pre-trained on the public classes, AUC-M v1",
        "clips": auc.CLIPS,
        "restart": auc.RESTART,
        "y_steps": auc.Y_STEPS,
        "y_release": list(dict.fromkeys(args.y_release)),
        "shares": args.shares,
        "quick": bool(args.quick),
        "protocol": dataclasses.asdict(protocol),
        "hyperparameter_tuning_accounted": False,
    }
    doc = document(NAME, config, records)
    auc._report(found, names, epsilons, methods, protocols, private_tuning=False)
    paths = save(doc, records, args.out)
    paths += auc._plots(found, names, epsilons, methods, protocols, args.out)
    print("\nwrote " + ", ".join(paths))
    return doc
