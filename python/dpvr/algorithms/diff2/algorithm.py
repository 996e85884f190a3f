"""DIFF2 (Murata & Suzuki, ICML 2023): DP optimisation with a restarted gradient-difference estimator."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from ...grads import trainable_parameters
from ...optim.base import LossFn, PrivateAlgorithm, variant_class
from ...optim.config import PrivacyConfig, RuntimeConfig, stream_clips
from ...optim.estimator import ClippedSum, DifferenceEstimator, Iterate, Radius, global_norm, step_size
from ...optim.gradients import ClippedGradients, accumulators, check_loss
from ...optim.records import Records, as_records, records_fingerprint
from ...optim.sampling import BatchSampler
from .plan import DIFF2Plan

ROUTINES = ("gd", "bvr-l-sgd")
Shard = tuple[torch.Tensor, torch.Tensor]


def clipped_mean(
    gradients: ClippedGradients,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    radius: float,
    out: Sequence[torch.Tensor],
    previous: Sequence[torch.Tensor] | None = None,
    size: int | None = None,
) -> int:
    """One client's upload (the paper's ClippedMean, Algorithm 2), written into ``out``.

    The mean over ``inputs`` of per-sample gradients at the model's current parameters (``previous`` is
    ``None``), or of same-sample differences between them and ``previous``, each clipped to ``radius``.
    A zero radius (the two points coincide) gives zeros. Returns the number of non-finite samples.
    ``size``: the records the mean is over, default ``len(inputs)``; a data-parallel process passes its
    batch's (``inputs`` being its share, and ``gradients`` summing over every process's).
    Every DIFF2 client, in process or remote, computes its upload with this function, so both release
    bitwise the same vectors.
    """
    for t in out:
        t.zero_()
    if radius == 0:
        return 0
    if previous is None:
        dropped = gradients.sum(inputs, targets, radius, out)
    else:
        params = [p for _, p in trainable_parameters(gradients.model)]
        dropped = gradients.diff_sum(inputs, targets, params, previous, radius, out)
    for t in out:
        t.div_(len(inputs) if size is None else size)
    return dropped


def choice_generator(seed: int | None, label: str) -> np.random.Generator:
    """The generator of one kind of random choice (``label``, e.g. ``"diff2/output-round"``), independent of
    every other random stream of the run.

    ``seed`` ``None``: fresh entropy from the operating system. Otherwise the stream is derived from ``seed``
    *and* the label (a SHA-256 of it as numpy's ``SeedSequence`` spawn key), so it shares no state with a
    sampler seeded with ``seed`` or ``seed + k`` (``RuntimeConfig.sampler_seed_for``): a choice drawn from the
    sampler's own seed would be a function of the batches that sampler draws."""
    if seed is None:
        return np.random.default_rng()
    words = np.frombuffer(hashlib.sha256(label.encode()).digest(), dtype=np.uint32)
    return np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=tuple(int(w) for w in words)))


@runtime_checkable
class ClientTransport(Protocol):
    """How DIFF2's server reaches its clients. The point is always the model's current parameters.

    :class:`InProcessClients` computes every client in this process; :mod:`dpvr.distributed` sends the
    point to client processes and receives their uploads. Either way the uploads come back in client
    order, so the server's average is formed in the same order.
    """

    sizes: Sequence[int]  # records per client (public)

    def round(
        self, r: int, restart: bool, radius: float, previous: Sequence[torch.Tensor]
    ) -> Iterator[tuple[Sequence[torch.Tensor], int]]:
        """Round ``r``: each client's :func:`clipped_mean` over all its records (differences against
        ``previous`` unless ``restart``) and its non-finite count, in client order."""
        ...

    def local(
        self, r: int, client: int, batch: np.ndarray | None, radius: float, previous: Sequence[torch.Tensor]
    ) -> tuple[Sequence[torch.Tensor], int]:
        """A BVR-L-SGD local step of round ``r``: ``client``'s clipped mean of differences against
        ``previous`` over its records ``batch`` (``None`` when the radius is zero)."""
        ...


