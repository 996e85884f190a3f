"""Normalisers are public under the relation in force: full-batch DP-GD under add/remove is refused (its
n is private), and Poisson DP-SGD divides by the public expected batch size (regressions of an
independent privacy review)."""

import math

import pytest
import torch

from dpvr.algorithms import DPGD, DPSGD
from dpvr.optim import PrivacyConfig, RuntimeConfig
from toys import TINY, data, gen, linear, logistic

# ---- 3. normalisers are public under the relation in force -----------------------------------------------


@pytest.mark.parametrize("cls, kw", [(DPGD, {}), (DPSGD, dict(sampling="full"))])
def test_full_batch_under_add_remove_is_refused(cls, kw):
    x, y = data()
    with pytest.raises(ValueError, match="private under add/remove"):
        cls(linear(), logistic, x, y, lr=0.1, clip=1.0, steps=2, noise=1.0,
            privacy=PrivacyConfig(neighbouring="add-remove"), **kw)


def test_poisson_sampling_divides_by_the_public_batch_size():
    """Add/remove neighbours (one extra record, present in the batch), noise off, same draws: the step moves
    by at most lr C / b with b the public expected batch size, and the noise std is the same on both."""
    x, y = data(n=12)
    extra_x, extra_y = torch.full((1, 4), 40.0, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    bigger = (torch.cat([x, extra_x]), torch.cat([y, extra_y]))
    options = dict(
        lr=0.5, clip=0.3, steps=1, batch_size=6, sampling="poisson", noise=TINY,
        runtime=RuntimeConfig(generator=gen()),
    )
    a = DPSGD(linear(), logistic, x, y, **options)
    b = DPSGD(linear(), logistic, *bigger, **options)
    a.sampler.draw = lambda: torch.arange(12).numpy()
    b.sampler.draw = lambda: torch.arange(13).numpy()
    a.step(), b.step()
    gap = math.sqrt(sum(float(((p - q).detach() ** 2).sum()) for p, q in zip(a.params, b.params)))
    assert 0 < gap <= 0.5 * 0.3 / 6 * (1 + 1e-9)
