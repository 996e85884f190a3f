"""PrivateDiff Minimax (Zhang et al.), section 9.3: private policy evaluation (TD learning with the MSPBE).

The paper's protocol (eq. 67-68, Table 5, Figure 7), with gymnasium's environments (``pip install
dpvr[rl]``):

- **Data.** Transitions ``(s, r, s', done)`` collected with a fixed, data-independent policy (uniformly
  random actions) from ``cartpole`` (CartPole-v1) and ``acrobot`` (Acrobot-v1); ``pong`` (ALE/Pong-v5 with
  its 128-byte RAM as the state, bytes / 255) when the Atari environments (``ale-py``) are installed.
  Each transition is a private record; a second, independent collection (another environment seed) is the
  evaluation set. Apart from Pong's bytes / 255 (their declared maximum), states and rewards enter as the
  environments give them: no statistic of the data is fitted. Episodes are cut at the environments' own
  limits; ``done`` marks a true termination (no bootstrap), a time-limit truncation bootstraps.
- **Objective** (:class:`~dpvr.objectives.MSPBE`): the primal-dual MSPBE, min over the value network's
  parameters ``theta``, max over the dual ``omega`` (one entry per parameter, in a ball of radius
  ``RADIUS``), ``gamma = GAMMA``. The value network has one hidden layer of 50 tanh units.
- **Methods.** ``DP-SGDA`` (``C1 = C2 = 3``), ``PrivateDiff`` (``C = 3``, ``T = 2``, ``T2 = 3`` as in
  Table 5; ``C3 = 0.3``, not given) and ``DP-TD`` (Zhao et al.: DP-SGD on the semi-gradient TD(0)
  direction ``-delta grad V(s)``, clip 3), all with batches of ``batch`` drawn without replacement, the same
  number of value-network updates and learning rates ``LR`` (not given in the paper). Noise is calibrated
  to ``(epsilon, delta)``, ``delta = 1/n^1.1``, replace-one neighbours over transitions (a trajectory-level
  guarantee needs group privacy over the episode length).
- **Metric.** The MSPBE ``1/2 e^T G^{-1} e`` of the value network on the evaluation transitions, over
  iterations (the paper plots "the loss"; zero is optimal). No metric reads the private transitions, so the
  records hold no diagnostics.

Scale: the paper gives 100 epochs and no data size; here 2,000 transitions, 100 epochs of batch 100, 3 seeds,
epsilon {1, 4}; ``--quick``: 1,000 transitions, 10 epochs, 1 seed, epsilon 4, CartPole and Acrobot.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from typing import Any

import numpy as np
import torch
from torch import nn

from dpvr.algorithms import DPSGD, DPSGDA, PrivateDiff
from dpvr.objectives import MSPBE, TransitionValues, ValueModel, semi_gradient_td_loss
from dpvr.ops import NoiseGenerator, torch_threads
from dpvr.optim import PrivacyConfig, RuntimeConfig
from dpvr.results import Record, document, format_table

from .common import derive_seed, format_mean_std, plot_curves, progress, record_metrics, save

NAME = "td"
METHODS = ("DP-SGDA", "PrivateDiff", "DP-TD")
ENVIRONMENTS = {"cartpole": "CartPole-v1", "acrobot": "Acrobot-v1", "pong": "ALE/Pong-v5"}
EPSILONS = (1.0, 4.0)
GAMMA, RADIUS, HIDDEN = 0.9, 10.0, 50
CLIPS = {  # each method's clip={stream: radius} (PrivateDiff's difference: per move, offset); DP-TD's clip
    "DP-SGDA": {"x": 3.0, "y": 3.0},
    "PrivateDiff": {"y": 3.0, "checkpoint": 3.0, "difference": (3.0, 0.3)},
    "DP-TD": 3.0,
}
RESTART, Y_STEPS = 2, 3
LR = {"lr": 0.05, "lr_y": 0.05}
PREPROCESSING = (
    "states as the environment gives them (pong: RAM bytes divided by 255, their declared maximum), "
    "rewards unscaled; no statistic of the data is fitted"
)


@dataclasses.dataclass(frozen=True)
class Protocol:
    transitions: int
    epochs: int
    batch_size: int
    seeds: int


SCALED = Protocol(transitions=2000, epochs=100, batch_size=100, seeds=3)
QUICK = Protocol(transitions=1000, epochs=10, batch_size=100, seeds=1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, help="epochs (default: the protocol's)")
    parser.add_argument("--transitions", type=int, help="private transitions (default: the protocol's)")


def _gymnasium() -> Any:
    try:
        import gymnasium
    except ImportError as error:
        raise RuntimeError("dpvr experiment td needs gymnasium: pip install 'dpvr[rl]'") from error
    return gymnasium


def available() -> list[str]:
    """The environments this installation can run (``pong`` needs the Atari environments, ``ale-py``)."""
    _gymnasium()
    return [k for k in ENVIRONMENTS if k != "pong" or importlib.util.find_spec("ale_py") is not None]


def collect(name: str, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` transitions of the uniformly random policy: inputs ``[s | s']`` and targets ``(r, done)``."""
    gym = _gymnasium()
    if name == "pong":
        import ale_py

        gym.register_envs(ale_py)
        env = gym.make(ENVIRONMENTS[name], obs_type="ram")
    else:
        env = gym.make(ENVIRONMENTS[name])
    scale = 255.0 if name == "pong" else 1.0
    env.action_space.seed(seed)
    inputs, targets = [], []
    state, _ = env.reset(seed=seed)
    while len(inputs) < count:
        following, reward, terminated, truncated, _ = env.step(env.action_space.sample())
        inputs.append(np.concatenate([state, following]) / scale)
        targets.append((reward, float(terminated)))
        state = env.reset()[0] if terminated or truncated else following
    env.close()
    return torch.as_tensor(np.asarray(inputs), dtype=torch.float32), torch.as_tensor(
        targets, dtype=torch.float32
    )


