"""DIFF2 and DP-GD: reductions to known algorithms, sensitivity, accounting, checkpoints, budget."""

import pytest
import torch

import dpvr
from dpvr import PaperSigmas
from dpvr.algorithms import DIFF2, DIFF2BVRLSGD, DPGD
from dpvr.optim import BudgetExhaustedError, PrivacyConfig, RuntimeConfig
from dpvr.optim.estimator import global_norm

TINY = 1e-100  # noise this small is absorbed by float64 rounding: the run is noise-free


def model_fn():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.Softplus(), torch.nn.Linear(10, 1)).double()


def loss(output, target):
    return 0.5 * (output.squeeze() - target) ** 2


@pytest.fixture
def clients():
    g = torch.Generator().manual_seed(0)
    x, y = (
        torch.randn(60, 5, generator=g, dtype=torch.float64),
        torch.randn(60, generator=g, dtype=torch.float64),
    )
    return [(x[i * 20 : (i + 1) * 20], y[i * 20 : (i + 1) * 20]) for i in range(3)]


def gen(seed=0):
    return dpvr.NoiseGenerator(seed=seed, reproducible=True)


def test_noise_free_diff2_gd_is_gradient_descent(clients):
    model = model_fn()
    alg = DIFF2(
        model,
        loss,
        clients,
        lr=0.1,
        steps=12,
        restart=5,
        clip={"restart": 1e6, "difference": 1e6},
        noise=PaperSigmas(restart=TINY, difference=TINY),
        runtime=RuntimeConfig(generator=gen()),
    )
    alg.run(progress=False)
    ref = model_fn()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(12):
        opt.zero_grad()
        total = sum(loss(ref(x), y).mean() for x, y in clients) / len(clients)
        total.backward()
        opt.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)


def test_restart_every_round_is_dp_gd(clients):
    """T = 1: every round is a restart, i.e. DP-GD on the pooled data (equal shards): the same iterates
    without noise (the two runs never share noise: their keys bind different settings) and the same epsilon
    for the same noise."""
    n_total = sum(len(x) for x, _ in clients)
    x = torch.cat([c[0] for c in clients])
    y = torch.cat([c[1] for c in clients])
    for sigma in (TINY, 0.3):
        diff2 = DIFF2(
            model_fn(), loss, clients, lr=0.2, steps=6, restart=1, clip={"restart": 0.5, "difference": 1.0},
            noise=PaperSigmas(restart=sigma), runtime=RuntimeConfig(generator=gen(4)),
        )  # fmt: skip
        diff2.run(progress=False)
        dpgd = DPGD(model_fn(), loss, x, y, lr=0.2, clip=0.5, steps=6, noise=sigma * n_total,
                    runtime=RuntimeConfig(generator=gen(4)))
        dpgd.run(progress=False)
        if sigma == TINY:
            for a, b in zip(diff2.params, dpgd.params):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert diff2.privacy_spent().epsilon == pytest.approx(dpgd.privacy_spent().epsilon, rel=1e-9)


def neighbour(clients):
    """Replace one record of client 0 by an outlier."""
    x, y = clients[0][0].clone(), clients[0][1].clone()
    x[3], y[3] = 50.0, -80.0
    return [(x, y), *clients[1:]]


@pytest.mark.parametrize("routine", ["gd", "bvr-l-sgd"])
def test_server_estimate_sensitivity(clients, routine):
    """With noise off, one record moves the aggregated estimate by at most 2 C / (n P) in every round."""
    options = dict(
        lr=0.3, steps=4, restart=3, clip={"restart": 0.7, "difference": 2.0},
        noise=PaperSigmas(restart=TINY, difference=TINY), runtime=RuntimeConfig(generator=gen()),
    )
    if routine == "bvr-l-sgd":
        options.update(routine=routine, local_steps=3, local_batch=5,
                       clip={"restart": 0.7, "difference": 2.0, "local": 1.0},
                       noise=PaperSigmas(restart=TINY, difference=TINY, local=TINY),
                       runtime=RuntimeConfig(generator=gen(), sampler_seed=1))
    a, b = DIFF2(model_fn(), loss, clients, **options), DIFF2(model_fn(), loss, neighbour(clients), **options)
    n, p = 20, 3
    for _ in range(4):
        b._restore(a.state_dict())  # condition on the same released history
        info_a, info_b = a.step(), b.step()
        assert info_a["radius"] == info_b["radius"]
        bound = 2 * info_a["radius"] / (n * p)
        delta = global_norm([va - vb for va, vb in zip(a.v.value, b.v.value)])
        assert 0 < delta <= bound * (1 + 1e-9), (a.steps_done, delta, bound)


