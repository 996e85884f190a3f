"""What every dpvr algorithm shares: its accountant, noise generator, budget guard, checkpoints and loop.

An algorithm owns everything that decides what it releases — sampling, per-sample clipping, noise — so the
accountant records exactly the releases that happened: each noisy release first asks the accountant whether
it fits the budget, then runs, then is recorded.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..grads import trainable_parameters
from ..ops import NoiseGenerator
from ..privacy import Accountant, PrivacyReport
from ..privacy.calibration import calibrate
from ..privacy.events import Plan

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
STATE_FORMAT = 1
CHECKPOINT_MAGIC = b"DPVR-CHECKPOINT\n"
CHECKPOINT_VERSION = 1


class BudgetExhaustedError(RuntimeError):
    """The next release would take the privacy loss above the budget; nothing was released."""


class PrivateAlgorithm:
    """Base of the DP algorithms (see the module documentation).

    Subclasses set ``plan`` (the :mod:`dpvr.privacy.events` description of the run), ``noise`` (noise
    multiplier per stream), implement :meth:`step` and list their state tensors in :meth:`_buffers`.

    What the guarantee covers: the released iterates (or, for last-iterate algorithms, the last one). The
    dictionaries :meth:`step` returns are diagnostics for the data holder: entries such as ``nonfinite``
    (samples dropped for non-finite gradients) are computed from the private data without noise and must
    not be published; entries derived from released iterates (clip radii, step lengths) may be.
    """

    name = "private-algorithm"

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        *,
        plan: Plan,
        delta: float,
        epsilon: float | None,
        noise: Mapping[str, float] | None,
        calibration: str,
        accountant: str,
        generator: NoiseGenerator | None,
        **paper_options: float,
    ) -> None:
        if not 0 < delta < 1:
            raise ValueError(f"delta: must be in (0, 1), got {delta}")
        if epsilon is not None and not epsilon > 0:
            raise ValueError(f"epsilon: must be > 0, got {epsilon}")
        self.model, self.loss_fn, self.plan = model, loss_fn, plan
        self.param_names, self.params = map(list, zip(*trainable_parameters(model)))
        for name, p in zip(self.param_names, self.params):
            if not p.is_contiguous():
                raise ValueError(f"parameter {name}: must be contiguous")
        self.flat = [p.detach().view(-1) for p in self.params]
        if noise is None:
            if epsilon is None:
                raise ValueError("give either the noise (sigma...) or a target epsilon to calibrate it")
            noise = calibrate(
                plan, epsilon, delta, accountant=accountant, calibration=calibration, **paper_options
            )
        missing = set(plan.streams) - set(noise)
        if missing:
            raise ValueError(f"noise: missing streams {sorted(missing)}")
        self.noise = {k: float(noise[k]) for k in plan.streams}
        self.epsilon_budget, self.delta = epsilon, delta
        self.accountant = Accountant(accountant, plan.neighbouring)
        for assumption in plan.mechanism(self.noise).assumptions:
            self.accountant.assume(assumption)
        self.generator = generator if generator is not None else NoiseGenerator()
        self.steps_done = 0

    # ---- privacy -------------------------------------------------------------------------------------
    def _admit(self, stream: str) -> tuple[Any, Any]:
        """The accounting of one release of ``stream``; raises if it would exceed the budget."""
        parts, event = self.plan.step(stream, self.noise)
        if self.epsilon_budget is not None and self.accountant.would_exceed(
            parts, event, self.epsilon_budget, self.delta
        ):
            spent = self.accountant.epsilon(self.delta) if self.accountant.streams else 0.0
            raise BudgetExhaustedError(
                f"{self.name}: the next '{stream}' release would exceed the budget epsilon="
                f"{self.epsilon_budget:g} at delta={self.delta:g} (spent so far: epsilon={spent:.4g} "
                f"after {self.steps_done} steps)"
            )
        return parts, event

    def _record(self, admitted: tuple[Any, Any]) -> None:
        self.accountant.record(*admitted)

    def privacy_spent(self, delta: float | None = None) -> PrivacyReport:
        """(epsilon, delta) of everything released so far, from the releases actually made."""
        return self.accountant.report(self.delta if delta is None else delta)

    # ---- running -------------------------------------------------------------------------------------
    @property
    def total_steps(self) -> int:
        raise NotImplementedError

    def step(self) -> dict[str, float]:
        raise NotImplementedError

    def run(
        self,
        steps: int | None = None,
        *,
        progress: bool = True,
        callback: Callable[[int, dict[str, float]], None] | None = None,
    ) -> list[dict[str, float]]:
        """Runs ``steps`` steps (default: what remains of the planned run); returns per-step info."""
        from tqdm import tqdm

        remaining = self.total_steps - self.steps_done if steps is None else steps
        history = []
        for _ in tqdm(range(remaining), desc=self.name, disable=not progress, leave=False):
            info = self.step()
            history.append(info)
            if callback is not None:
                callback(self.steps_done, info)
        return history

    # ---- checkpoints ---------------------------------------------------------------------------------
    def _buffers(self) -> dict[str, list[torch.Tensor]]:
        return {}

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        del state

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: parameters, estimator buffers, noise counters, accountant.

        It contains the noise seed: keep checkpoints as confidential as the training data.
        """
        return {
            "format": STATE_FORMAT,
            "algorithm": self.name,
            "steps_done": self.steps_done,
            "noise": dict(self.noise),
            "params": [p.detach().clone() for p in self.params],
            "buffers": {k: [t.clone() for t in v] for k, v in self._buffers().items()},
            "generator": self.generator.state_dict(),
            "accountant": self.accountant.state_dict(),
            "extra": self._extra_state(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a :meth:`state_dict`; validates it fully before changing anything."""
        try:
            if state["format"] != STATE_FORMAT or state["algorithm"] != self.name:
                raise ValueError(f"state: written by {state['algorithm']!r} format {state['format']}")
            params, buffers = state["params"], state["buffers"]
            _check_tensors("params", params, self.params)
            mine = self._buffers()
            if set(buffers) != set(mine):
                raise ValueError(f"state: buffers {sorted(buffers)} differ from {sorted(mine)}")
            for k in mine:
                _check_tensors(k, buffers[k], mine[k])
            if dict(state["noise"]) != self.noise:
                raise ValueError("state: noise multipliers differ from this algorithm's")
        except (KeyError, TypeError) as err:
            raise ValueError(f"state: not a {self.name} checkpoint ({err!r})") from None
        self._restore(state)

    def _restore(self, state: Mapping[str, Any]) -> None:
        """Installs a :meth:`state_dict` without the binding checks of :meth:`load_state_dict`. Only for
        tests that replay one run's history on a neighbouring dataset (the sensitivity harness)."""
        try:
            generator = NoiseGenerator.from_state_dict(state["generator"])
            accountant = Accountant.from_state_dict(state["accountant"])
            steps = int(state["steps_done"])
        except (KeyError, TypeError) as err:
            raise ValueError(f"state: not a {self.name} checkpoint ({err!r})") from None
        with torch.no_grad():
            for p, v in zip(self.params, state["params"]):
                p.copy_(v)
            for k, tensors in self._buffers().items():
                for t, v in zip(tensors, state["buffers"][k]):
                    t.copy_(v)
        self.generator, self.accountant, self.steps_done = generator, accountant, steps
        self._load_extra_state(state["extra"])

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Writes :meth:`state_dict` to ``path`` atomically (a temporary file in the same directory, flushed
        to disk, then renamed over ``path``), so a crash leaves the old checkpoint or the new one, never a
        mixture. The file is a magic line, a JSON header (format version, payload length, SHA-256 of the
        payload) and the payload. Like the state, it holds the noise seed: protect it like the data.
        """
        buffer = io.BytesIO()
        torch.save(self.state_dict(), buffer)
        payload = buffer.getvalue()
        header = {
            "version": CHECKPOINT_VERSION,
            "algorithm": self.name,
            "length": len(payload),
            "sha256": hashlib.sha256(payload).hexdigest(),
        }
        path = os.fspath(path)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(CHECKPOINT_MAGIC + json.dumps(header).encode() + b"\n" + payload)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restores a :meth:`save_checkpoint` file; refuses (``ValueError``) a file that is truncated,
        altered, of another format version or of another algorithm, before changing anything."""
        with open(path, "rb") as f:
            data = f.read()
        if not data.startswith(CHECKPOINT_MAGIC):
            raise ValueError(f"checkpoint {os.fspath(path)!r}: not a dpvr checkpoint (bad magic)")
        head, sep, payload = data[len(CHECKPOINT_MAGIC) :].partition(b"\n")
        try:
            header = json.loads(head) if sep else None
            version, length, digest = header["version"], int(header["length"]), str(header["sha256"])
        except (ValueError, TypeError, KeyError):
            raise ValueError(f"checkpoint {os.fspath(path)!r}: unreadable header (truncated?)") from None
        if version != CHECKPOINT_VERSION:
            raise ValueError(
                f"checkpoint {os.fspath(path)!r}: format version {version!r}, this dpvr reads "
                f"{CHECKPOINT_VERSION}"
            )
        if len(payload) != length:
            raise ValueError(
                f"checkpoint {os.fspath(path)!r}: truncated or padded ({len(payload)} payload bytes, "
                f"header says {length})"
            )
        if hashlib.sha256(payload).hexdigest() != digest:
            raise ValueError(f"checkpoint {os.fspath(path)!r}: checksum mismatch (the file was altered)")
        if header.get("algorithm") != self.name:
            raise ValueError(
                f"checkpoint {os.fspath(path)!r}: written by {header.get('algorithm')!r}, not {self.name}"
            )
        self.load_state_dict(torch.load(io.BytesIO(payload), weights_only=True))


def _check_tensors(name: str, given: Sequence[torch.Tensor], expected: Sequence[torch.Tensor]) -> None:
    if len(given) != len(expected) or any(
        not isinstance(g, torch.Tensor) or g.shape != e.shape or g.dtype != e.dtype
        for g, e in zip(given, expected)
    ):
        raise ValueError(f"state: {name} do not match this model's shapes/dtypes")
    if any(not torch.isfinite(g).all() for g in given):
        raise ValueError(f"state: {name} contain non-finite values")


def global_norm(tensors: Sequence[torch.Tensor]) -> float:
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors))