@dataclasses.dataclass
class _Run:
    epochs: list[int] = dataclasses.field(default_factory=list)
    mspbe: list[float] = dataclasses.field(default_factory=list)
    spent_epsilon: float | None = None


def _train(
    method: str,
    train: tuple[torch.Tensor, torch.Tensor],
    evaluation: tuple[torch.Tensor, torch.Tensor],
    protocol: Protocol,
    epsilon: float,
    seed: int,
    noise_seed: int,
) -> _Run:
    state_dim = train[0].shape[1] // 2
    torch.manual_seed(derive_seed(seed, 5) % 2**63)  # public initialisation
    net = nn.Sequential(nn.Linear(state_dim, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))
    model = ValueModel(net, state_dim)
    problem = MSPBE(model.num_params, gamma=GAMMA, radius=RADIUS)
    per_epoch = max(1, len(train[0]) // protocol.batch_size)
    steps = protocol.epochs * per_epoch
    common: dict[str, Any] = dict(
        batch_size=protocol.batch_size,
        steps=steps,
        clip=CLIPS[method],
        privacy=PrivacyConfig(epsilon=epsilon, delta=1.0 / len(train[0]) ** 1.1),
        runtime=RuntimeConfig(
            generator=NoiseGenerator(derive_seed(noise_seed, 6), reproducible=True),
            sampler_seed=derive_seed(noise_seed, 7),
            grad_mode="materialised",  # the MSPBE's x-gradient has second derivatives of the network
        ),
    )
    if method == "DP-SGDA":
        alg: DPSGDA | PrivateDiff | DPSGD = DPSGDA(model, problem, *train, **LR, **common)
    elif method == "PrivateDiff":
        alg = PrivateDiff(model, problem, *train, restart=RESTART, y_steps=Y_STEPS, **LR, **common)
    else:
        pair = TransitionValues(net, state_dim)
        alg = DPSGD(pair, semi_gradient_td_loss(GAMMA), *train, lr=LR["lr"], sampling="wor", **common)
    run = _Run()

    def evaluate(epoch: int) -> None:
        run.epochs.append(epoch)
        run.mspbe.append(problem.mspbe(model(evaluation[0]).detach(), evaluation[1]))

    evaluate(0)
    for t in range(1, steps + 1):
        alg.step()
        if t % per_epoch == 0:
            evaluate(t // per_epoch)
    run.spent_epsilon = alg.privacy_spent().epsilon
    return run


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the experiment (see the module documentation); returns the result document."""
    base = QUICK if args.quick else SCALED
    protocol = dataclasses.replace(
        base,
        epochs=args.epochs or base.epochs,
        transitions=args.transitions or base.transitions,
        seeds=args.seeds or base.seeds,
    )
    epsilons = tuple(args.epsilon or ((4.0,) if args.quick else EPSILONS))
    known = available()
    names = list(args.dataset or (["cartpole", "acrobot"] if args.quick else known))
    for name in names:
        if name not in known:
            hint = " (needs the Atari environments: pip install ale-py)" if name == "pong" else ""
            raise ValueError(f"--dataset {name}: not available{hint}; available: {', '.join(known)}")
    found: dict[tuple[str, float, str], list[_Run]] = {}
    records: list[Record] = []
    with torch_threads(1), progress(len(names) * protocol.seeds * len(epsilons) * len(METHODS), NAME) as bar:
        for name in names:
            for seed in range(protocol.seeds):
                train = collect(name, protocol.transitions, derive_seed(seed, 1) % 2**31)
                evaluation = collect(name, protocol.transitions, derive_seed(seed, 2) % 2**31)
                delta = 1.0 / len(train[0]) ** 1.1
                for epsilon in epsilons:
                    for method in METHODS:
                        bar.set_postfix_str(f"{name} seed {seed} eps {epsilon} {method}")
                        noise_seed = derive_seed(seed, METHODS.index(method), round(epsilon * 1e6))
                        result = _train(method, train, evaluation, protocol, epsilon, seed, noise_seed)
                        found.setdefault((name, epsilon, method), []).append(result)
                        metrics = record_metrics(
                            {"mspbe": result.mspbe[-1]}, diagnostics=(), curves={"mspbe": result.mspbe}
                        )
                        records.append(
                            Record(method, name, epsilon, delta, seed, result.spent_epsilon, metrics)
                        )
                        bar.update()
    config = {
        "environments": {n: ENVIRONMENTS[n] for n in names},
        "policy": "uniformly random actions",
        "preprocessing": PREPROCESSING,
        "epsilons": list(epsilons),
        "delta": "1/n^1.1 (n: private transitions)",
        "gamma": GAMMA,
        "radius": RADIUS,
        "value_network": f"MLP state-{HIDDEN}-1 tanh",
        "clips": CLIPS,
        "restart": RESTART,
        "y_steps": Y_STEPS,
        "learning_rates": LR,
        "quick": bool(args.quick),
        "protocol": dataclasses.asdict(protocol),
    }
    doc = document(NAME, config, records)
    rows = [
        [
            name,
            eps,
            method,
            max(r.spent_epsilon or 0.0 for r in runs),
            format_mean_std(r.mspbe[0] for r in runs),
            format_mean_std(r.mspbe[-1] for r in runs),
        ]
        for (name, eps, method), runs in found.items()
    ]
    print(
        format_table(["environment", "epsilon", "method", "spent epsilon", "MSPBE at start", "MSPBE"], rows)
    )
    print(f"\nmean ± std over {protocol.seeds} seeds at the last iterate, on held-out transitions.")
    paths = save(doc, records, args.out)
    for name in names:
        panels = {
            f"{name}, epsilon = {eps:g}": {m: [r.mspbe for r in found[(name, eps, m)]] for m in METHODS}
            for eps in epsilons
        }
        path = os.path.join(args.out, f"{NAME}_{name}.png")
        plot_curves(path, list(range(protocol.epochs + 1)), panels, title=f"MSPBE, {name}", xlabel="epoch")
        paths.append(path)
    print("\nwrote " + ", ".join(paths))
    return doc
