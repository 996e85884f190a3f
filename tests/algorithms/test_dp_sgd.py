"""DP-SGD / DP-GD and cyclic last-iterate DP-SGD with a proximal term."""

import math

import dp_accounting as dpa
import pytest
import torch

import dpvr
from dpvr.algorithms import DPGD, DPSGD, CyclicDPSGDPlan
from dpvr.optim import L1, BudgetExhaustedError, ElasticNet, L2Ball, PrivacyConfig, RuntimeConfig
from dpvr.privacy import Accountant

TINY = 1e-100


def data(n=40, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    x = x / x.norm(dim=1, keepdim=True)  # unit-norm features: logistic gradients have norm <= sqrt(2)
    y = (torch.rand(n, generator=g) < 0.5).double()
    return x, y


def logistic(output, target):
    return torch.nn.functional.binary_cross_entropy_with_logits(output.squeeze(), target)


def linear(d=6):
    torch.manual_seed(3)
    return torch.nn.Linear(d, 1).double()


def gen(seed=0):
    return dpvr.NoiseGenerator(seed=seed, reproducible=True)


def test_noise_free_dp_gd_is_gradient_descent():
    x, y = data()
    model = linear()
    DPGD(
        model, logistic, x, y, lr=0.5, clip=1e6, steps=15, noise=TINY, runtime=RuntimeConfig(generator=gen())
    ).run(progress=False)
    ref = linear()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for _ in range(15):
        opt.zero_grad()
        logistic(ref(x), y).backward()
        opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("sampling", ["poisson", "wor"])
def test_sampled_dp_sgd_accounts_each_step(sampling):
    x, y = data()
    alg = DPSGD(
        linear(),
        logistic,
        x,
        y,
        lr=0.1,
        clip=1.0,
        steps=30,
        batch_size=8,
        sampling=sampling,
        noise=1.2,
        # Poisson under add/remove needs the dataset size stated public; WOR is replace-one only.
        privacy=PrivacyConfig(public_dataset_size=len(x) if sampling == "poisson" else None),
        runtime=RuntimeConfig(generator=gen(), sampler_seed=0),
    )
    alg.run(progress=False)
    relation = "add-remove" if sampling == "poisson" else "replace-one"
    assert alg.accountant.accountant == "pld"  # the default: the tightest accountant of the sampler
    direct = Accountant("pld", relation)
    direct.record(*alg.plan.step("gradient", {"gradient": 1.2}), count=30)
    assert alg.privacy_spent().epsilon == pytest.approx(direct.epsilon(1e-5), rel=1e-12)


def test_cyclic_traversal_prox_and_last_iterate_accounting():
    x, y = data(n=40)
    kwargs = dict(
        lr=1.0,
        clip=math.sqrt(2),
        steps=20,
        batch_size=10,
        sampling="cyclic",
        weak_convexity=0.0,
        smoothness=0.5,
        prox=L1(0.01),
        noise=5.0,
    )
    alg = DPSGD(linear(), logistic, x, y, **kwargs, runtime=RuntimeConfig(generator=gen()))
    infos = alg.run(progress=False)
    assert all("move" not in info for info in infos)  # nothing about intermediate iterates
    assert alg.sampler.draw().tolist() == list(range(0, 10))  # 20 steps = 5 passes over 4 batches
    plan = CyclicDPSGDPlan(
        dataset_size=40,
        batch_size=10,
        steps=20,
        lr=1.0,
        clip=math.sqrt(2),
        smoothness=0.5,
        bound="last-iterate",
    )
    assert alg.accountant.accountant == "rdp"  # the default where PLD cannot price the (RDP-curve) bound
    direct = Accountant("rdp", "replace-one")
    direct.record(*plan.step("gradient", {"gradient": 5.0}))
    assert alg.privacy_spent().epsilon == pytest.approx(direct.epsilon(1e-5), rel=1e-12)


def test_cyclic_refuses_step_sizes_outside_the_theorem():
    x, y = data()
    with pytest.raises(ValueError, match="Theorem 2.3"):
        DPSGD(
            linear(),
            logistic,
            x,
            y,
            lr=2.0,
            clip=1.0,
            steps=4,
            batch_size=10,
            sampling="cyclic",
            weak_convexity=0.0,
            smoothness=0.5,
            noise=1.0,
        )
    with pytest.raises(ValueError, match="weak_convexity"):
        DPSGD(
            linear(),
            logistic,
            x,
            y,
            lr=0.1,
            clip=1.0,
            steps=4,
            batch_size=10,
            sampling="cyclic",
            noise=1.0,
        )


def test_unclipped_assertion_is_checked():
    x, y = data()
    alg = DPSGD(
        linear(),
        logistic,
        x * 10,
        y,
        lr=1.0,
        clip=1.0,
        steps=4,
        batch_size=10,
        sampling="cyclic",
        weak_convexity=0.0,
        smoothness=0.5,
        clipping=False,
        noise=1.0,
        runtime=RuntimeConfig(generator=gen()),
    )
    with pytest.raises(RuntimeError, match="clipping=False"):
        alg.step()


def test_cyclic_budget_guard():
    x, y = data()
    alg = DPSGD(
        linear(),
        logistic,
        x,
        y,
        lr=1.0,
        clip=1.0,
        steps=400,
        batch_size=10,
        sampling="cyclic",
        weak_convexity=0.0,
        smoothness=0.5,
        noise=10.0,
        privacy=PrivacyConfig(epsilon=2.0),
        runtime=RuntimeConfig(generator=gen()),
    )
    with pytest.raises(BudgetExhaustedError):
        alg.run(progress=False)
    assert 0 < alg.steps_done < 400 and alg.privacy_spent().epsilon <= 2.0


def test_proximal_operators():
    v = torch.tensor([-3.0, -0.5, 0.0, 0.2, 2.0], dtype=torch.float64)
    w = v.clone()
    L1(1.0)(w, 0.5)
    torch.testing.assert_close(w, torch.tensor([-2.5, 0.0, 0.0, 0.0, 1.5], dtype=torch.float64))
    w = v.clone()
    ElasticNet(1.0, 2.0)(w, 0.5)
    torch.testing.assert_close(w, torch.tensor([-1.25, 0.0, 0.0, 0.0, 0.75], dtype=torch.float64))
    ball = L2Ball(1.0)
    a, b = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    ball.project([a, b])
    assert math.isclose(math.hypot(*a.tolist(), *b.tolist()), 1.0, rel_tol=1e-6) and ball.diameter == 2.0


def test_checkpoint_round_trip_and_corruption():
    x, y = data()
    options = dict(lr=0.1, clip=1.0, steps=10, batch_size=8, sampling="poisson", noise=1.0)

    def runtime(seed):
        return RuntimeConfig(generator=gen(seed), sampler_seed=5)

    full = DPSGD(linear(), logistic, x, y, **options, runtime=runtime(1))
    full.run(progress=False)
    half = DPSGD(linear(), logistic, x, y, **options, runtime=runtime(1))
    half.run(5, progress=False)
    state = half.state_dict()
    resumed = DPSGD(linear(), logistic, x, y, **options, runtime=runtime(2))
    resumed.load_state_dict(state)
    resumed.run(progress=False)
    for a, b in zip(full.params, resumed.params):
        assert torch.equal(a, b)
    for corrupt in (
        {**state, "algorithm": "DIFF2"},
        {**state, "binding": {**state["binding"], "noise.gradient": 2.0}},
        {k: v for k, v in state.items() if k != "accountant"},
    ):
        with pytest.raises(ValueError, match="state"):
            resumed.load_state_dict(corrupt)


def test_cyclic_composition_accounting_counts_the_passes_started():
    x, y = data(n=40)
    alg = DPSGD(
        linear(),
        logistic,
        x,
        y,
        lr=1.0,
        clip=1.0,
        steps=18,
        batch_size=10,
        sampling="cyclic",
        weak_convexity=0.0,
        smoothness=0.5,
        noise=4.0,
        bound="composition",
        runtime=RuntimeConfig(generator=gen()),
    )
    assert alg.accountant.accountant == "pld"  # composition of passes: full-batch Gaussians, which PLD prices
    for step in range(1, 19):
        alg.step()
        direct = Accountant("pld", "replace-one")
        passes = -(-step // 4)
        one_pass = alg.plan.step("gradient", {"gradient": 4.0})[1]
        direct.record("gradient", dpa.SelfComposedDpEvent(one_pass, passes))  # as the run records it
        assert alg.privacy_spent().epsilon == pytest.approx(direct.epsilon(1e-5), rel=1e-12)


def test_cyclic_sampling_constructs_the_last_iterate_subclass():
    """The last-iterate variant is a subclass chosen at construction (not a flag): DPSGD(sampling="cyclic")
    is a LastIterateDPSGD, the other schemes and DPGD are not, and neither class runs the other's scheme."""
    from dpvr.algorithms import LastIterateDPSGD

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 3, generator=g), torch.randn(20, generator=g)
    common = dict(lr=0.05, clip=1.0, steps=4, batch_size=5, noise=1.0)

    def loss(o, t):
        return 0.5 * (o.squeeze(-1) - t) ** 2

    cyclic = DPSGD(torch.nn.Linear(3, 1), loss, x, y, sampling="cyclic", weak_convexity=1.0, smoothness=1.0,
                   **common)
    assert type(cyclic) is LastIterateDPSGD and cyclic.name == "DP-SGD"
    # the variant is the class, not a flag read throughout
    assert not hasattr(cyclic, "last_iterate_only")
    direct = LastIterateDPSGD(torch.nn.Linear(3, 1), loss, x, y, weak_convexity=1.0, smoothness=1.0, **common)
    assert direct.binding(data=False) == cyclic.binding(data=False)  # the same run, the same binding
    sampled = DPSGD(torch.nn.Linear(3, 1), loss, x, y, sampling="wor", **common)
    assert type(sampled) is DPSGD
    with pytest.raises(ValueError, match="sampling: LastIterateDPSGD runs sampling='cyclic' only, got 'wor'"):
        LastIterateDPSGD(torch.nn.Linear(3, 1), loss, x, y, sampling="wor", **common)

    class Mine(DPSGD):  # a user's subclass keeps its own methods ahead of the variant's
        def _extra_state(self):
            return {**super()._extra_state(), "mine": True}

    own = Mine(torch.nn.Linear(3, 1), loss, x, y, sampling="cyclic", weak_convexity=1.0, smoothness=1.0,
               **common)
    assert isinstance(own, Mine) and isinstance(own, LastIterateDPSGD) and type(own).__name__ == "Mine"
    again = Mine(torch.nn.Linear(3, 1), loss, x, y, sampling="cyclic", weak_convexity=1.0, smoothness=1.0,
                 **common)
    assert own._extra_state()["mine"] and type(own) is type(again)  # made once per class
    assert type(Mine(torch.nn.Linear(3, 1), loss, x, y, sampling="wor", **common)) is Mine
