"""PrivateDiff Minimax (the algorithm of :mod:`dpvr.algorithms.private_diff`), built on the minimax
machinery of :mod:`dpvr.algorithms.minimax`: :class:`PrivateDiff` releases y by noisy clipped ascent, and
:class:`PrivateDiffOutputY`, which ``PrivateDiff(..., y_release="output")`` constructs, by output
perturbation."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ... import ops
from ...optim.base import variant_class
from ...optim.config import PrivacyConfig, RuntimeConfig, stream_clips
from ...optim.estimator import ClippedSum, DifferenceEstimator, Iterate, Radius, release, step_size
from ...optim.records import Records, as_records
from ...problems import MinimaxProblem
from ..minimax import MinimaxAlgorithm
from .plan import PrivateDiffPlan
from .rounding import _FLOOR, YRounding, _pairwise_sum

Y_RELEASES = ("ascent", "output")  # how PrivateDiff makes y private: its class, then (PrivateDiffOutputY)
_OUTPUT_CHUNK = 4096  # records per forward pass when the inner problem reads every record's output


class PrivateDiff(MinimaxAlgorithm):
    """PrivateDiff Minimax (Algorithm 3 of Zhang et al., with Algorithm 4 as the y-solver), made private as
    dpvr's design requires.

    Round ``r`` (1-based; the paper's ``r - 1``), at ``x_r`` with the public ``y_r``:

    1. ``y_{r+1}``, private before anything reads it, made one of two ways (``y_release``, below);
    2. one batch of ``m`` records; a checkpoint round (``(r - 1) % restart == 0``) resets the estimator to
       ``mean_i clip_{C1}(grad_x f(x_r, y_{r+1}; z_i)) + N(0, (sigma_x1 C1)^2 I)``; a difference round adds
       ``mean_i clip_{C_r}(grad_x f(x_r, y_{r+1}; z_i) - grad_x f(x_{r-1}, y_r; z_i))
       + N(0, (sigma_x2 C_r)^2 I)`` with ``C_r = C2 ||x_r - x_{r-1}|| + C3`` (the same sample at both points);
    3. ``x_{r+1} = x_r - lr v``.

    **Why y is private.** In the paper ``y_{r+1}`` is the output of noiseless clipped SGA, perturbed only
    after the x-gradient has used it, with a sensitivity bound (uniform stability) that holds in expectation,
    not for every neighbouring pair. dpvr releases ``y_{r+1}`` before any x-gradient reads it, either way:

    - ``y_release="ascent"`` (default): ``y_steps = T2`` noisy clipped ascent steps from ``y_r`` with ``x_r``
      fixed, each on its own batch of ``m`` records: ``y <- Proj_Y(y + lr_y (mean_i clip_{C0}(grad_y f(x_r,
      y; z_i)) + N(0, (sigma_y C0)^2 I)))``. The clipped mean moves by at most ``2 C0 / m`` when one record
      is replaced, so each step is a sampled Gaussian release (``steps * y_steps`` releases of stream
      ``"y"``), and ``y_{r+1}`` is private by post-processing. Needs no property of the problem.
    - ``y_release="output"``: solve the inner problem ``max_{y in Y} F(y) = (1/n) sum_i f(x_r, y; z_i)``
      over *all* ``n`` training records to a certified accuracy ``tau`` (``y_tolerance``) and release
      ``y_{r+1} = Proj_Y(y_hat + N(0, (sigma_y Delta)^2 I))``, ``Delta = gradient_range / (n mu) + 2 tau``
      from the problem's public constants (:meth:`~dpvr.problems.MinimaxProblem.y_sensitivity`; a problem
      that has none is refused). One unsampled Gaussian release of stream ``"y"`` per round, its noise
      multiplier relative to ``Delta``. ``PrivateDiff(..., y_release="output")`` is an instance of
      :class:`PrivateDiffOutputY` (a subclass of a user's subclass is made likewise, its methods first).

    The output release's sensitivity proof, its solver's certificate and rounding allowance, and the
    default tolerance are :class:`PrivateDiffOutputY`'s, the class ``y_release="output"`` constructs.

    The paper's ``C0, C1, C2, C3`` are ``clip["y"]`` (ascent only), ``clip["checkpoint"]`` and
    ``clip["difference"] = (C2, C3)``; the difference round is
    :class:`~dpvr.optim.estimator.DifferenceEstimator`'s, its radius capped at ``max_radius`` (default
    ``2 C1``; not in the paper: it keeps noise from feeding on itself).

    Output: the last iterate (the model's parameters and :attr:`y`).

    Args:
        model: the ``nn.Module`` whose trainable parameters are ``x``.
        problem: the :class:`~dpvr.problems.MinimaxProblem` (``f``, ``Y``; with ``y_release="output"`` also
            its public constants, :meth:`~dpvr.problems.MinimaxProblem.y_sensitivity`).
        inputs: the private records' inputs, or :class:`~dpvr.optim.records.Records`.
        targets: the records' targets; omitted with ``Records``.
        lr: the x step size of ``x_{r+1} = x_r - lr v``; required without ``optimizer``, not given with one.
        lr_y: the y step size: of the noisy ascent (required with ``"ascent"``), or of the output solver
            (default ``1/L``, the problem's smoothness).
        steps: the number of rounds.
        restart: the checkpoint period: round ``r`` resets the estimator when ``(r - 1) % restart == 0``.
        y_steps: ``T2``, the noisy ascent steps per round (``"ascent"``), or the solver's iteration limit
            (``"output"``).
        batch_size: the records ``m`` of each batch; unused with ``sampling="full"``.
        clip: ``{"checkpoint": C1, "difference": (C2, C3)[, "y": C0]}`` (``"y"`` exactly with ``"ascent"``);
            ``C_r = C2 ||x_r - x_{r-1}|| + C3``.
        noise: ``{"checkpoint": z1, "difference": z2, "y": z_y}`` (noise multipliers), or
            ``PaperSigmas(checkpoint=sigma_x1, difference=sigma_x2, y=sigma_y)`` (noise std over the clip
            radius on the batch mean; output y: over ``Delta``); ``None``: calibrated jointly from
            ``privacy.epsilon`` (``calibration="tight"``; with ``y_release="output"`` also Remark 5.1's
            ``calibration="paper"``).
        sampling: ``"wor"`` (default: without replacement) or ``"full"``.
        y_release: ``"ascent"`` (default) or ``"output"`` (see above).
        y_tolerance: ``tau``, the output solver's certified accuracy (``"output"`` only); default the rule
            under **The tolerance**.
        y0: the starting ``y`` (public, shape ``(problem.y_dim,)``); default the problem's initial ``y``.
        max_radius: the cap on the difference radius ``C_r``; default ``2 C1``.
        optimizer: a ``torch.optim.Optimizer`` that steps x on the released estimate (post-processing)
            instead of the SGD step.
        privacy: the :class:`~dpvr.optim.PrivacyConfig`.
        runtime: the :class:`~dpvr.optim.RuntimeConfig`.

    Raises:
        ValueError: ``privacy.neighbouring="add-remove"`` (replace-one only: the sizes are the data's); an
            unknown ``y_release``; ``clip`` without exactly the streams above or with a bad
            radius; ``y_tolerance`` with ``"ascent"``, or not finite and > 0, or below ``4 A + r`` (naming
            the numbers); ``"ascent"`` without ``lr_y``; a bad ``lr``/``lr_y``; a problem without public
            constants under ``"output"``; a ``y0`` of the wrong shape; an invalid batch size or
            ``sampling``; noise neither given nor calibratable.
        TypeError: ``clip`` not a mapping, ``privacy``/``runtime``/``optimizer`` of the wrong type, or
            ``targets`` given with ``Records``.
        RuntimeError: (at a round, ``"output"``) none of the solver's ``y_steps`` iterations certifies
            ``tau``.

    Guarantee:
        ``y`` is released as above. ``C_r`` depends on released iterates only and the noise std scales with
        it, so each x-round is a sampled Gaussian release of fixed noise multiplier (Lemma 8: sensitivity
        ``2C/m``). All three streams are recorded in one accountant as they happen, behind the budget guard
        (the plan :class:`dpvr.algorithms.PrivateDiffPlan` with the same ``y_release``). Assumptions:
        batches drawn as stated (seeded from the operating system unless ``runtime.sampler_seed`` is given);
        ``y0`` does not depend on the private data; with ``y_release="output"``, replace-one neighbours (the
        plan's relation).
    """

    name = "PrivateDiff"
    batch_stream = "checkpoint"
    required_settings = ("steps", "restart", "y_steps", "batch_size", "clip")

    def __init__(
        self,
        model: nn.Module,
        problem: MinimaxProblem,
        inputs: Tensor | Records,
        targets: Tensor | None = None,
        *,
        lr: float | None = None,
        lr_y: float | None = None,
        steps: int,
        restart: int,
        y_steps: int,
        batch_size: int | None,
        clip: Mapping[str, float | tuple[float, float]],
        noise: Mapping[str, float] | None = None,
        sampling: str = "wor",
        y_release: str = "ascent",
        y_tolerance: float | None = None,
        y0: Tensor | None = None,
        max_radius: float | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        privacy: PrivacyConfig = PrivacyConfig(),
        runtime: RuntimeConfig = RuntimeConfig(),
    ) -> None:
        settings = dict(
            lr=lr, lr_y=lr_y, steps=steps, restart=restart, y_steps=y_steps, batch_size=batch_size, clip=clip,
            noise=noise, sampling=sampling, y_release=y_release, y_tolerance=y_tolerance, y0=y0,
            max_radius=max_radius, optimizer=optimizer, privacy=privacy, runtime=runtime,
        )  # fmt: skip
        lr = step_size(lr, optimizer)
        if y_release not in Y_RELEASES:
            raise ValueError(f"y_release: must be one of {Y_RELEASES}, got {y_release!r}")
        if y_release == "output" and not isinstance(self, PrivateDiffOutputY):
            # The variant is a subclass chosen at construction, before any state is set (as DPSGD's
            # last-iterate form): PrivateDiff(..., y_release="output") is PrivateDiffOutputY, whose y-release
            # is its own methods rather than a flag read throughout. (Not in __new__: the signature users
            # read would then be __new__'s.)
            self.__class__ = variant_class(type(self), PrivateDiffOutputY)
        clip = stream_clips(clip, self.clip_streams, pairs=self.clip_pairs)
        records = as_records(inputs, targets)
        n = len(records)
        lr_y = self._prepare_y(problem, model, n, lr_y, y_tolerance)
        # shares="auto": the y noise is relative to Delta (output) or C0 (ascent), the x noise to C1
        units = {"y": self._y_unit(clip) / clip["checkpoint"]}
        plan = PrivateDiffPlan(
            n, n if sampling == "full" else batch_size, steps, restart, y_steps, sampling, y_release=y_release
        )
        super().__init__(
            model, problem, records, plan=plan, lr=lr, lr_y=lr_y, steps=steps, clip=clip, optimizer=optimizer,
            y0=y0, noise=noise, privacy=privacy, runtime=runtime, settings=settings, units=units,
        )  # fmt: skip
        self.y_release, self.restart, self.y_steps = y_release, int(restart), int(y_steps)
        per_move, offset = clip["difference"]
        cap = 2 * clip["checkpoint"] if max_radius is None else float(max_radius)
        self.radius = Radius(clip["checkpoint"], per_move=(per_move,), offset=offset, cap=cap)
        self.x = Iterate(self.params, optimizer)  # x_r, and x_{r-1} before round r
        self.v = DifferenceEstimator(self.flat)
        self._y_prev = self.y.clone()  # y_r: the y that x_{r-1}'s gradient was taken at

    # ---- how y is released: noisy clipped ascent here, output perturbation in PrivateDiffOutputY --------
    #: The streams ``clip`` must name: C0 (``"y"``) clips the ascent's y-gradients; the difference radius is
    #: the pair ``(C2, C3)``.
    clip_streams: tuple[str, ...] = ("checkpoint", "difference", "y")
    clip_pairs = ("difference",)

    def _prepare_y(
        self, problem: MinimaxProblem, model: nn.Module, n: int, lr_y: float | None, y_tolerance: float | None
    ) -> float | None:
        """Checks the y-release's arguments and sets its public constants; returns the y step size."""
        self.y_constants = self.y_tolerance = self.y_sensitivity = self.y_rounding = None
        if y_tolerance is not None:
            raise ValueError("y_tolerance: only y_release='output' solves the inner problem")
        if lr_y is None:
            raise ValueError("lr_y: the ascent step size is required with y_release='ascent'")
        return lr_y

    def _y_unit(self, clip: Mapping[str, Any]) -> float:
        """What the y noise multiplier is relative to: the ascent's clip radius ``C0``."""
        return clip["y"]

    def _y_releases_per_round(self) -> int:
        return self.y_steps

    def _release_y(self) -> int:
        """``y_{r+1}`` from ``y_r`` at ``x_r``: ``y_steps`` noisy clipped ascent steps, each a release of
        stream ``"y"`` on its own batch; returns the records with non-finite outputs."""
        dropped = 0
        for _ in range(self.y_steps):
            with self.releasing("y"):
                dropped += self._y_gradient(self._draw())
                self._y_step("y", self.sampler.batch_size)
        return dropped

    @property
    def estimate(self) -> list[Tensor]:
        """The noisy estimator ``v`` of ``grad_x L(x_r, y_{r+1})`` used by the last step (flat tensors)."""
        return self.v.value

    def _step(self) -> dict[str, float]:
        r = self.steps_done + 1
        m = self.sampler.batch_size
        checkpoint = (r - 1) % self.restart == 0
        stream = "checkpoint" if checkpoint else "difference"
        radius = self.radius(checkpoint, self.x.move)
        # the whole round fits, or none of it happens
        self._admit_round({"y": self._y_releases_per_round(), stream: 1})
        # 1. y_{r+1} at x_r, released before anything reads it
        self._y_prev.copy_(self.y)
        dropped = self._release_y()
        # 2-3. the estimator of grad_x L(x_r, y_{r+1}), reset or difference, and x_{r+1} = x_r - lr v
        with self.releasing(stream):
            batch = self._draw()
            for s in self._sum:
                s.zero_()
            if checkpoint:
                dropped += self._x_sum(batch, radius)
            elif radius > 0:  # a zero radius (x did not move, no offset) clips every difference to 0
                inputs, targets = batch
                dropped += self.gradients.diff_sum(
                    inputs,
                    targets,
                    self._point(self.x.point(), self.y),
                    self._point(self.x.previous, self._y_prev),
                    radius,
                    [*self._sum, self._y_scratch],
                )
            self.v.release(
                stream, ClippedSum(self._sum, radius, m), noise_multiplier=self.noise[stream],
                reset=checkpoint, generator=self.generator, iterate=self.x, lr=self.lr,
            )
        return {
            "checkpoint": float(checkpoint),
            "radius": radius,
            "move": self.x.move,
            "y": float(self.y.norm()),
            "nonfinite": dropped,
        }

    def _buffers(self) -> dict[str, list[Tensor]]:
        return {**super()._buffers(), "v": self.v.value, "prev": self.x.previous, "y_prev": [self._y_prev]}

    def _extra_state(self) -> dict[str, Any]:
        return {**super()._extra_state(), "move": self.x.move}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        super()._load_extra_state(state)
        self.x.move = float(state["move"])


class PrivateDiffOutputY(PrivateDiff):
    """PrivateDiff with ``y`` released by output perturbation (the paper's form, made private as dpvr
    releases it): :class:`PrivateDiff` with ``y_release="output"``, which constructs it
    (``PrivateDiff(..., y_release="output")`` is an instance of this class). Its arguments are
    :class:`PrivateDiff`'s; only ``y_release="output"`` (the default here) is taken. Each round solves the
    inner problem over all ``n`` records to the certified accuracy ``tau`` (``y_tolerance``) and releases
    ``y_{r+1} = Proj_Y(y_hat + N(0, (sigma_y Delta)^2 I))``, ``Delta = gradient_range / (n mu) + 2 tau``.

    **Proof of the output release's sensitivity** (replace-one, ``n`` public). ``x_r`` is a released
    iterate, and record ``i``'s model output at ``x_r`` depends on record ``i`` alone, so replacing it
    changes one term of ``F``. The exact maximisers then satisfy ``||y*(D) - y*(D')|| <= gradient_range / (n
    mu)`` (:class:`~dpvr.problems.minimax.YSensitivity`). The solver returns a ``y_hat`` with ``||y_hat -
    y*|| <= tau`` on each dataset (its certificate, rounding included, below), so ``||y_hat(D) -
    y_hat(D')|| <= Delta``, and the release is the Gaussian mechanism with that sensitivity; the projection
    is post-processing. Every model output is read through the problem's
    :meth:`~dpvr.problems.MinimaxProblem.bounded_outputs`, which maps a non-finite output to a public
    admissible value, so a record with a non-finite score is still an admissible record and the bound holds
    on every pair (``nonfinite="raise"`` raises instead). No clipping is used, so ``F`` keeps the problem's
    strong concavity.

    **The certificate.** Projected gradient ascent in float64 from the public ``y_r`` with step ``lr_y``
    (default ``1/L``, the problem's smoothness), for at most ``y_steps`` iterations. In exact arithmetic,
    after the step ``y+ = Proj_Y(y + lr_y g)`` along any direction ``g``, with ``G = (y+ - y) / lr_y``: the
    projection's optimality gives ``<g - G, v - y+> <= 0`` for all ``v`` in ``Y``, and strong concavity with
    ``y*``'s optimality gives ``mu ||y+ - y*||^2 <= <grad F(y+), y* - y+>``; together ``||y+ - y*|| <= (||G||
    + ||grad F(y+) - g||) / mu`` for any step size and any ``g``.

    **Rounding.** In floating point ``g`` and ``g+`` are the computed gradients at ``y`` and ``y+``, and
    ``y+`` is the projection (assumed exact, as a clamp to a box is) of the rounded ``w = fl(y + lr_y g)``,
    so it is the exact step along ``g' = (w - y) / lr_y``; the bound above with ``g'`` for ``g`` gives
    ``||y+ - y*|| <= (||G|| + ||g+ - g|| + ||g+ - grad F(y+)|| + ||g' - g||) / mu``. The last two terms are
    bounded by the public allowance ``A`` of
    :class:`~dpvr.algorithms.private_diff.rounding.YRounding` (``y_rounding``): each record's gradient is
    within ``32 u L_y`` (``u`` float64's unit roundoff, ``L_y`` the problem's ``y_lipschitz``; assumed of
    the problem's ``y_grads``, and a computed gradient longer than ``L_y`` raises), the ``n`` records are
    summed by a balanced tree (error ``~ log2(n) u L_y``), and ``w``'s two roundings cost ``u (||y|| / lr_y
    + 2 ||g||)``. ``A`` depends on ``n`` only through ``log2 n``. The solver stops at the first ``y+`` with
    ``s ((||G|| + ||g+ - g||) / mu + ||y_hat - y+||) + A <= tau``, ``y_hat`` being ``y+`` in ``y``'s dtype
    and ``s = 1 + 2 (y_dim + 8) u`` covering the rounding of those measured norms: then ``||y_hat - y*|| <=
    tau``, which is all that the sensitivity proof above uses, so the rounding enters the proof only through
    the certificate, never through ``Delta``'s form.

    **The tolerance.** ``tau`` is public: by default ``max(1% of gradient_range / (n mu), 4 A + r)``, ``r``
    a public bound on rounding ``y`` to its dtype (0 in float64; ``~1e-7 ||y||`` in float32), so the
    allowance is below ``tau`` by construction at every ``n``. For AUC-M in float64 the 1% rule holds to
    about ``1e11`` records; a float32 ``y`` reaches its floor (``~1e-7``) from a few hundred thousand
    records (a float64 model avoids that). A ``y_tolerance`` below ``4 A + r`` is refused at construction,
    naming ``y_tolerance`` with the numbers: more iterations cannot certify it. Otherwise the solver raises
    ``RuntimeError`` naming ``y_steps`` if none of its iterations certifies (the round's y-release is then
    charged all the same, and the failure itself depends on the data: choose ``y_steps`` with a margin; a
    quadratic ``F`` such as AUC-M's is certified at the second iteration with the default step). The
    certificate's value is not released.

    Guarantee:
        One unsampled Gaussian release of stream ``"y"`` per round with replace-one sensitivity ``Delta``
        (above), and :class:`PrivateDiff`'s x-releases, all in one accountant behind the budget guard (the
        plan :class:`dpvr.algorithms.PrivateDiffPlan` with ``y_release="output"``). Assumptions:
        :class:`PrivateDiff`'s, replace-one neighbours, and the problem's public constants
        (:meth:`~dpvr.problems.MinimaxProblem.y_sensitivity`, ``y_lipschitz``) holding.
    """

    def __init__(self, *args: Any, y_release: str = "output", **kwargs: Any) -> None:
        if y_release != "output":
            raise ValueError(f"y_release: {type(self).__name__} releases y by output perturbation only (got "
                             f"{y_release!r}); construct PrivateDiff for y_release='ascent'")
        super().__init__(*args, y_release=y_release, **kwargs)

    # no "y" clip: the inner solve reads unclipped gradients, so that F keeps its strong concavity
    clip_streams = ("checkpoint", "difference")

    def _prepare_y(
        self, problem: MinimaxProblem, model: nn.Module, n: int, lr_y: float | None, y_tolerance: float | None
    ) -> float | None:
        """The problem's public constants, the solver's step (default ``1/L``), its rounding allowance, the
        tolerance ``tau`` (checked against that allowance before any data is read) and ``Delta``. The
        ascent step of the base class is not taken: returns ``None`` for it."""
        self.y_constants = problem.y_sensitivity()  # refuses a problem without public constants
        stability = self.y_constants.stability(n)
        step = 1.0 / self.y_constants.smoothness if lr_y is None else lr_y
        # y is kept in the dtype of the model's (first trainable) parameters
        dtype = next((p.dtype for p in model.parameters() if p.requires_grad), torch.float64)
        self.y_rounding = YRounding.of(problem, self.y_constants, n, step, dtype)
        if y_tolerance is None:  # allowance < tolerance by construction, at any n
            tolerance = self.y_rounding.default_tolerance(stability)
        else:
            tolerance = float(y_tolerance)
            if not (tolerance > 0 and math.isfinite(tolerance)):
                raise ValueError(f"y_tolerance: must be finite and > 0, got {y_tolerance}")
            if tolerance < self.y_rounding.minimum_tolerance:  # public: refused before any data is read
                raise ValueError(self.y_rounding.refusal(tolerance))
        self.y_tolerance = tolerance
        self.y_sensitivity = stability + 2 * tolerance  # Delta: the release's replace-one sensitivity
        return step

    def _y_unit(self, clip: Mapping[str, Any]) -> float:
        """What the y noise multiplier is relative to: the release's sensitivity ``Delta``."""
        return self.y_sensitivity

    def _y_releases_per_round(self) -> int:
        return 1

    def _release_y(self) -> int:
        with self.releasing("y"):
            return self._y_output()

    def _y_output(self) -> int:
        """``y <- Proj_Y(y_hat + N(0, (sigma_y Delta)^2 I))``; returns the records with non-finite outputs."""
        y_hat, dropped = self._solve_y()
        self._y_sum.copy_(y_hat)
        release(
            [self._y_v], "y", ClippedSum.replace_one([self._y_sum], self.y_sensitivity),
            noise_multiplier=self.noise["y"], reset=True, generator=self.generator,
        )  # fmt: skip
        self.y.copy_(self.problem.project(self._y_v))
        return dropped

    def _outputs(self) -> tuple[Tensor, Tensor, int]:
        """Every training record's model output at the current ``x`` (float64, through the problem's
        ``bounded_outputs``), every record's target, and how many records had a non-finite output."""
        outputs, targets = [], []
        with torch.no_grad():
            for inputs, chunk_targets in self.records.chunks(_OUTPUT_CHUNK):
                outputs.append(self.model(inputs))
                targets.append(chunk_targets)
        output = torch.cat(outputs).double()
        dropped = int((~torch.isfinite(output.reshape(len(output), -1))).any(dim=1).sum())
        if dropped and self.nonfinite == "raise":
            raise ops.NonFiniteError(f"{self.name}: {dropped} records have non-finite model outputs")
        target = targets[0] if len(targets) == 1 else torch.cat(targets)
        return self.problem.bounded_outputs(output), target, dropped

    def _mean_y_grad(self, outputs: Tensor, targets: Tensor, y: Tensor) -> Tensor:
        """``grad F(y)`` over every record, summed by
        :func:`~dpvr.algorithms.private_diff.rounding._pairwise_sum` (within
        :attr:`~dpvr.algorithms.private_diff.rounding.YRounding.gradient_error` of the exact value when the
        problem's constants hold)."""
        grads = self.problem.y_grads(outputs, targets, y)
        if not bool(torch.isfinite(grads).all()):
            raise RuntimeError(
                f"{type(self.problem).__name__}.bounded_outputs leaves non-finite y-gradients: its "
                "y_sensitivity constants cannot hold"
            )
        if float(grads.norm(dim=1).max()) > self.y_rounding.record_bound:  # a diagnostic, not a release
            raise RuntimeError(
                f"{type(self.problem).__name__}.y_grads gives a record a y-gradient longer than its "
                f"y_lipschitz={self.y_rounding.y_lipschitz:g}: the constants that bound the inner solve's "
                "rounding do not hold"
            )
        return _pairwise_sum(grads) / len(grads)

    def _solve_y(self) -> tuple[Tensor, int]:
        """``y_hat`` within ``y_tolerance`` of ``argmax_Y F`` at the current ``x``, certified (see the class
        documentation), in ``y``'s dtype; and the number of records with non-finite outputs. Unnoised: a
        value of the private data, never to be released as it is."""
        outputs, targets, dropped = self._outputs()
        rounding = self.y_rounding  # public: depends on n, the problem's constants, lr_y and y's dtype
        mu, step = self.y_constants.strong_concavity, self.lr_y
        y = self.y.double()  # the warm start y_r is public
        g = self._mean_y_grad(outputs, targets, y)
        for _ in range(self.y_steps):
            y_next = self.problem.project(y + step * g)
            g_next = self._mean_y_grad(outputs, targets, y_next)
            y_hat = y_next.to(self.y.dtype)
            measured = (float((y_next - y).norm()) / step + float((g_next - g).norm())) / mu + float(
                (y_hat.double() - y_next).norm()
            )
            if rounding.slack * measured + rounding.allowance <= self.y_tolerance:
                return y_hat, dropped
            y, g = y_next, g_next
        raise RuntimeError(
            f"{self.name}: the inner problem was not solved to y_tolerance={self.y_tolerance:g} in "
            f"y_steps={self.y_steps} iterations of lr_y={step:g}: raise y_steps (the solve's rounding "
            f"allowance over n={rounding.records} records, {rounding.allowance:.3g}, is at most "
            f"1/{_FLOOR} of y_tolerance, which leaves the iterations room to certify)"
        )
