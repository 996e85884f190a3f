"""Accountant backends: the registry, and new accountants used end to end through the public API."""

import json
import math

import dp_accounting as dpa
import pytest
from scipy import optimize, stats

from dpvr.algorithms import DIFF2Plan, DPSGDPlan, PrivateDiffPlan
from dpvr.privacy import (
    ACCOUNTANTS,
    Accountant,
    AccountantBackend,
    account,
    accountant_backend,
    calibrate,
    register_accountant,
    unregister_accountant,
)
from dpvr.privacy.backends import PLD, RDP
from dpvr.privacy.relations import REPLACE_ONE, tightest_accountant, unsupported_reason, walk


class RenamedRDP:
    """dpvr's RDP accountant under another name, a rank below it: every answer must be RDP's."""

    name = "renamed-rdp"
    tightness = -1

    def unsupported_reason(self, event, neighbouring):
        return RDP.unsupported_reason(event, neighbouring)

    def rewrite(self, event, neighbouring):
        return RDP.rewrite(event, neighbouring)

    def make(self, neighbouring, *, orders=None, interval=None):
        return RDP.make(neighbouring, orders=orders, interval=interval)

    def compose(self, ledger):
        return RDP.compose(ledger)

    def calibrate(self, design, epsilon, delta):
        return RDP.calibrate(design, epsilon, delta)


class _GaussianComposition:
    """A composition of Gaussian mechanisms is exactly one, ``mu``-GDP (Dong, Roth and Su)."""

    def __init__(self, mu: float) -> None:
        self.mu = mu

    def delta(self, epsilon):
        mu = self.mu
        if mu == 0:
            return 0.0
        if math.isinf(mu):
            return 1.0
        return float(
            stats.norm.cdf(-epsilon / mu + mu / 2)
            - math.exp(epsilon + stats.norm.logcdf(-epsilon / mu - mu / 2))
        )

    def epsilon(self, delta):
        if self.delta(0.0) <= delta:
            return 0.0, None
        return float(optimize.brentq(lambda e: self.delta(e) - delta, 0.0, 1e4, xtol=1e-14, rtol=1e-14)), None

    def notes(self):
        return ["exact Gaussian-DP composition"]


def _mu_squared(event, sensitivity):
    if isinstance(event, dpa.GaussianDpEvent):
        return math.inf if event.noise_multiplier == 0 else (sensitivity / event.noise_multiplier) ** 2
    if isinstance(event, dpa.SelfComposedDpEvent):
        return event.count * _mu_squared(event.event, sensitivity)
    if isinstance(event, dpa.ComposedDpEvent):
        return math.fsum(_mu_squared(e, sensitivity) for e in event.events)
    return 0.0  # NoOp


class ExactGaussian:
    """A new accountant, not built on RDP or PLD: unsampled Gaussian releases only, composed exactly in closed
    form, ranked above PLD (it is exact where PLD rounds)."""

    name = "exact-gaussian"
    tightness = 2

    def unsupported_reason(self, event, neighbouring):
        allowed = (dpa.GaussianDpEvent, dpa.ComposedDpEvent, dpa.SelfComposedDpEvent, dpa.NoOpDpEvent)
        for sub in walk(event):
            if not isinstance(sub, allowed):
                kind = type(sub).__name__
                return f"the exact Gaussian accountant prices unsampled Gaussian releases only, not {kind}"
        return None

    def rewrite(self, event, neighbouring):
        return event

    def make(self, neighbouring, *, orders=None, interval=None):
        return PLD.make(neighbouring, interval=interval)

    def compose(self, ledger):
        sensitivity = 2.0 if ledger.neighbouring == REPLACE_ONE else 1.0
        mu2 = math.fsum(entry.count * _mu_squared(entry.event, sensitivity) for entry in ledger.entries)
        return _GaussianComposition(math.sqrt(mu2))

    def calibrate(self, design, epsilon, delta):
        # mu is proportional to 1/scale: find the mu that spends epsilon, then the scale of the RDP ratios.
        ratios = design(epsilon, exact=False)
        run = design.factory(ratios)
        have = math.sqrt(_mu_squared(run.event, 2.0 if run.neighbouring == REPLACE_ONE else 1.0))
        target = optimize.brentq(
            lambda mu: _GaussianComposition(mu).epsilon(delta)[0] - epsilon,
            1e-3,
            20.0,
            xtol=1e-15,
            rtol=1e-15,
        )
        scale = have / target * (1 + 1e-9)  # round-off on the private side
        return {k: v * scale for k, v in ratios.items()}


class RdpBackendCopy(RenamedRDP):
    name = "rdp"


@pytest.fixture
def registered():
    added = []

    def add(backend):
        register_accountant(backend)
        added.append(backend.name)
        return backend

    yield add
    for name in added:
        unregister_accountant(name)


def test_dpvr_registers_rdp_and_pld():
    assert tuple(ACCOUNTANTS) == ("rdp", "pld") and ACCOUNTANTS == ("rdp", "pld")
    assert repr(ACCOUNTANTS) == "('rdp', 'pld')"
    assert accountant_backend("rdp") is RDP and accountant_backend("pld") is PLD
    assert isinstance(RDP, AccountantBackend) and isinstance(PLD, AccountantBackend)
    assert PLD.tightness > RDP.tightness
    with pytest.raises(ValueError, match=r"accountant must be one of \('rdp', 'pld'\), got 'gdp'"):
        accountant_backend("gdp")