def test_checkpoint_resume_gives_the_same_iterates(clients):
    options = dict(
        lr=0.2,
        steps=8,
        restart=3,
        clip={"restart": 0.5, "difference": 1.0, "local": 1.0},
        noise=PaperSigmas(restart=0.01, difference=0.02, local=0.05),
        routine="bvr-l-sgd",
        local_steps=3,
        local_batch=4,
    )

    def runtime(seed):
        return RuntimeConfig(generator=gen(seed), sampler_seed=3)

    full = DIFF2(model_fn(), loss, clients, **options, runtime=runtime(7))
    full.run(progress=False)
    first = DIFF2(model_fn(), loss, clients, **options, runtime=runtime(7))
    first.run(4, progress=False)
    state = first.state_dict()
    resumed = DIFF2(model_fn(), loss, clients, **options, runtime=runtime(99))
    resumed.load_state_dict(state)
    resumed.run(progress=False)
    for a, b in zip(full.params, resumed.params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert resumed.privacy_spent().epsilon == pytest.approx(full.privacy_spent().epsilon, rel=1e-12)
    bad = dict(state, params=[p[:1] for p in state["params"]])
    with pytest.raises(ValueError, match="state"):
        resumed.load_state_dict(bad)


def test_budget_guard_refuses_the_step_that_would_exceed(clients):
    alg = DIFF2(
        model_fn(),
        loss,
        clients,
        lr=0.1,
        steps=40,
        restart=5,
        clip={"restart": 1.0, "difference": 1.0},
        noise=PaperSigmas(restart=0.3, difference=0.3),
        privacy=PrivacyConfig(epsilon=1.0, delta=1e-5),
    )
    with pytest.raises(BudgetExhaustedError, match="spent so far"):
        alg.run(progress=False)
    assert 0 < alg.steps_done < 40
    assert alg.privacy_spent().epsilon <= 1.0
    before = [p.clone() for p in alg.params]
    with pytest.raises(BudgetExhaustedError):
        alg.step()
    assert all(torch.equal(a, b) for a, b in zip(before, alg.params))  # nothing was released


def test_calibrated_run_spends_its_target(clients):
    for calibration in ("tight", "paper"):
        alg = DIFF2(
            model_fn(),
            loss,
            clients,
            lr=0.1,
            steps=20,
            restart=5,
            clip={"restart": 1.0, "difference": 1.0},
            privacy=PrivacyConfig(epsilon=3.0, delta=1e-5, calibration=calibration),
        )
        alg.run(progress=False)
        spent = alg.privacy_spent().epsilon
        assert spent <= 3.0 * (1 + 1e-6)
        if calibration == "tight":
            assert spent == pytest.approx(3.0, rel=1e-3)


def test_calibrated_bvr_l_sgd_charges_only_the_busiest_clients_local_steps(clients):
    """Each record sees its own client's local steps only: (K - 1) ceil(R/P) of them, not (K - 1) R."""
    alg = DIFF2(
        model_fn(),
        loss,
        clients,
        lr=0.05,
        steps=8,
        restart=4,
        routine="bvr-l-sgd",
        local_steps=3,
        local_batch=5,
        clip={"restart": 1.0, "difference": 1.0, "local": 1.0},
        privacy=PrivacyConfig(epsilon=3.0, delta=1e-5),
        runtime=RuntimeConfig(generator=gen(), sampler_seed=0),
    )
    alg.run(progress=False)  # charging every client's local steps exhausted the budget after a few rounds
    assert alg.steps_done == 8
    assert alg.privacy_spent().epsilon == pytest.approx(3.0, rel=1e-3)


def test_bad_arguments(clients):
    with pytest.raises(ValueError, match=r"clip\['restart'\]"):
        DIFF2(
            model_fn(), loss, clients, lr=0.1, steps=5, restart=2, clip={"restart": 0.0, "difference": 1.0},
            noise=PaperSigmas(restart=1, difference=1),
        )
    with pytest.raises(ValueError, match="routine"):
        DIFF2(
            model_fn(),
            loss,
            clients,
            lr=0.1,
            steps=5,
            restart=2,
            clip={"restart": 1, "difference": 1},
            noise=PaperSigmas(restart=1, difference=1),
            routine="adam",
        )
    with pytest.raises(ValueError, match="missing"):
        DIFF2(model_fn(), loss, clients, lr=0.1, steps=5, restart=2, clip={"restart": 1, "difference": 1},
              noise=PaperSigmas(restart=1.0))
    with pytest.raises(ValueError, match="not streams of"):
        DIFF2(model_fn(), loss, clients, lr=0.1, steps=5, restart=2, clip={"restart": 1, "difference": 1},
              noise={"restart": 1.0, "difference": 1.0, "gradient": 1.0})
    with pytest.raises(ValueError, match="clients"):
        DIFF2(model_fn(), loss, [], lr=0.1, steps=5, restart=2, clip={"restart": 1, "difference": 1},
              noise=PaperSigmas(restart=1, difference=1))


@pytest.mark.parametrize("routine", ["gd", "bvr-l-sgd"])
def test_ghost_and_materialised_runs_agree(clients, routine):
    options = dict(
        lr=0.2, steps=6, restart=3, clip={"restart": 0.3, "difference": 0.5},
        noise=PaperSigmas(restart=TINY, difference=TINY),
    )  # noise off: the two paths round differently, so their releases never share noise draws
    if routine == "bvr-l-sgd":
        options.update(routine=routine, local_steps=3, local_batch=5,
                       clip={"restart": 0.3, "difference": 0.5, "local": 1.0},
                       noise=PaperSigmas(restart=TINY, difference=TINY, local=TINY))
    runs = {}
    for mode in ("auto", "materialised"):
        runtime = RuntimeConfig(grad_mode=mode, generator=gen(11), sampler_seed=2)
        alg = DIFF2(model_fn(), loss, clients, **options, runtime=runtime)
        alg.run(progress=False)
        runs[alg.gradients.mode] = alg.params
    assert set(runs) == {"ghost", "materialised"}
    for a, b in zip(runs["ghost"], runs["materialised"]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_diverging_iterates_raise_a_clear_error(clients):
    alg = DIFF2(
        model_fn(),
        loss,
        clients,
        lr=0.1,
        steps=4,
        restart=3,
        clip={"restart": 1.0, "difference": 1.0},
        noise=PaperSigmas(restart=0.1, difference=0.1),
        runtime=RuntimeConfig(generator=gen()),
    )
    alg.step()
    alg.x.move = float("inf")
    with pytest.raises(RuntimeError, match="diverged"):
        alg.step()


def count_forwards(alg) -> list[int]:
    count = [0]
    alg.model.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    return count


def test_full_batch_rounds_reuse_the_previous_recording(clients):
    """DIFF2-GD records each client's previous iterate once: every round costs one forward pass per client
    with reuse (two per difference round without), the iterates agree, and a restored run recomputes
    once and then reuses again."""
    options = dict(
        lr=0.2, steps=7, restart=4, clip={"restart": 0.3, "difference": 0.5},
        noise=PaperSigmas(restart=TINY, difference=TINY),
    )  # noise off: the paths may round differently, so their releases need not share noise draws
    runs, forwards = {}, {}
    for reuse in (True, False):
        alg = DIFF2(model_fn(), loss, clients, **options, runtime=RuntimeConfig(generator=gen(5)),
                    reuse_recording=reuse)
        count = count_forwards(alg)
        alg.run(progress=False)
        runs[reuse], forwards[reuse] = alg.params, count[0]
    restarts, differences = 2, 5  # rounds 1 and 5 restart
    assert forwards[True] == (restarts + differences) * len(clients)
    assert forwards[False] == (restarts + 2 * differences) * len(clients)
    for a, b in zip(runs[True], runs[False]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

    first = DIFF2(model_fn(), loss, clients, **options, runtime=RuntimeConfig(generator=gen(5)))
    first.run(3, progress=False)
    resumed = DIFF2(model_fn(), loss, clients, **options, runtime=RuntimeConfig(generator=gen(99)))
    resumed.load_state_dict(first.state_dict())
    count = count_forwards(resumed)
    resumed.step()  # a difference round: nothing was kept, both points are recorded
    assert count[0] == 2 * len(clients)
    resumed.step()
    assert count[0] == 3 * len(clients)
    resumed.run(progress=False)
    for a, b in zip(resumed.params, runs[True]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)



# ---- every random choice has a stream of its own ----------------------------------------------------------


def _plug_in_mi(a, b) -> float:
    """The plug-in mutual information (bits) of two discrete samples."""
    import numpy as np

    a, b = np.unique(a, return_inverse=True)[1], np.unique(b, return_inverse=True)[1]
    joint = np.zeros((a.max() + 1, b.max() + 1))
    np.add.at(joint, (a, b), 1)
    p = joint / joint.sum()
    outer = p.sum(1, keepdims=True) @ p.sum(0, keepdims=True)
    return float((p[p > 0] * np.log2(p[p > 0] / outer[p > 0])).sum())


def test_the_output_round_is_independent_of_client_0s_batches():
    """Over 1000 sampler seeds: the random output round (R = 8) of DIFF2-GD against the smallest index of the
    first batch (2 of 16) of client 0's local sampler in a BVR-L-SGD run with the same seed. Drawn from the
    sampler's own seed (as before), the round carries 1.03 bits about the batch; from a stream of its own,
    0.10, the plug-in bias of independent samples (0.07 for a round drawn from unrelated seeds; about 0.07
    expected for an 8 x 15 table of 1000 samples)."""
    import numpy as np

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 2, generator=g, dtype=torch.float64)
    y = torch.randn(16, generator=g, dtype=torch.float64)
    streams = {"restart": 1.0, "difference": 1.0}
    rounds, minima, shared, unrelated = [], [], [], []
    for seed in range(1000):
        runtime = RuntimeConfig(generator=gen(seed), sampler_seed=seed)
        common = dict(lr=0.1, steps=8, restart=2, runtime=runtime)
        gd = DIFF2(torch.nn.Linear(2, 1).double(), loss, [(x, y)], clip=streams, noise=streams,
                   output="random", **common)
        local = {**streams, "local": 1.0}
        bvr = DIFF2(torch.nn.Linear(2, 1).double(), loss, [(x, y)], clip=local, noise=local,
                    routine="bvr-l-sgd", local_steps=2, local_batch=2, **common)
        rounds.append(gd._output_round)
        minima.append(int(bvr.samplers[0].draw().min()))
        shared.append(int(np.random.default_rng(seed).integers(1, 9)))  # the old derivation
        unrelated.append(int(np.random.default_rng(10**6 + seed).integers(1, 9)))
    assert sorted(set(rounds)) == list(range(1, 9))
    baseline = _plug_in_mi(unrelated, minima)
    assert _plug_in_mi(shared, minima) > 0.7  # the dependence this test would catch
    assert _plug_in_mi(rounds, minima) < baseline + 0.08 and baseline < 0.12


def test_no_two_random_choices_share_a_generator():
    """With a fixed sampler seed, each sampler (client p's: seed + p) and the output round's stream start
    from different generator states, and a choice's stream depends on its label."""
    import numpy as np

    from dpvr.algorithms.diff2.algorithm import choice_generator

    def first_words(g):
        return tuple(g.bit_generator.random_raw(4).tolist())

    for seed in (0, 7, 2**40):
        starts = [first_words(np.random.default_rng(seed + k)) for k in range(8)]
        starts += [first_words(choice_generator(seed, label)) for label in ("diff2/output-round", "other")]
        assert len(set(starts)) == len(starts)
        again = first_words(choice_generator(seed, "diff2/output-round"))
        assert again == starts[8]  # reproducible from the seed
    fresh = {first_words(choice_generator(None, "diff2/output-round")) for _ in range(4)}
    assert len(fresh) == 4  # without a seed: fresh entropy each time
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 2, generator=g, dtype=torch.float64)
    y = torch.randn(8, generator=g, dtype=torch.float64)
    local = {"restart": 1.0, "difference": 1.0, "local": 1.0}
    alg = DIFF2(torch.nn.Linear(2, 1).double(), loss, [(x, y)] * 3, lr=0.1, steps=3, restart=2, clip=local,
                noise=local, routine="bvr-l-sgd", local_steps=2, local_batch=2,
                runtime=RuntimeConfig(generator=gen(), sampler_seed=5))
    states = [str(s._rng.bit_generator.state["state"]) for s in alg.samplers]
    assert len(set(states)) == len(alg.samplers) == 3


BVR = dict(
    lr=0.2, steps=6, restart=3, clip={"restart": 0.5, "difference": 1.0, "local": 1.0},
    noise=PaperSigmas(restart=0.01, difference=0.02, local=0.05), local_steps=3, local_batch=4,
)  # fmt: skip
GD = dict(lr=0.2, steps=6, restart=3, clip={"restart": 0.5, "difference": 1.0},
          noise=PaperSigmas(restart=0.01, difference=0.02))


def _run(cls, clients, **options):
    alg = cls(model_fn(), loss, clients, **options, runtime=RuntimeConfig(generator=gen(7), sampler_seed=3))
    alg.run(progress=False)
    return alg


def test_the_routine_is_a_subclass_chosen_at_construction(clients):
    gd = _run(DIFF2, clients, **GD)
    assert type(gd) is DIFF2 and gd.routine == "gd" and gd.samplers == []
    chosen = _run(DIFF2, clients, **BVR, routine="bvr-l-sgd")
    assert type(chosen) is DIFF2BVRLSGD and isinstance(chosen, DIFF2) and chosen.routine == "bvr-l-sgd"
    assert len(chosen.samplers) == 3
    # The subclass constructed directly is the same run: same binding (its name stays DIFF2, so checkpoints
    # of either load into the other), bit-identical iterates and the same epsilon.
    direct = _run(DIFF2BVRLSGD, clients, **BVR)
    assert direct.binding() == chosen.binding() and direct.binding()["algorithm"] == "DIFF2"
    for a, b in zip(direct.params, chosen.params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert direct.privacy_spent().epsilon == chosen.privacy_spent().epsilon
    runtime = RuntimeConfig(generator=gen(1), sampler_seed=3)
    resumed = DIFF2BVRLSGD(model_fn(), loss, clients, **BVR, runtime=runtime)
    resumed.load_state_dict(chosen.state_dict())
    assert resumed.steps_done == 6
    with pytest.raises(ValueError, match="DIFF2BVRLSGD runs 'bvr-l-sgd', got 'gd'"):
        DIFF2BVRLSGD(model_fn(), loss, clients, **GD, routine="gd")


@pytest.mark.parametrize("routine", ["gd", "bvr-l-sgd"])
def test_a_user_subclass_keeps_its_own_methods_under_both_routines(clients, routine):
    class Counting(DIFF2):
        """A user's DIFF2 overriding a hook both routines run and one only BVR-L-SGD gives content."""

        def _server_round(self, r, restart):
            self.rounds = getattr(self, "rounds", 0) + 1
            return super()._server_round(r, restart)

        def _local_steps(self, r):
            self.local_calls = getattr(self, "local_calls", 0) + 1
            return super()._local_steps(r)

    options = GD if routine == "gd" else dict(BVR, routine=routine)
    mine = _run(Counting, clients, **options)
    assert isinstance(mine, Counting) and type(mine).__name__ == "Counting"
    assert mine.rounds == mine.local_calls == 6
    assert isinstance(mine, DIFF2BVRLSGD) == (routine == "bvr-l-sgd")
    # Its overrides call through to the routine's own steps: the run is the plain class's, bit for bit.
    plain = _run(DIFF2, clients, **options)
    for a, b in zip(mine.params, plain.params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # The user's BVR-L-SGD form is made once.
    assert type(_run(Counting, clients, **options)) is type(mine)
