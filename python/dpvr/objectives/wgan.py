"""The regularised Wasserstein-GAN objective (PrivateDiff paper eq. 65) as a :class:`MinimaxProblem`.

``min_{w_G} max_{w_D} E_x[D(x)] - E_z[D(G(z))] - lambda ||w_D||^2``: the generator ``G`` is the min block
``x`` (a model's parameters), the discriminator's parameters ``w_D`` are the max block ``y`` (one flat
vector, kept in a public ball). The data set is the real samples; each record ``i`` is paired with a latent
code ``z_i`` drawn from ``N(0, I)`` independently of the data, so the per-record loss is

    ``f(w_G, w_D; x_i, z_i) = D(x_i) - D(G(z_i)) - lambda ||w_D||^2``.

**What is private, and why this pairing is DP.** Only the real samples ``x_i`` are private; the latent codes
are public randomness. The real samples enter through the discriminator's real-sample term only:

- ``grad_{w_D} f = grad D(x_i) - grad D(G(z_i)) - 2 lambda w_D`` is clipped per record by the algorithms,
  so replacing one real record moves the clipped sum by at most ``2 C``: the discriminator (ascent) steps
  are Gaussian releases with that sensitivity;
- ``grad_{w_G} f = -grad_{w_G} D(G(z_i))`` does not read ``x_i`` at all: the generator sees the private data
  only through the released discriminator ``w_D`` (post-processing). The algorithms still clip, noise and
  account the generator's steps as if they were private, so the spent epsilon they report is an upper bound
  (the generator stream's true cost is zero).

**Constants.** The ``-lambda ||w_D||^2`` term is the only concavity in ``w_D``: ``strong_concavity = 2
lambda`` is that term's modulus, not a property of the whole objective (``D`` is a network; the paper's
strong-concavity assumption does not hold). ``y`` is projected onto the ball of radius ``radius``;
``y_lipschitz`` is infinite (a network's parameter gradient has no a-priori bound): per-record clipping,
not a Lipschitz constant, is what bounds the sensitivity.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ..problems import MinimaxProblem


class WGANModel(nn.Module):
    """The min block: ``generator``, fed records ``[x_i | z_i]`` (real sample, latent code).

    The output, per record, is ``[x_i | G(z_i)]``: the real sample passes through untouched (no parameter
    sees it), so the generator's per-record gradient cannot depend on it.
    """

    def __init__(self, generator: nn.Module, data_dim: int, latent_dim: int) -> None:
        super().__init__()
        self.generator, self.data_dim, self.latent_dim = generator, int(data_dim), int(latent_dim)

    def forward(self, inputs: Tensor) -> Tensor:
        real, latent = inputs.split([self.data_dim, self.latent_dim], dim=1)
        return torch.cat([real, self.generator(latent)], dim=1)

    def records(self, real: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """``[x_i | z_i]`` with fresh latent codes ``z_i ~ N(0, I)`` (public randomness)."""
        latent = torch.randn(len(real), self.latent_dim, generator=generator, dtype=real.dtype)
        return torch.cat([real, latent], dim=1)


class WGAN(MinimaxProblem):
    """Eq. 65 on :class:`WGANModel` outputs (see the module documentation for what is private).

    Args:
        discriminator: a module mapping ``(B, data_dim)`` samples to ``(B, 1)`` critic values. Only its
            structure and initial parameters are used (the starting ``y``; they must not depend on the data):
            the algorithm owns ``w_D`` as :attr:`~dpvr.algorithms.minimax.MinimaxAlgorithm.y`.
        data_dim: the length of a (flattened) real sample.
        penalty: ``lambda > 0``.
        radius: ``w_D`` is projected onto the ball ``||w_D|| <= radius`` (public).
    """

    def __init__(self, discriminator: nn.Module, data_dim: int, *, penalty: float, radius: float) -> None:
        if not penalty > 0:
            raise ValueError(f"penalty: must be > 0, got {penalty}")
        if not radius > 0:
            raise ValueError(f"radius: must be > 0, got {radius}")
        self.discriminator, self.data_dim = discriminator, int(data_dim)
        named = [(n, p) for n, p in discriminator.named_parameters()]
        self._names = [n for n, _ in named]
        self._shapes = [p.shape for _, p in named]
        self._start = torch.cat([p.detach().reshape(-1) for _, p in named])
        self.y_dim = int(self._start.numel())
        self.penalty, self.radius = float(penalty), float(radius)
        self.strong_concavity = 2 * self.penalty
        self.diameter = 2 * self.radius
        self.y_lipschitz = math.inf

    def critic(self, y: Tensor, samples: Tensor) -> Tensor:
        """``(B,)`` discriminator values ``D_y(samples)`` with parameters ``y`` (flat)."""
        params = dict(
            zip(
                self._names,
                (t.view(s) for t, s in zip(y.split([s.numel() for s in self._shapes]), self._shapes)),
            )
        )
        return functional_call(self.discriminator, params, (samples,)).reshape(len(samples))

    def loss(self, output: Tensor, target: Tensor, y: Tensor) -> Tensor:
        pair = output.reshape(2, self.data_dim)  # [real | fake] of one record
        real, fake = self.critic(y, pair)
        return real - fake - self.penalty * y.square().sum()

    def project(self, y: Tensor) -> Tensor:
        norm = float(y.norm())
        return y * (self.radius / norm) if norm > self.radius else y.clone()

    def initial_y(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The discriminator's initial parameters (random, data-independent), projected. Zero would be a
        degenerate start: a ReLU network with zero weights has zero gradient in every layer but the last."""
        return self.project(self._start.to(dtype))

    def wasserstein(self, y: Tensor, real: Tensor, fake: Tensor) -> float:
        """The Wasserstein estimate ``mean D(real) - mean D(fake)`` of critic ``y`` (the paper's metric)."""
        with torch.no_grad():
            return float(self.critic(y, real).mean() - self.critic(y, fake).mean())