class InProcessClients:
    """Every client's shard in this process, computed one after another (the simulation).

    ``shards``: each client's records (:class:`~dpvr.optim.records.Records`, or ``(inputs, targets)``
    tensors). A round reads each client's full batch (:meth:`~dpvr.optim.records.Records.full`: for tensors,
    the tensors themselves every round), a local step the records drawn.

    ``gradients``: one :class:`ClippedGradients` for every client, or one per client (each then keeps its
    own client's recording for reuse in the next full-batch round).
    """

    def __init__(self, shards: Sequence[Shard | Records],
                 gradients: ClippedGradients | Sequence[ClippedGradients], like: Sequence[torch.Tensor]):
        self.shards = [_client_records(p, shard) for p, shard in enumerate(shards)]
        each = list(gradients) if isinstance(gradients, (list, tuple)) else [gradients] * len(self.shards)
        if len(each) != len(self.shards):
            raise ValueError(f"gradients: one per client ({len(self.shards)}), got {len(each)}")
        self.gradients = each
        self.sizes = [len(records) for records in self.shards]
        self._out = accumulators(like)  # a client's clipped mean, float64 until the server's noise

    def round(
        self, r: int, restart: bool, radius: float, previous: Sequence[torch.Tensor]
    ) -> Iterator[tuple[Sequence[torch.Tensor], int]]:
        for records, gradients in zip(self.shards, self.gradients):
            # A zero radius releases zeros without reading a record (clipped_mean's early return).
            x, y = records.full() if radius != 0 else records.probe(1)
            dropped = clipped_mean(gradients, x, y, radius, self._out, None if restart else previous,
                                   size=len(records))
            yield self._out, dropped

    def local(
        self, r: int, client: int, batch: np.ndarray | None, radius: float, previous: Sequence[torch.Tensor]
    ) -> tuple[Sequence[torch.Tensor], int]:
        records = self.shards[client]
        # batch None: a zero radius, which releases zeros without reading a record (clipped_mean).
        x, y = records.probe(1) if batch is None else records.batch(batch)
        size = None if batch is None else len(batch)
        return self._out, clipped_mean(self.gradients[client], x, y, radius, self._out, previous, size=size)


def _client_records(p: int, shard: Shard | Records) -> Records:
    """Client ``p``'s records from ``shard`` (records, or an ``(inputs, targets)`` pair of tensors)."""
    if isinstance(shard, Records):
        records = shard
    else:
        x, y = shard
        if len(x) == 0 or len(x) != len(y):
            raise ValueError(f"clients[{p}]: needs matching, non-empty inputs and targets")
        records = as_records(x, y)
    if len(records) == 0:
        raise ValueError(f"clients[{p}]: needs matching, non-empty inputs and targets")
    return records


def _held_shards(clients: Sequence[Shard | Records] | ClientTransport) -> list[Records]:
    """The clients' shards held in this process, each checked; none when a :class:`ClientTransport` reaches
    clients elsewhere."""
    if isinstance(clients, ClientTransport):
        return []
    if isinstance(clients, tuple) and len(clients) == 2 and isinstance(clients[0], torch.Tensor):
        raise TypeError("clients: a list of (inputs, targets) shards; [(inputs, targets)] for one client")
    if isinstance(clients, Records):
        raise TypeError("clients: a list of records, one per client; [records] for one client")
    return [_client_records(p, shard) for p, shard in enumerate(clients)]


def _client_sizes(clients: Sequence[Shard | Records] | ClientTransport, shards: list[Records]) -> list[int]:
    """Each client's record count (public under replace-one): the transport's, or the held shards'."""
    sizes = list(clients.sizes) if isinstance(clients, ClientTransport) else [len(s) for s in shards]
    if not sizes:
        raise ValueError("clients: at least one (inputs, targets) shard is required")
    return sizes


def _data_binding(clients: Sequence[Shard | Records] | ClientTransport, shards: list[Records]) -> str:
    """What the run binds as its data: for held shards the fingerprint a distributed aggregator binds for the
    same shards; for shards held by client processes their fingerprint if the transport knows it, else
    their sizes."""
    if isinstance(clients, ClientTransport):
        return getattr(clients, "fingerprint", None) or f"remote shards of sizes {list(clients.sizes)}"
    return records_fingerprint(shards)


