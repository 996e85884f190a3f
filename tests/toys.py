"""The small logistic-regression task the privacy-review regression tests share: data, model, loss and a
reproducible noise generator."""

import torch

import dpvr
from dpvr.algorithms import DPGD
from dpvr.optim import RuntimeConfig

TINY = 1e-100  # noise this small vanishes in float64 rounding


def gen(seed=0):
    return dpvr.NoiseGenerator(seed=seed, reproducible=True)


def data(n=12, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    return x, (x.sum(1) > 0).to(torch.float64)


def linear(d=4):
    torch.manual_seed(3)
    return torch.nn.Linear(d, 1).double()


def logistic(output, target):
    return torch.nn.functional.binary_cross_entropy_with_logits(output.squeeze(-1), target)


def dp_gd(x, y, nonfinite="zero", **kw):
    options = dict(lr=0.5, clip=1.0, steps=4, noise=1.0)
    options.update(kw)
    runtime = RuntimeConfig(generator=gen(1), nonfinite=nonfinite)
    return DPGD(linear(), logistic, x, y, **options, runtime=runtime)
