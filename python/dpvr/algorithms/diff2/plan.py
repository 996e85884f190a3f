"""DIFF2's plan: a restart stream, a difference stream and BVR-L-SGD's local stream."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from ...privacy import _checks
from ...privacy.events import (
    PER_SAMPLE,
    SAME_SAMPLE,
    Plan,
    accumulated_differences,
    ceil_div,
    check_relation,
    paper_rdp_order,
    released_stream,
)
from ...privacy.mechanism import Sampling
from ...privacy.relations import REPLACE_ONE, check_neighbouring


@dataclass(frozen=True)
class DIFF2Plan(Plan):
    """DIFF2 (Murata & Suzuki 2023) with GD or BVR-L-SGD routine, record-level DP w.r.t. each client.

    ``dataset_size`` is the smallest local dataset size ``n_min`` (the per-client record count), ``clients``
    is ``P``, ``steps`` (communication rounds) is ``R`` and ``restart`` is ``T``. Streams:

    - ``"restart"``: the ``ceil(R/T)`` restart rounds; the server adds ``N(0, sigma1^2 C1^2 I)`` to the
      average over clients of full-batch clipped client means (sensitivity ``2 C1/(n P)`` under
      replace-one), so ``z = sigma1 * n * P``;
    - ``"difference"``: the other ``R - ceil(R/T)`` rounds, likewise with ``sigma2`` (radius
      ``C2 ||x_{r-1} - x_{r-2}||``);
    - ``"local"`` (BVR-L-SGD, ``local_steps = K > 1``): steps ``k = 2..K`` of the client chosen round-robin,
      on ``local_batch = b`` records drawn without replacement from its ``n`` records, noise
      ``sigma3 C3`` on the mean: ``z = sigma3 * b``. A record's client runs them in at most ``ceil(R/P)``
      rounds: ``(K - 1) ceil(R/P)`` releases (Proposition E.2 counts ``K ceil(R/P)``).

    Guarantee: adaptive composition of these Gaussian releases (Lemma C.1, Lemma E.1 and Proposition 4.1 /
    E.2 of the paper), conditioned on released iterates. Replace-one only: the server rounds are full-batch
    means divided by the shard sizes, which add/remove adjacency makes private (refused).
    """

    _all_streams: ClassVar = ("restart", "difference", "local")

    dataset_size: int
    clients: int
    steps: int
    restart: int
    local_steps: int = 1
    local_batch: int | None = None
    neighbouring: str = REPLACE_ONE

    def __post_init__(self) -> None:
        _checks.count("dataset_size", self.dataset_size, minimum=1)
        _checks.count("clients", self.clients, minimum=1)
        _checks.count("steps", self.steps)
        _checks.count("restart", self.restart, minimum=1)
        _checks.count("local_steps", self.local_steps, minimum=1)
        if self.local_steps > 1:
            _checks.count("local_batch", self.local_batch, minimum=1)
        check_neighbouring(self.neighbouring)
        self._refuse_private_size()  # first: the server rounds refuse add/remove whatever the local steps
        if self.local_steps > 1:
            check_relation(self.neighbouring, self.local_sampling)

    @property
    def restarts(self) -> int:
        return ceil_div(self.steps, self.restart)

    @property
    def local_sampling(self) -> Sampling:
        return Sampling.make("wor", batch_size=self.local_batch, dataset_size=self.dataset_size)

    def _streams(self, noise):
        streams = released_stream(noise, "restart", self.restarts) + released_stream(
            noise, "difference", self.steps - self.restarts
        )
        if self.local_steps > 1:
            count = (self.local_steps - 1) * ceil_div(self.steps, self.clients)
            streams += released_stream(noise, "local", count, self.local_sampling)
        return streams

    def _assumptions(self):
        notes = [
            PER_SAMPLE,
            SAME_SAMPLE,
            f"record-level DP w.r.t. each client's data; n_min = {self.dataset_size}, {self.clients} clients",
        ]
        if self.local_steps > 1:
            notes.append(f"local: {self.local_sampling.describe()}; clients chosen round-robin")
        return tuple(notes)

    def _unit(self, stream: str) -> float:
        # sigma times the clip radius is the noise std on a mean over n P records (local: over b records).
        return float(self.local_batch if stream == "local" else self.dataset_size * self.clients)

    def exposures(self) -> dict[str, float]:
        # a restart is carried until the next; differences accumulate; a local step's draws last its round
        carried = {
            "restart": 1.0,
            "difference": accumulated_differences(self.steps, self.restart),
            "local": (self.local_steps - 1) / 2,
        }
        return {s: carried[s] for s in self.streams}

    def paper_noise(
        self, epsilon: float, delta: float, *, u: float = 1.25, u1: float = 3.0, u2: float = 3.0
    ) -> dict[str, float]:
        """Proposition 4.1 (GD; budget split ``u``) or Proposition E.2 (BVR-L-SGD; ``u1``, ``u2``).

        With ``alpha = 1 + ceil(2 log(1/delta)/epsilon)``, ``N = n P`` and ``R1 = ceil(R/T)``:

        - GD: ``sigma1^2 = 4 u alpha R1 / (N^2 eps)``, ``sigma2^2 = 4u/(u-1) alpha (R - R1) / (N^2 eps)``
          (``u = 1`` with ``T = 1`` is the paper's DP-GD);
        - BVR-L-SGD: ``sigma1^2 = 4 u1 alpha R1 / (N^2 eps)``, ``sigma2^2 = 4 u2 alpha (R - R1) / (N^2 eps)``
          and the explicit
          ``sigma3^2 = max((8/3)(4+e) alpha^2/(alpha-1) c K ceil(R/P) / (n^2 eps), 6 alpha / b^2)``
          with ``c = 2/(1 - 1/u1 - 1/u2)`` (``c = 6`` for the paper's ``u1 = u2 = 3``), valid for
          ``b <= min(n/(2 e alpha), (4 n/(alpha sigma3^2))^(1/3))``.
        """
        epsilon = _checks.positive("epsilon", epsilon)
        delta = _checks.delta(delta)
        alpha = paper_rdp_order(epsilon, delta)
        big_n2 = (self.dataset_size * self.clients) ** 2
        rest, diff = self.restarts, self.steps - self.restarts
        if self.local_steps == 1:
            # u > 1 splits the budget; with no difference rounds (T = 1: DP-GD) the paper takes u -> 1.
            if not (u > 1 or (u == 1 and diff == 0)):
                raise ValueError(f"u must be > 1 (or 1 when restart = 1), got {u}")
            sigma2 = {"restart": 4 * u * alpha * rest / (big_n2 * epsilon)}
            if diff:
                sigma2["difference"] = 4 * u / (u - 1) * alpha * diff / (big_n2 * epsilon)
        else:
            spare = 1 - 1 / u1 - 1 / u2
            if not (u1 > 1 and u2 > 1 and spare > 0):
                raise ValueError(f"u1, u2 must exceed 1 with 1 - 1/u1 - 1/u2 > 0, got u1={u1}, u2={u2}")
            n, k_rounds = self.dataset_size, self.local_steps * ceil_div(self.steps, self.clients)
            local = max(
                8 / 3 * (4 + math.e) * alpha**2 / (alpha - 1) * (2 / spare) * k_rounds / (n**2 * epsilon),
                6 * alpha / self.local_batch**2,
            )
            limit = min(n / (2 * math.e * alpha), (4 * n / (alpha * local)) ** (1 / 3))
            if self.local_batch > limit:
                raise ValueError(
                    f"Proposition E.2's closed form needs local_batch <= {limit:.4g}, got {self.local_batch}"
                )
            sigma2 = {
                "restart": 4 * u1 * alpha * rest / (big_n2 * epsilon),
                "difference": 4 * u2 * alpha * diff / (big_n2 * epsilon),
                "local": local,
            }
        return {name: self.noise_multiplier(math.sqrt(sigma2[name]), name) for name in self.streams}


__all__ = ["DIFF2Plan"]