class DIFF2(PrivateAlgorithm):
    """DIFF2 with the GD routine (DIFF2-GD, Algorithms 1 and 3) or the BVR-L-SGD routine (Algorithm 4).

    The objective is the unweighted mean of the ``P`` clients' empirical risks (``clients``). Round ``r``
    (1-based) at ``x_{r-1}``, with the estimator ``v``:

    - restart rounds (``(r - 1) % restart == 0``): ``v = mean_p ClippedMean_p(x_{r-1}; C1)
      + N(0, (sigma1 C1)^2 I)``, each client's full-batch mean of per-sample gradients clipped to
      ``C1 = clip["restart"]``;
    - difference rounds: ``v += mean_p ClippedMean_p(x_{r-1} - x_{r-2}; C_r) + N(0, (sigma2 C_r)^2 I)``, the
      mean of same-sample differences ``grad l(x_{r-1}; z) - grad l(x_{r-2}; z)`` clipped to
      ``C_r = C2 ||x_{r-1} - x_{r-2}||`` (``C2 = clip["difference"]``, per unit of movement);
    - routine ``"gd"``: ``x_r = x_{r-1} - lr v`` (or, given ``optimizer``, its step on the gradient ``v``,
      with ``C_r`` then measured on the parameters it produced); routine ``"bvr-l-sgd"``: that step, then
      ``local_steps - 1`` noisy minibatch difference steps on client ``r mod P`` (``local_batch`` records
      without replacement, radius ``C3 ||x_{k-1} - x_{k-2}||`` with ``C3 = clip["local"]``, noise ``sigma3``
      times the radius).

    The paper's ``C1, C2, C3`` are ``clip["restart"]``, ``clip["difference"]``, ``clip["local"]``. Every
    difference radius is capped at ``max_radius`` (default ``2 C1``, a public constant: see
    :class:`~dpvr.optim.estimator.Radius`), which the paper does not do; it keeps a large step from inflating
    the next round's noise.

    Output: the last iterate (the model's parameters); ``output="random"`` (GD routine) keeps the paper's
    uniformly random iterate ``x_{r-1}``, ``r ~ Unif[R]``, in :attr:`output_params`.

    Cost: in a full-batch difference round the previous iterate's activations and output gradients on the
    same records were recorded by the previous round, so ghost clipping keeps that recording and the round
    costs one forward and one backward pass (``reuse_recording``). A recording is reused only for the same
    records at bit-identical parameter values, else recomputed (after a restore, once).

    Args:
        model: the ``nn.Module`` whose trainable parameters are ``x``.
        loss_fn: the per-record loss ``(output, target) -> scalar``.
        clients: a list of ``(inputs, targets)`` shards (or :class:`~dpvr.optim.records.Records`, e.g. a
            user's ``Dataset`` loaded batch by batch), one per client (``P`` of them), or a
            :class:`ClientTransport` that reaches clients elsewhere (:mod:`dpvr.distributed`); the objective
            is the unweighted mean of the clients' empirical risks.
        lr: the step size of ``x_r = x_{r-1} - lr v``; required without ``optimizer``, not given with one.
        steps: the number of rounds ``R``.
        restart: the restart period ``T``: round ``r`` is a restart round when ``(r - 1) % restart == 0``.
        clip: ``{"restart": C1, "difference": C2[, "local": C3]}``: ``C1`` the per-sample gradient radius,
            ``C2`` and ``C3`` the difference radii per unit of movement (``"local"`` exactly with
            ``"bvr-l-sgd"``).
        noise: the noise multipliers ``{"restart": z1, "difference": z2[, "local": z3]}``, or
            ``PaperSigmas(restart=sigma1, ...)`` (the paper's sigmas); ``None``: calibrated from
            ``privacy.epsilon`` jointly (``calibration="tight"``) or by Proposition 4.1 (``"paper"``, with
            ``paper_options={"u": ...}``).
        routine: ``"gd"`` (default, DIFF2-GD) or ``"bvr-l-sgd"``, which constructs :class:`DIFF2BVRLSGD`.
        local_steps: the steps per round; 1 (default) for ``"gd"``, ``>= 2`` for ``"bvr-l-sgd"``.
        local_batch: the records (without replacement) of each BVR-L-SGD local step; needed for it.
        output: ``"last"`` (default) or ``"random"`` (GD routine only; see Output).
        max_radius: the cap on every difference radius; default ``2 C1``.
        optimizer: a ``torch.optim.Optimizer`` that steps on the gradient ``v`` instead of the SGD step (GD
            routine only; ``C_r`` is then measured on the parameters it produced).
        privacy: the :class:`~dpvr.optim.PrivacyConfig` (budget, delta, accountant, calibration).
        runtime: the :class:`~dpvr.optim.RuntimeConfig`.
        reuse_recording: keep each client's ghost-clipping recording for the next full-batch round (see
            Cost); default: on for the GD routine, whose rounds are all full-batch. ``False`` always
            recomputes, saving the memory of one recording and one copy of the parameters per client.

    Raises:
        ValueError: ``privacy.neighbouring="add-remove"`` (the shard sizes divide the means: replace-one
            only); no clients, or a client with empty or mismatched inputs and targets; an unknown
            ``routine`` (or ``"gd"`` given to :class:`DIFF2BVRLSGD`); ``local_steps != 1`` with ``"gd"``;
            ``"bvr-l-sgd"`` without ``local_steps >= 2`` and ``local_batch``; an ``output`` other than
            ``"last"``, or ``"random"`` with ``"bvr-l-sgd"``; ``optimizer`` with ``"bvr-l-sgd"``; a bad
            ``lr``; ``clip`` without exactly the routine's streams, or a radius ``<= 0``; noise that is
            neither given nor calibratable.
        TypeError: ``clients`` given as one ``(inputs, targets)`` pair or one ``Records`` (wrap it in a
            list), ``clip`` not a mapping, or ``privacy``/``runtime``/``optimizer`` of the wrong type.

    Guarantee:
        Record-level, replace-one, w.r.t. each client's data (Prop. 4.1 / E.2): the clip radii are functions
        of released iterates only and every noise std scales with its radius, so each round is a Gaussian
        release with a fixed noise multiplier (``sigma * n * P`` for server rounds, ``sigma3 * b`` for local
        steps, ``sigma`` the paper's noise on the averaged mean). All streams are recorded in one accountant
        as they happen, behind the budget guard. Each client's mean divides by its shard size: public under
        replace-one, the only relation DIFF2 is accounted under (``privacy.neighbouring="add-remove"`` is
        refused). The output round (``output="random"``) is drawn from a stream of its own, independent of
        every sampler's (:func:`choice_generator`).
    """

    name = "DIFF2"
    #: The routine between server rounds: ``"gd"`` here, ``"bvr-l-sgd"`` in :class:`DIFF2BVRLSGD` (chosen by
    #: ``routine="bvr-l-sgd"``).
    routine = "gd"
    required_settings = ("steps", "restart", "clip")
    #: The noisy streams of the routine, each with its own clip radius and noise multiplier.
    clip_streams: tuple[str, ...] = ("restart", "difference")
    #: Whether a client keeps its ghost-clipping recording by default: GD's rounds are all full-batch.
    _reuse_by_default = True

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        clients: Sequence[Shard | Records] | ClientTransport,
        *,
        lr: float | None = None,
        steps: int,
        restart: int,
        clip: Mapping[str, float],
        noise: Mapping[str, float] | None = None,
        routine: str = "gd",
        local_steps: int = 1,
        local_batch: int | None = None,
        output: str = "last",
        max_radius: float | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        privacy: PrivacyConfig = PrivacyConfig(),
        runtime: RuntimeConfig = RuntimeConfig(),
        reuse_recording: bool | None = None,
    ) -> None:
        if routine == "bvr-l-sgd" and self.routine != routine:
            # The routine is a subclass chosen at construction, before any state is set: DIFF2(...,
            # routine="bvr-l-sgd") is DIFF2BVRLSGD, whose local steps are its own methods rather than a flag
            # read throughout. (Not in __new__: the signature users read would then be __new__'s.)
            self.__class__ = variant_class(type(self), DIFF2BVRLSGD)
        settings = dict(
            lr=lr, steps=steps, restart=restart, clip=clip, noise=noise, routine=routine,
            local_steps=local_steps, local_batch=local_batch, output=output, max_radius=max_radius,
            optimizer=optimizer, privacy=privacy, runtime=runtime, reuse_recording=reuse_recording,
        )  # fmt: skip
        shards = _held_shards(clients)
        sizes = _client_sizes(clients, shards)
        self._check_routine(routine)
        self._check_settings(local_steps, local_batch, output, optimizer)
        lr = step_size(lr, optimizer)
        self.clip = stream_clips(clip, self.clip_streams)
        if shards:
            check_loss(model, loss_fn, *shards[0].probe(1))
        # The relation asked for goes to the plan, which refuses add/remove: each client's mean divides by its
        # shard's size, private under add/remove.
        neighbouring = privacy.neighbouring or DIFF2Plan.default_neighbouring()
        plan = DIFF2Plan(
            min(sizes), len(sizes), steps, restart, local_steps, local_batch, neighbouring=neighbouring
        )
        super().__init__(
            model, loss_fn, plan=plan, noise=noise, privacy=privacy, runtime=runtime, settings=settings,
            data=_data_binding(clients, shards),
        )  # fmt: skip
        self.lr, self.steps, self.restart, self.optimizer = lr, int(steps), int(restart), optimizer
        self.local_steps, self.output = local_steps, output
        reuse = self._reuse_by_default if reuse_recording is None else bool(reuse_recording)
        self.gradients = self._clipped_gradients(runtime, reuse)
        self._connect(clients, shards, runtime, reuse)
        self.x = Iterate(self.params, optimizer)  # x_{r-1}, and x_{r-2} before round r
        self.v = DifferenceEstimator(self.flat)
        # Difference radii are capped (default: twice the restart radius), so noise cannot feed on itself.
        cap = 2 * self.clip["restart"] if max_radius is None else float(max_radius)
        self.radius = Radius(self.clip["restart"], per_move=(self.clip["difference"],), cap=cap)
        self._total = accumulators(self.flat)  # the clients' average, float64 until the noise is added
        self._set_up_routine(plan, sizes, runtime, cap)
        self._choose_output(output, steps, runtime)

    def _check_routine(self, routine: str) -> None:
        """Refuses a routine other than this class's (DIFF2 chooses its subclass from ``routine``)."""
        if routine not in ROUTINES:
            raise ValueError(f"routine: must be one of {ROUTINES}, got {routine!r}")
        if routine != self.routine:
            raise ValueError(f"routine: {type(self).__name__} runs {self.routine!r}, got {routine!r}; "
                             f"construct DIFF2(..., routine={routine!r})")

    def _check_settings(
        self, local_steps: int, local_batch: int | None, output: str, optimizer: torch.optim.Optimizer | None
    ) -> None:
        """Refuses the settings this routine cannot honour."""
        if local_steps != 1:
            raise ValueError("local_steps: the GD routine takes one step per round")
        if output not in ("last", "random"):
            raise ValueError("output: 'last', or 'random' with the GD routine")

    def _connect(
        self, clients: Sequence[Shard | Records] | ClientTransport, shards: list[Records],
        runtime: RuntimeConfig, reuse: bool,
    ) -> None:
        """How rounds reach the clients: the transport given, or the shards held here (``shards``), each
        client keeping its own recording under ``reuse``."""
        self.clients = shards  # none on a distributed aggregator
        self.transport: ClientTransport
        if isinstance(clients, ClientTransport):
            self.transport = clients
            return
        gradients = ([self.gradients] + [self._clipped_gradients(runtime, True) for _ in shards[1:]]
                     if reuse else self.gradients)
        self.transport = InProcessClients(shards, gradients, self.flat)

    def _set_up_routine(self, plan: DIFF2Plan, sizes: Sequence[int], runtime: RuntimeConfig,
                        cap: float) -> None:
        """The routine's own state: none for GD, whose rounds read every record."""
        self.samplers: list[BatchSampler] = []

    def _choose_output(self, output: str, steps: int, runtime: RuntimeConfig) -> None:
        # The output round is a random choice of its own: a stream derived for it alone, never one that a
        # sampler also draws from (with a fixed sampler_seed, client 0's local sampler is seeded with it).
        rng = choice_generator(runtime.sampler_seed, "diff2/output-round")
        self._output_round = int(rng.integers(1, steps + 1)) if output == "random" else None
        self.output_params = [p.detach().clone() for p in self.params] if output == "random" else None

    @property
    def gradients(self) -> ClippedGradients:
        """The clipped sums of the in-process clients: client 0's engine, every client's unless each keeps its
        own recording (``reuse_recording`` with several clients)."""
        return self._gradients

    @gradients.setter
    def gradients(self, engine: ClippedGradients) -> None:
        # Replaced (e.g. by a wrapper that checks every sum): every client computing with the old engine
        # computes with the new one, or a client's sums would silently bypass the replacement.
        transport = getattr(self, "transport", None)
        if isinstance(transport, InProcessClients) and engine is not self._gradients:
            own = [p for p, g in enumerate(transport.gradients) if g is not self._gradients]
            if own:
                raise ValueError(
                    f"gradients: DIFF2's clients {own} keep engines of their own (reuse_recording with "
                    "several clients), which replacing client 0's would not reach; replace "
                    "transport.gradients, one engine per client"
                )
            transport.gradients = [engine] * len(transport.gradients)
        self._gradients = engine

    def _clipped_gradients(self, runtime: RuntimeConfig, reuse: bool) -> ClippedGradients:
        return runtime.clipped_gradients(self.model, self.loss_fn, reuse_recording=reuse)

    def _server_round(self, r: int, restart: bool) -> tuple[float, int]:
        """Lines 4-9 of Algorithm 1: the clients' clipped means, averaged, released into ``v``, one step."""
        radius = self.radius(restart, self.x.move)
        stream = "restart" if restart else "difference"
        with self.releasing(stream):
            for a in self._total:
                a.zero_()
            dropped, share = 0, 1.0 / len(self.transport.sizes)
            for mean, count in self.transport.round(r, restart, radius, self.x.previous):
                dropped += count
                for a, m in zip(self._total, mean):
                    a.add_(m, alpha=share)
            # The average of P clients' means, each over at least n_min records clipped at radius: one record
            # moves it by at most radius / (n_min P).
            mean = ClippedSum(self._total, radius, self.plan.dataset_size * self.plan.clients, divided=True)
            self.v.release(
                stream, mean, noise_multiplier=self.noise[stream],
                reset=restart, generator=self.generator, iterate=self.x, lr=self.lr,
            )
        return radius, dropped

    def _local_steps(self, r: int) -> int:
        """The routine's steps after round ``r``'s server step; the GD routine takes none. Returns the
        non-finite samples they dropped."""
        return 0

    def _step(self) -> dict[str, float]:
        r = self.steps_done + 1
        if self._output_round == r:
            for o, p in zip(self.output_params, self.params):
                o.copy_(p.detach())
        restart = (r - 1) % self.restart == 0
        radius, dropped = self._server_round(r, restart)
        dropped += self._local_steps(r)
        return {"restart": float(restart), "radius": radius, "move": self.x.move, "nonfinite": dropped}

    def _buffers(self) -> dict[str, list[torch.Tensor]]:
        buffers = {"v": self.v.value, "prev": self.x.previous}
        if self.output_params is not None:
            buffers["output"] = self.output_params
        return buffers

    def _extra_state(self) -> dict[str, Any]:
        return {
            "move": self.x.move,
            "output_round": self._output_round,
            "samplers": [s.state_dict() for s in self.samplers],
        }

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self.x.move, self._output_round = float(state["move"]), state["output_round"]
        for s, st in zip(self.samplers, state["samplers"]):
            s.load_state_dict(st)


