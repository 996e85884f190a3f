"""The PyTorch front door: make_private with an ordinary model, criterion, DataLoader and optimizer."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import dpvr
from dpvr.objectives import ClassDRO
from dpvr.optim import BudgetExhaustedError

EPSILON = 3.0


@pytest.fixture(scope="module")
def digits() -> tuple[TensorDataset, torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    return TensorDataset(x[:1400], y[:1400]), x[1400:], y[1400:]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def _loader(dataset: TensorDataset) -> DataLoader:
    return DataLoader(dataset, batch_size=64, shuffle=True)


CASES = {
    "dp-sgd": (lambda: nn.CrossEntropyLoss(), dict(batch_size=128, epochs=4, clip=1.0), 0.5),
    "diff2": (
        lambda: nn.CrossEntropyLoss(),
        dict(epochs=30, restart=5, clip={"restart": 1.0, "difference": 2.0}),
        0.4,
    ),
    "private-diff": (
        lambda: ClassDRO(nn.CrossEntropyLoss(), classes=10, lam=10.0),
        dict(
            batch_size=128,
            epochs=4,
            restart=5,
            y_steps=1,
            lr_y=0.02,
            clip={"checkpoint": 1.0, "difference": (2.0, 0.0), "y": 1.0},
        ),
        0.25,
    ),
}


@pytest.mark.parametrize(
    "algorithm",
    # private-diff in the slow run: four epochs of a minimax run (its front door's budget is checked in
    # test_registry's make_private runs, and its accounting in test_minimax)
    [pytest.param(a, marks=pytest.mark.slow) if a == "private-diff" else a for a in sorted(CASES)],
)
def test_a_digits_mlp_trains_with_adam_and_a_dataloader_within_the_budget(digits, algorithm) -> None:
    dataset, x_test, y_test = digits
    criterion, settings, floor = CASES[algorithm]
    model = _mlp()
    before = _accuracy(model, x_test, y_test)
    with pytest.warns(UserWarning, match="sampler and shuffling are replaced"):
        trainer = dpvr.make_private(
            model,
            criterion(),
            _loader(dataset),
            algorithm=algorithm,
            epsilon=EPSILON,
            optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
            **settings,
        )
    seen = []
    trainer.evaluate(lambda t, info: seen.append(t.steps_done), every=5)
    history = list(trainer)  # the trainer is an iterator over its remaining steps
    assert len(history) == trainer.total_steps == trainer.steps_done
    assert seen == list(range(5, trainer.total_steps + 1, 5))
    report = trainer.privacy_spent()
    assert report.epsilon <= EPSILON * (1 + 1e-9)
    assert report.epsilon == pytest.approx(EPSILON, rel=1e-3)  # the calibrated run spends its budget
    after = _accuracy(model, x_test, y_test)
    assert after >= floor > before + 0.1, (before, after)  # chance is 0.1


def test_the_sgd_default_needs_lr_and_the_run_stops_at_the_budget(digits) -> None:
    dataset, *_ = digits
    model = _mlp()
    with pytest.raises(ValueError, match="lr"):
        dpvr.make_private(
            model,
            nn.CrossEntropyLoss(),
            dataset,
            algorithm="dp-sgd",
            epsilon=1.0,
            batch_size=64,
            steps=3,
            clip=1.0,
        )
    trainer = dpvr.make_private(
        model, nn.CrossEntropyLoss(), dataset, algorithm="dp-gd", epsilon=1.0, steps=3, clip=1.0, lr=0.5
    )
    trainer.run()
    with pytest.raises(RuntimeError, match="planned steps"):
        trainer.step()
    assert trainer.privacy_spent().epsilon <= 1.0 + 1e-9
    assert isinstance(BudgetExhaustedError("x"), RuntimeError)


def test_state_round_trips_and_a_checkpoint_resumes(digits, tmp_path) -> None:
    dataset, *_ = digits
    model = _mlp()
    make = lambda m: dpvr.make_private(  # noqa: E731
        m,
        nn.CrossEntropyLoss(),
        dataset,
        algorithm="dp-sgd",
        epsilon=2.0,
        batch_size=128,
        steps=6,
        clip=1.0,
        optimizer=torch.optim.Adam(m.parameters(), lr=0.01),
    )
    trainer = make(model)
    trainer.run(3)
    trainer.save_checkpoint(str(tmp_path / "run.ckpt"))
    other = make(_mlp())
    other.load_checkpoint(str(tmp_path / "run.ckpt"))
    assert other.steps_done == 3
    for p, q in zip(model.parameters(), other.model.parameters()):
        torch.testing.assert_close(p, q)
    assert (
        other.algorithm.optimizer.state_dict()["state"].keys()
        == trainer.algorithm.optimizer.state_dict()["state"].keys()
    )
    other.run()
    assert other.steps_done == 6


class _Rows(nn.Module):  # the 8x8 image as a sequence of 8 rows of 8 pixels
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 10)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(inputs.view(-1, 8, 8))
        return self.head(out[:, -1])


class _Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(8, 8, 3, stride=2),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(8 * 3 * 3, 10),
        )

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.body(inputs.view(-1, 1, 8, 8))


def _auto_mode_trainer(
    dataset: TensorDataset, kind: str, **settings
) -> tuple[nn.Module, dpvr.PrivateTrainer]:
    torch.manual_seed(0)
    model = _Rows() if kind == "lstm" else _Conv()
    trainer = dpvr.make_private(
        model,
        nn.CrossEntropyLoss(),
        dataset,
        algorithm="dp-sgd",
        epsilon=8.0,
        clip=1.0,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.02),
        **settings,
    )
    return model, trainer


@pytest.mark.parametrize("kind", ["lstm", "cnn"])
def test_an_lstm_and_a_small_cnn_clip_in_auto_mode_as_a_per_record_loop(digits, kind) -> None:
    """The front door's auto mode (ghost clipping; the LSTM through its materialised fallback) computes the
    clipped sum that one backward pass per record, clipped and added, gives; and a run steps on it."""
    dataset, *_ = digits
    x, y = dataset.tensors
    # RDP (Poisson under add/remove, the size stated public): this test is about the clipped sums, not the
    # accounting, and PLD's calibration at this sampling rate takes seconds
    model, trainer = _auto_mode_trainer(dataset, kind, batch_size=32, steps=2, accountant="rdp",
                                        public_dataset_size=len(dataset))
    gradients = trainer.algorithm.gradients
    assert gradients.mode in ("ghost", "mixed")
    params = [p for p in model.parameters() if p.requires_grad]
    records = slice(0, 48)
    loop = [torch.autograd.grad(nn.functional.cross_entropy(model(xi[None]), yi[None]), params)
            for xi, yi in zip(x[records], y[records])]
    norms = [float(torch.sqrt(sum(g.double().pow(2).sum() for g in grads))) for grads in loop]
    clip = sorted(norms)[len(norms) // 2]  # the median: about half the records are clipped
    expected = [torch.zeros(p.numel()) for p in params]
    for grads, norm in zip(loop, norms):
        for e, g in zip(expected, grads):
            e.add_(g.reshape(-1) * min(1.0, clip / norm))
    got = [torch.zeros(p.numel()) for p in params]
    gradients.sum(x[records], y[records], clip, got)
    # Rounding: both are float32 sums of 48 contributions of norm <= clip, formed in other orders, so an entry
    # differs by at most a few ulp of 48 clip; a wrong clip factor or a missed record is off by ~clip.
    bound = 8 * 48 * torch.finfo(torch.float32).eps * clip
    for g, e in zip(got, expected):
        assert float((g - e).abs().max()) <= bound
    before = [p.detach().clone() for p in params]
    trainer.run()
    assert trainer.steps_done == 2
    assert all(bool(torch.isfinite(p).all()) and not torch.equal(p, q) for p, q in zip(params, before))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lstm", "cnn"])
def test_an_lstm_and_a_small_cnn_train_in_auto_mode(digits, kind) -> None:
    """Three epochs lower the training loss (a minute for the LSTM; the clipped sums it steps on are checked
    against a per-record loop above)."""
    dataset, *_ = digits
    x, y = dataset.tensors
    model, trainer = _auto_mode_trainer(dataset, kind, batch_size=256, epochs=3)
    criterion = nn.CrossEntropyLoss()
    with torch.no_grad():
        start = float(criterion(model(x), y))
    trainer.run()
    with torch.no_grad():
        end = float(criterion(model(x), y))
    assert trainer.algorithm.gradients.mode in ("ghost", "mixed")
    assert end < start


class _Stream(IterableDataset):
    def __iter__(self):
        yield torch.zeros(64), torch.tensor(0)


def test_bad_front_door_input_is_named(digits) -> None:
    dataset, *_ = digits
    model = _mlp()
    common = dict(algorithm="dp-sgd", epsilon=1.0, batch_size=64, steps=2, clip=1.0, lr=0.1)
    with pytest.raises(ValueError, match="algorithm"):
        dpvr.make_private(model, nn.CrossEntropyLoss(), dataset, **{**common, "algorithm": "sgd"})
    with pytest.raises(ValueError, match="noise"):
        dpvr.make_private(model, nn.CrossEntropyLoss(), dataset, noise=1.0, **common)
    with pytest.raises(ValueError, match="exactly one of epochs= or steps="):
        dpvr.make_private(model, nn.CrossEntropyLoss(), dataset, epochs=1, **common)
    with pytest.raises(TypeError, match="map-style"):
        dpvr.make_private(model, nn.CrossEntropyLoss(), _Stream(), **common)
    with pytest.raises(TypeError, match="MinimaxProblem"):
        dpvr.make_private(model, nn.CrossEntropyLoss(), dataset, **{**common, "algorithm": "dp-sgda"})
    with pytest.raises(ValueError, match="couples records"):
        dpvr.make_private(
            model, lambda o, t: nn.functional.cross_entropy(o - o.mean(0), t), dataset, **common
        )

    class Centred(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return self.net(inputs - inputs.mean(0))

    with pytest.raises(ValueError, match="other records of its batch"):
        dpvr.make_private(Centred(), nn.CrossEntropyLoss(), dataset, **common)
    with pytest.raises(ValueError, match="scalar"):
        dpvr.make_private(model, nn.CrossEntropyLoss(reduction="none"), dataset, **common)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Dataset (not a DataLoader) is used as given, silently
        dpvr.make_private(model, nn.CrossEntropyLoss(), dataset, **common)


def test_privacy_spent_names_each_streams_share_and_noise_multiplier(digits) -> None:
    dataset, *_ = digits
    model = _mlp()
    trainer = dpvr.make_private(
        model,
        nn.CrossEntropyLoss(),
        dataset,
        algorithm="diff2",
        epsilon=2.0,
        steps=4,
        restart=2,
        clip={"restart": 1.0, "difference": 2.0},
        lr=0.5,
    )
    trainer.run()
    report = trainer.privacy_spent()
    assert set(report.shares) == set(report.noise_multipliers) == {"restart", "difference"}
    assert sum(report.shares.values()) == pytest.approx(1.0)
    assert report.noise_multipliers == trainer.algorithm.noise


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("algorithm", ["dp-sgd", "diff2"])
def test_the_front_door_trains_on_cuda(digits, algorithm) -> None:
    """The same run on a CUDA model: data moved to the model's device, ghost clipping on the torch path."""
    dataset, x_test, y_test = digits
    model = _mlp().cuda()
    settings = CASES[algorithm][1]
    trainer = dpvr.make_private(
        model,
        nn.CrossEntropyLoss(),
        dataset,
        algorithm=algorithm,
        epsilon=EPSILON,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        **settings,
    )
    trainer.run()
    assert trainer.algorithm.gradients.mode in ("ghost", "mixed")
    assert trainer.privacy_spent().epsilon <= EPSILON * (1 + 1e-9)
    assert _accuracy(model.cpu(), x_test, y_test) >= CASES[algorithm][2]


