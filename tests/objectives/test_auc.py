"""The AUC-M objective against LibAUC's AUCMLoss, its constants, and the AUC metric against scikit-learn."""

import pytest
import torch
from sklearn.metrics import roc_auc_score

from dpvr.objectives import AUCMargin, AUCModel, auc_score


def batch(n=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(n, generator=g, dtype=torch.float64)
    labels = (torch.rand(n, generator=g) < 0.3).long()
    labels[:2] = torch.tensor([0, 1])
    return scores, labels


def outputs(scores, a, b):
    n = len(scores)
    return torch.stack(
        [scores, torch.full((n,), a, dtype=scores.dtype), torch.full((n,), b, dtype=scores.dtype)], 1
    )


@pytest.mark.parametrize("p, margin", [(0.3, 1.0), (0.1, 0.6)])
def test_v1_equals_libauc_aucm_loss(p, margin):
    libauc = pytest.importorskip("libauc.losses")
    scores, labels = batch()
    peer = libauc.AUCMLoss(margin=margin, imratio=p, version="v1", device="cpu")
    with torch.no_grad():
        peer.a.fill_(0.7), peer.b.fill_(0.2), peer.alpha.fill_(0.4)
    expected = peer(scores.float(), labels.float(), auto=False)
    mine = AUCMargin(p, margin=margin).objective(
        outputs(scores, 0.7, 0.2), labels, torch.tensor([0.4]).double()
    )
    assert float(mine) == pytest.approx(float(expected.detach()), rel=1e-5)


def test_v2_is_the_class_conditional_form():
    """v2's per-sample weights make its mean the prior-free objective when p is the batch's ratio."""
    scores, labels = batch()
    p = int(labels.sum()) / len(labels)
    a, b, alpha, m = 0.6, 0.3, 0.5, 1.0
    pos, neg = scores[labels == 1], scores[labels == 0]
    expected = (
        ((pos - a) ** 2).mean()
        + ((neg - b) ** 2).mean()
        + 2 * alpha * (m + neg.mean() - pos.mean())
        - alpha**2
    )
    mine = AUCMargin(p, version="v2").objective(outputs(scores, a, b), labels, torch.tensor([alpha]).double())
    assert float(mine) == pytest.approx(float(expected), rel=1e-12)


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_constants_strong_concavity_projection_and_y_gradient_bound(version):
    problem = AUCMargin(0.2, version=version)
    scores, labels = batch()
    out = outputs(scores, 0.5, 0.5)
    f = lambda al: problem.objective(out, labels, torch.tensor([al], dtype=torch.float64))  # noqa: E731
    second = f(1.3) - 2 * f(1.0) + f(0.7)  # exact for a quadratic: -mu * 0.3^2
    assert float(second) == pytest.approx(-problem.strong_concavity * 0.09, rel=1e-9)
    assert torch.equal(problem.project(torch.tensor([-1.0, 5.0])), torch.tensor([0.0, problem.diameter]))
    for alpha in (0.0, problem.diameter):
        grads = problem.y_grads(out, labels, torch.tensor([alpha]).double())
        assert grads.shape == (len(scores), 1) and float(grads.abs().max()) <= problem.y_lipschitz


def test_auc_model_output_and_parameters():
    model = AUCModel(torch.nn.Linear(4, 1))
    out = model(torch.randn(6, 4))
    assert out.shape == (6, 3) and bool(((out[:, 0] > 0) & (out[:, 0] < 1)).all())
    names = [n for n, _ in model.named_parameters()]
    assert names == ["net.weight", "net.bias", "scalars.a", "scalars.b"]


def test_auc_score_equals_roc_auc_score():
    scores, labels = batch(200, seed=3)
    assert auc_score(scores, labels) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    tied = torch.round(scores * 4) / 4  # ties count one half
    assert auc_score(tied, labels) == pytest.approx(roc_auc_score(labels, tied), abs=1e-12)
    with pytest.raises(ValueError, match="both classes"):
        auc_score(scores, torch.zeros(200))


def test_bad_arguments():
    for kwargs in ({"positive_ratio": 0.0}, {"positive_ratio": 0.5, "version": "v3"}):
        with pytest.raises(ValueError):
            AUCMargin(**kwargs)