class DIFF2BVRLSGD(DIFF2):
    """DIFF2 with the BVR-L-SGD routine (Algorithm 4): :class:`DIFF2` with ``routine="bvr-l-sgd"``, which
    constructs it (``DIFF2(..., routine="bvr-l-sgd")`` is an instance of this class). Its arguments are
    :class:`DIFF2`'s; only ``routine="bvr-l-sgd"`` (the default here) is taken, with ``local_steps >= 2``,
    ``local_batch``, ``clip["local"]`` and neither ``optimizer`` nor ``output="random"``.

    After each round's server step, ``local_steps - 1`` noisy minibatch difference steps run on client
    ``r mod P`` (``local_batch`` records without replacement, radius ``C3 ||x_{k-1} - x_{k-2}||``, noise
    ``sigma3`` times the radius).

    Guarantee:
        :class:`DIFF2`'s, with the local steps a third Gaussian stream (``"local"``, noise multiplier
        ``sigma3 * b``), subsampled without replacement from one client's shard. A record's loss counts only
        its own client's local steps: the busiest client's (client ``1 % P``, served in rounds ``1, P + 1,
        ...``) are charged as they happen, and every client's once rounds have been re-run after a resume.
    """

    routine = "bvr-l-sgd"
    clip_streams = ("restart", "difference", "local")
    _reuse_by_default = False  # its local steps draw fresh minibatches and move the point between rounds

    def __init__(self, *args: Any, routine: str = "bvr-l-sgd", **kwargs: Any) -> None:
        super().__init__(*args, routine=routine, **kwargs)

    def _check_settings(
        self, local_steps: int, local_batch: int | None, output: str, optimizer: torch.optim.Optimizer | None
    ) -> None:
        if local_steps < 2 or local_batch is None:
            raise ValueError("routine 'bvr-l-sgd' needs local_steps >= 2 and local_batch")
        if output != "last":
            raise ValueError("output: 'last', or 'random' with the GD routine")
        if optimizer is not None:
            raise ValueError("optimizer: BVR-L-SGD's local steps are SGD steps; use routine='gd' with one")

    def _set_up_routine(self, plan: DIFF2Plan, sizes: Sequence[int], runtime: RuntimeConfig,
                        cap: float) -> None:
        """Each client's local sampler, the local radius and the local trajectory's iterate and estimator."""
        # A client's shard may be larger than the plan's n (the smallest): it then draws at a lower rate.
        self.samplers = [
            BatchSampler.for_stream(plan, "local", n, runtime.sampler_seed_for(p))
            for p, n in enumerate(sizes)
        ]
        self.local_radius = Radius(0.0, per_move=(self.clip["local"],), cap=cap)
        self._local_x, self._local_v = Iterate(self.params), DifferenceEstimator(self.flat)

    def _local_steps(self, r: int) -> int:
        """BVR-L-SGD steps k = 2..K on client r mod P, from x_{1,r-1} with the server estimate."""
        client = r % len(self.transport.sizes)
        x, v = self._local_x, self._local_v
        for mine, theirs in zip(v.value, self.v.value):
            mine.copy_(theirs)
        for mine, theirs in zip(x.previous, self.x.previous):
            mine.copy_(theirs)
        x.move, dropped = self.x.move, 0
        # A record's privacy loss counts only its own client's local steps. Round robin serves client 1 % P
        # in rounds 1, P + 1, 2P + 1, ..., so it is always the busiest: charging its rounds (the plan's
        # (K - 1) ceil(R/P) releases) accounts the worst-case client as the run goes. Once rounds have been
        # re-run (a resume from an older checkpoint) another client may be the busiest: every round counts.
        charged = (r - 1) % len(self.transport.sizes) == 0 or self.ledger.branched
        for _ in range(2, self.local_steps + 1):
            radius = self.local_radius(False, x.move)
            with self.releasing("local") if charged else contextlib.nullcontext():
                batch = self.samplers[client].draw() if radius > 0 else None
                mean, count = self.transport.local(r, client, batch, radius, x.previous)
                dropped += count
                v.release(
                    "local", ClippedSum(mean, radius, self.plan.local_batch, divided=True),
                    noise_multiplier=self.noise["local"], reset=False, generator=self.generator, iterate=x,
                    lr=self.lr,
                )
        # The next round's radius spans the whole local trajectory: ||x_{K,r-1} - x_{0,r-1}||.
        self.x.move = global_norm([p - q for p, q in zip(self.x.point(), self.x.previous)])
        return dropped