def test_every_problem_with_the_settings_is_listed_at_once_and_a_loaders_batch_size_is_taken(digits) -> None:
    dataset, *_ = digits
    with pytest.raises(ValueError, match="3 problems") as raised:
        dpvr.make_private(_mlp(), nn.CrossEntropyLoss(), dataset, algorithm="dp-sgd", epsilon=1.0, epochs=0,
                          batch_size=5000, lr=0.1)
    message = str(raised.value)
    assert "epochs: the number of passes over the data must be > 0, got 0" in message
    assert "must lie in [1, 1400], got 5000" in message and "clip: 'dp-sgd' needs this setting" in message
    with pytest.raises(ValueError, match="steps: the number of steps must be a whole number >= 1, got 0"):
        dpvr.make_private(_mlp(), nn.CrossEntropyLoss(), dataset, algorithm="dp-sgd", epsilon=1.0, steps=0,
                          batch_size=64, lr=0.1, clip=1.0)
    with pytest.warns(UserWarning, match="sampler"):
        trainer = dpvr.make_private(_mlp(), nn.CrossEntropyLoss(), DataLoader(dataset, batch_size=50),
                                    algorithm="dp-sgd", epsilon=1.0, steps=2, lr=0.1, clip=1.0)
    assert trainer.algorithm.plan.batch_size == 50


def test_each_step_reports_the_batchs_loss_except_under_the_last_iterate_bound(digits) -> None:
    dataset, *_ = digits
    model = _mlp()
    trainer = dpvr.make_private(model, nn.CrossEntropyLoss(), dataset, algorithm="dp-sgd", epsilon=1.0,
                                batch_size=64, steps=2, lr=0.1, clip=1.0, runtime=dpvr.RuntimeConfig(
                                    sampler_seed=3, generator=dpvr.NoiseGenerator(3, reproducible=True)))
    before = copy.deepcopy(model)
    info = trainer.step()
    again = dpvr.optim.sampling.BatchSampler("poisson", len(dataset), 64, seed=3).draw()  # the same draw
    x, y = dataset.tensors
    with torch.no_grad():
        expected = nn.functional.cross_entropy(before(x[again]), y[again])
    assert float(info["loss"]) == pytest.approx(float(expected), rel=1e-5)
    cyclic = dpvr.make_private(_mlp(), nn.CrossEntropyLoss(), dataset, algorithm="last-iterate", epsilon=1.0,
                               batch_size=100, steps=2, lr=0.01, clip=1.0, weak_convexity=1.0,
                               smoothness=1.0)
    assert "loss" not in cyclic.step()