def test_the_registry_refuses_duplicates_and_non_backends(registered):
    with pytest.raises(ValueError, match="already registered"):
        register_accountant(RdpBackendCopy())
    with pytest.raises(TypeError, match="AccountantBackend"):
        register_accountant(object())
    renamed = registered(RenamedRDP())
    assert register_accountant(renamed, replace=True) is renamed
    assert accountant_backend("renamed-rdp") is renamed


PLANS = [
    DPSGDPlan(400, "poisson", 0.01),
    DPSGDPlan(300, "wor", batch_size=64, dataset_size=6400, neighbouring="replace-one"),
    DIFF2Plan(dataset_size=1650, clients=10, steps=200, restart=20),
    PrivateDiffPlan(4000, 256, 300, 2, 3),
]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: type(p).__name__)
def test_a_renamed_backend_gives_rdp_answers_end_to_end(plan, registered):
    registered(RenamedRDP())
    assert "renamed-rdp" in ACCOUNTANTS
    noise = calibrate(plan, 1.0, 1e-6, accountant="renamed-rdp")
    assert noise == calibrate(plan, 1.0, 1e-6, accountant="rdp")
    run = plan(noise)
    report, reference = account(run, 1e-6, "renamed-rdp"), account(run, 1e-6, "rdp")
    assert report.accountant == "renamed-rdp"
    assert report.epsilon == reference.epsilon and report.order == reference.order
    assert report.shares == reference.shares
    acc = Accountant("renamed-rdp", run.neighbouring)
    acc.record_mechanism(run)
    assert acc.delta(1.0) == account_delta(run, "rdp", 1.0)
    event = run.releases[0].step_event()
    assert acc.would_exceed(dict(run.releases[0].parts), event, report.epsilon * 1.01, 1e-6, 10) == (
        _reference_would_exceed(run, event, report.epsilon * 1.01)
    )
    # The state names the accountant and restores while it is registered.
    state = json.loads(json.dumps(acc.state_dict()))
    assert state["accountant"] == "renamed-rdp"
    assert Accountant.from_state_dict(state).epsilon(1e-6) == report.epsilon
    # Ranked below RDP, it is never the tightest.
    assert tightest_accountant(run.event, run.neighbouring) == tightest_accountant_without(run)


def account_delta(run, accountant, epsilon):
    acc = Accountant(accountant, run.neighbouring)
    acc.record_mechanism(run)
    return acc.delta(epsilon)


def _reference_would_exceed(run, event, budget):
    acc = Accountant("rdp", run.neighbouring)
    acc.record_mechanism(run)
    return acc.would_exceed(dict(run.releases[0].parts), event, budget, 1e-6, 10)


def tightest_accountant_without(run):
    return "pld" if unsupported_reason(run.event, "pld", run.neighbouring) is None else "rdp"


def test_an_unregistered_backend_is_refused(registered):
    registered(RenamedRDP())
    state = Accountant("renamed-rdp").state_dict()
    unregister_accountant("renamed-rdp")
    try:
        assert "renamed-rdp" not in ACCOUNTANTS
        with pytest.raises(ValueError, match="accountant must be one of"):
            Accountant.from_state_dict(state)
        with pytest.raises(ValueError, match="accountant must be one of"):
            calibrate(PLANS[0], 1.0, 1e-6, accountant="renamed-rdp")
    finally:
        register_accountant(RenamedRDP())  # for the fixture to remove


def test_a_new_accountant_accounts_calibrates_and_ranks_end_to_end(registered):
    registered(ExactGaussian())
    plan = DIFF2Plan(dataset_size=1650, clients=10, steps=200, restart=20)  # full batches: Gaussians only
    run = plan({"restart": 3.0, "difference": 5.0})
    exact = account(run, 1e-5, "exact-gaussian")
    pld = account(run, 1e-5, "pld")
    # PLD rounds pessimistically to its loss grid: an upper bound on the exact value, and close to it.
    assert exact.epsilon <= pld.epsilon and exact.epsilon == pytest.approx(pld.epsilon, rel=1e-3)
    assert exact.order is None and "exact Gaussian-DP composition" in exact.assumptions
    assert set(exact.shares) == {"restart", "difference"}  # measured on RDP curves, as for every accountant
    assert exact.shares == pld.shares
    # Calibration from the RDP design: the ratios of the RDP split, the scale of the new accountant.
    shares = {"restart": 1.0, "difference": 3.0}
    noise = calibrate(plan, 2.0, 1e-5, shares=shares, accountant="exact-gaussian")
    rdp = calibrate(plan, 2.0, 1e-5, shares=shares)
    assert noise["restart"] / rdp["restart"] == pytest.approx(
        noise["difference"] / rdp["difference"], rel=1e-9
    )
    spent = account(plan(noise), 1e-5, "exact-gaussian").epsilon
    assert spent <= 2.0 and spent == pytest.approx(2.0, rel=1e-6)
    # Ranked above PLD, it is the tightest where it applies, and PLD stays so elsewhere.
    assert tightest_accountant(run.event, run.neighbouring) == "exact-gaussian"
    poisson = DPSGDPlan(100, "poisson", 0.01)(1.0)
    assert tightest_accountant(poisson.event, poisson.neighbouring) == "pld"
    with pytest.raises(ValueError, match="unsampled Gaussian releases only, not PoissonSampledDpEvent"):
        Accountant("exact-gaussian", poisson.neighbouring).record_mechanism(poisson)
