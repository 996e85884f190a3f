"""Cyclic DP-SGD released at its last iterate: the plan priced by the last-iterate bounds of
:mod:`dpvr.privacy.last_iterate`, and its epsilon by epoch."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ...privacy import _checks
from ...privacy.accountant import Accountant
from ...privacy.backends import RDP
from ...privacy.events import Plan
from ...privacy.last_iterate import (
    BOUNDS,
    check_settings,
    passes_length,
    require_step,
    step_limit,
    theorem_2_2_rho,
    theorem_2_3_rho,
)
from ...privacy.mechanism import Stream
from ...privacy.relations import REPLACE_ONE, check_neighbouring


@dataclass(frozen=True)
class CyclicDPSGDPlan(Plan):
    """Cyclic DP-SGD releasing only its last iterate; one stream ``"gradient"`` whose cost is an RDP curve.

    Noise multiplier ``z``: the noise std on the *sum* of the batch's clipped gradients over ``C``, i.e.
    ``sigma = lr z C / b`` in parameter space (:meth:`noise_multiplier`/:meth:`sigma` convert).
    ``clipping=False`` asserts that no per-example gradient norm exceeds ``C`` along either run (the known
    sensitivity case of Theorem 2.3, eq. 19). ``bound``:

    - ``"last-iterate"``: the smaller of Theorem 2.3 and (when ``domain_diameter`` is finite) Theorem 2.2;
      raises if the step-size condition fails;
    - ``"composition"``: plain composition of the ``ceil(T/ell)`` passes, each a Gaussian with
      replace-one sensitivity ``2C`` per record (``2 alpha / z^2`` per pass), valid for every iterate;
    - ``"best"`` (default): the smaller of both, composition alone if the step-size condition fails.
    """

    dataset_size: int
    batch_size: int
    steps: int
    lr: float
    clip: float
    weak_convexity: float = 0.0
    smoothness: float = 0.0
    domain_diameter: float = math.inf
    clipping: bool = True
    bound: str = "best"
    neighbouring: str = REPLACE_ONE

    def __post_init__(self) -> None:
        check_settings(self.lr, self.clip, self.batch_size, self.weak_convexity, self.smoothness)
        passes_length(self.dataset_size, self.batch_size)
        _checks.count("steps", self.steps, minimum=1)
        if not self.domain_diameter >= 0:
            raise ValueError(f"domain_diameter must be >= 0 (or inf), got {self.domain_diameter!r}")
        if self.bound not in BOUNDS:
            raise ValueError(f"bound must be one of {BOUNDS}, got {self.bound!r}")
        if check_neighbouring(self.neighbouring) != REPLACE_ONE:
            raise ValueError(
                "the last-iterate bounds are proved for replace-one neighbours; "
                "neighbouring must be 'replace-one'"
            )
        if self.bound == "last-iterate":
            require_step(
                self.lr, step_limit(self.weak_convexity, self.smoothness, self.clipping), "Theorem 2.3"
            )

    @property
    def steps_per_pass(self) -> int:
        """``ell = k / b``."""
        return passes_length(self.dataset_size, self.batch_size)

    def cut(self, steps: int) -> dict[str, Plan]:
        """The run after ``steps`` steps under the last-iterate bound (where its step-size condition holds)
        and under composition of passes: the paper's Figure 1."""
        runs: dict[str, Plan] = {}
        for bound, label in (("last-iterate", "last iterate (Kong & Ribero)"),
                             ("composition", "composition of passes")):
            try:
                runs[label] = replace(self, steps=steps, bound=bound)
            except ValueError:  # the step-size condition of the last-iterate bound fails
                continue
        return runs

    @property
    def passes(self) -> int:
        """Passes started, ``ceil(T / ell)`` (each record is used once per pass)."""
        return -(-self.steps // self.steps_per_pass)

    def _unit(self, stream: str) -> float:
        # The paper's sigma is the parameter-space noise std: z = b sigma / (lr C).
        return self.batch_size / (self.lr * self.clip)

    @property
    def _last_iterate_ok(self) -> bool:
        return self.lr <= step_limit(self.weak_convexity, self.smoothness, self.clipping)

    def units(self) -> dict[str, float]:
        """``rho * z^2`` of each applicable bound: ``"theorem 2.3"``, ``"theorem 2.2"``, ``"composition"``."""
        units = {"composition": 2.0 * self.passes}
        if self.bound == "composition" or not self._last_iterate_ok:
            return units
        sigma = 1.0 / self._unit("gradient")  # the parameter-space std at z = 1
        common = dict(
            sigma=sigma,
            lr=self.lr,
            clip=self.clip,
            batch_size=self.batch_size,
            weak_convexity=self.weak_convexity,
            smoothness=self.smoothness,
            clipping=self.clipping,
        )
        units["theorem 2.3"] = theorem_2_3_rho(dataset_size=self.dataset_size, steps=self.steps, **common)
        theorem_2_2_applies = self.lr <= step_limit(self.weak_convexity, self.smoothness, clipping=True)
        if math.isfinite(self.domain_diameter) and theorem_2_2_applies:
            units["theorem 2.2"] = theorem_2_2_rho(domain_diameter=self.domain_diameter, **common)
        if self.bound == "last-iterate":
            del units["composition"]
        return units

    def active_bound(self) -> str:
        """The bound whose curve is used (the smallest applicable one)."""
        units = self.units()
        return min(units, key=units.get)

    def _streams(self, noise):
        z = noise.get("gradient", 1.0)
        if self.active_bound() == "composition":  # "best" included: the Gaussians themselves, as tight
            return [Stream("gradient", z, self.passes)]
        return [Stream("gradient", z, 1, zcdp_unit=self.units()[self.active_bound()])]

    def _assumptions(self):
        limit = step_limit(self.weak_convexity, self.smoothness, self.clipping)
        notes = [
            f"cyclic batches of {self.batch_size} over {self.dataset_size} records "
            f"({self.steps_per_pass} steps per pass), {self.steps} steps; only the last iterate is released",
            f"bound used: {self.active_bound()}",
        ]
        if self.bound == "composition" or self.active_bound() == "composition":
            if not self._last_iterate_ok:
                notes.append(
                    f"lr={self.lr} exceeds the last-iterate step-size condition lr <= {limit:.6g}; "
                    "plain composition used"
                )
            return tuple(notes)
        notes += [
            f"losses are {self.weak_convexity:g}-weakly convex and {self.smoothness:g}-upper-smooth on "
            "dom h, for both neighbouring datasets (A2, A3); h convex, proper, lower-semicontinuous (A1)",
            f"step size lr={self.lr:g} <= {limit:.6g}",
            (
                "clipping may be active: Lipschitz constant sqrt(2) L_lambda"
                if self.clipping
                else f"no clipping: every per-example gradient norm along both runs is <= C={self.clip:g}"
            ),
            "Theorem 2.3 with its stated constant 4 alpha (its proof gives 2 alpha)",
        ]
        if "theorem 2.2" in self.units():
            notes.append(
                f"dom h has diameter {self.domain_diameter:g} (Theorem 2.2, with sqrt(2) L_lambda "
                "whenever clipping may be active)"
            )
        return tuple(notes)


def epsilon_by_epoch(
    plan: CyclicDPSGDPlan, noise_multiplier: float, delta: float, epochs: Sequence[int]
) -> dict[str, np.ndarray]:
    """epsilon at ``delta`` after each number of epochs: the last-iterate bound and plain composition.

    The curves of the paper's Figure 1, converted to ``(epsilon, delta)`` by dp_accounting's RDP accountant.
    """
    out = {"epochs": np.asarray(epochs, dtype=int), "last-iterate": [], "composition": []}
    for epoch in out["epochs"]:
        steps = _checks.count("epochs", int(epoch), minimum=1) * plan.steps_per_pass
        for bound in ("last-iterate", "composition"):
            run = replace(plan, steps=steps, bound=bound)
            acc = Accountant(RDP.name, REPLACE_ONE)  # the bounds are RDP curves
            acc.record_mechanism(run(noise_multiplier))
            out[bound].append(acc.epsilon(delta))
    return {k: np.asarray(v) for k, v in out.items()}


__all__ = ["CyclicDPSGDPlan", "epsilon_by_epoch"]
