"""Data-parallel private training on a ``torch.distributed`` process group: one logical run on P processes.

Every process runs the same algorithm object on the same model, with the same sampler seed and the same
noise generator (drawn on rank 0 and broadcast, or the user's, checked to agree): so every process draws the
same batch of indices and, at each release, the same noise. Only the work on the data is split:

- each process loads its share of each drawn batch (every P-th index, :class:`ShardedRecords`) and clips
  the per-sample gradients of its records;
- the clipped sums are all-reduced (summed) before the release (:class:`AllReducedGradients`), so every
  process holds the clipped sum of the whole batch, bit for bit the same on every process.

Privacy. Every release of a supported algorithm is ``s + N(0, sigma^2 I)`` where the data-dependent part
``s`` is a sum over the drawn batch of terms each clipped by the algorithm (then divided or scaled by public
numbers), and everything else in it (the clip radius, the batch size, the divisor, ``sigma``) is computed
from public state that every process holds identically (released iterates, the shared sampler and seeds,
the plan). Each process forms the sum of its records' terms and the all-reduce adds them, returning one
vector to every process: ``s`` is the batch's (the one-process ``s`` up to the order of the float additions;
each record's term is still clipped by the same kernel, so the sensitivity is unchanged). The noise is then
drawn once per release in the sense that matters: every process draws the *same* noise from the same key
(the generator, its state and the ledger's noise context are the same everywhere) and adds it to the same
``s``, so what the processes hold after the release is one value, bit for bit, not P independent noisy
copies (which would average the noise down and void the guarantee, or be charged P times). Every process's
accountant records the same releases of the same plan with the same noise multipliers: the one-process
epsilon, charged once. Every count reported of the data (``nonfinite``) is all-reduced with the sums: the
whole batch's. Under ``nonfinite="raise"`` a non-finite record on one process raises on every process
(after the all-reduce, so none waits for the others). Checkpoints are written by rank 0 only.

Supported, and what each release's ``s`` is (each one a sum through the clipped-gradient engine, which
:class:`AllReducedGradients` all-reduces):

- ``dp-sgd``, ``dp-gd``, ``last-iterate``: the batch's clipped sum of per-sample gradients.
- ``diff2`` (GD and BVR-L-SGD routines): restart rounds, a client's clipped sum of per-sample gradients;
  difference rounds and local steps, its clipped sum of same-sample gradient differences (``diff_sum``);
  each divided by the client's whole number of records (or the local batch's), public. The difference
  radius ``C2 ||x_{r-1} - x_{r-2}||`` (capped) is a function of released iterates; BVR-L-SGD's local
  batches are drawn by the client's sampler, seeded from the shared seed, so every process draws the same
  ones; ``output="random"``'s round comes from the shared seed too. Each process keeps the ghost-clipping
  recording of its own records (:meth:`ShardedRecords.full` returns the same share every round), so a
  difference round costs one forward and one backward pass over the process's share, as in one process. With
  several clients each keeping its own recording, each client's engine is all-reduced (every engine is built
  through the runtime, :meth:`~dpvr.optim.RuntimeConfig.clipped_gradients`).
- ``dp-sgda``, ``private-diff`` with ``y_release="ascent"``: the x-releases as above (``private-diff``'s
  difference rounds through ``diff_sum``, its radius from released iterates); each y-release's ``s`` is the
  batch's clipped sum of per-record y-gradients (:meth:`~dpvr.optim.gradients.ClippedGradients.rows`),
  all-reduced likewise; ``y`` and its projection are then computed from released values.
- ``double-spider``: every stream has its own sampler, seeded from the shared seed, so every process draws
  the same batches; each per-record weight or scalar is formed by the process that holds the record, at
  released iterates (``x``, ``eta``). The eta-refresh ``s`` is the batch's clipped sum of per-record scalars
  ``1 - (psi*)'(a_i)`` and the eta-difference ``s`` its clipped sum of same-record scalar differences
  (both through :meth:`~dpvr.optim.gradients.ClippedGradients.rows`: one row per record, so the difference
  is each record's own, formed before its clip); the x-refresh and x-difference ``s`` are the batch's
  clipped sums of weighted per-sample gradients and of weighted same-sample differences (``sum``,
  ``diff_sum``). Every radius is a function of released iterates; every divisor is the stream's public
  batch size.
- ``recursive-spider``: the v streams as Double-SPIDER's x streams, the u streams as its eta streams
  (``rows``). The ``s`` stream draws one record: its term ``clamp(g(w_t; z)) - (1 - beta)
  clamp(g(w_{t-1}; z))`` is formed by :meth:`~dpvr.optim.gradients.ClippedGradients.clamped_diff_sum` on
  the one process whose share holds the record (the first of every draw's indices is rank 0's); the others
  hold no record and add exactly zero, so the all-reduce gives every process that term, bit for bit the
  one-process term at the same point (``t + 0 = t`` in floating point), and the whole batch's non-finite
  count. Its range, hence its sensitivity ``(2 - beta) C5``, is the one-process one. (A Poisson draw of
  any other number of records is a sum of such terms, each formed where its record is, as above.)

Refused under a process group, each because a release's data-dependent part is not such a sum:

- ``private-diff`` with ``y_release="output"``: ``y_hat`` is the output of a certified float64 solve of the
  inner problem over every record's model output; its iterations and stopping rule depend on the data, and
  its rounding allowance (:class:`~dpvr.algorithms.private_diff.rounding.YRounding`) assumes one
  pairwise-summation tree over the ``n`` records in one process. Solved per process it would release P
  different values under the same noise; solved on every process from gathered outputs it would rely on
  bitwise-identical float solves.
- ``last-iterate`` with ``clipping=False``: it asserts every per-example gradient norm of the batch is at
  most ``C``, from norms each process holds only for its share.
- a model already wrapped in ``DistributedDataParallel``: its own gradient all-reduce would run beside
  dpvr's.

A checkpoint is written by rank 0 and loaded by every process (the same file): the re-run's segment
derives from the shared seed, so the processes go on in step, and they are checked to agree.

Agreement. Everything above assumes that the processes run one run: the same settings and the same data.
Nothing in a process group makes that so (a dataset shuffled after a per-rank seed, a file listing that
differs per node, ``clip`` or ``epsilon`` read from a per-node configuration), and a mismatch is not a
slower run but a false guarantee: a record held at another index on another process is loaded by two
processes in one batch and counted twice in the all-reduced sum (``2C`` where ``C`` is priced under
add/remove, ``4C`` where ``2C`` is priced under replace-one), and processes with different clip radii or
noise multipliers release sums that the accountant does not price. So :func:`constructed` (around
``make_private``) refuses the run, on every process and before the first release, unless every process holds
the same *run binding* (:meth:`DataParallel.run_binding`): the algorithm's binding
(:meth:`~dpvr.optim.PrivateAlgorithm.binding`: plan, noise multipliers, every setting that shapes a release),
every field of its :class:`~dpvr.optim.PrivacyConfig` (budget, delta, accountant, calibration, relation,
public size, ... by enumeration, so a field added later is compared too) and of its
:class:`~dpvr.optim.RuntimeConfig` but the noise generator (agreed before, by digest), the accountant and
relation in force, the trainable parameters' starting values, and the
:meth:`~dpvr.optim.records.Records.content_fingerprint` of every dataset the process holds (every record's
values in index order: a reordering or one record more differs). The processes all-gather one SHA-256 of it;
only when the digests differ do they all-gather the settings themselves, to name in the error every setting
that differs and the ranks that hold each value.

Construction is collective, so a process that fails on its own (bad input on one node, a dataset that does
not load) must not leave the others waiting in a collective it never reaches. Construction has two
collectives, each an all-gather that also carries whether the process failed: the sampler seed and noise
generator (:meth:`DataParallel.runtime`), then the run binding. A process that raises before one of them joins
it with its error instead and re-raises; every process learns there that one failed, and raises too (the
failed process its own error, the others a ``RuntimeError`` naming the rank and its error), so no process
waits in a collective that another will not join, and none goes on to release.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import secrets
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..ops import NoiseGenerator
from ..optim import PrivateAlgorithm, RuntimeConfig
from ..optim.binding import canonical
from ..optim.gradients import ClippedGradients
from ..optim.records import CHUNK, Batch, DatasetRecords, Records, TensorRecords
from ..registry import AlgorithmSpec

# The collectives of a data-parallel construction, in order: each an all-gather that every process joins
# exactly once, with its own payload or with its failure (module documentation, "Agreement").
STAGES = ("runtime", "binding")


class DataParallel:
    """The process group a run is split over, and the pieces that split it (see the module documentation)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.sharded: list[ShardedRecords] = []  # every dataset split here, in the order split
        self._joined = 0  # construction stages joined (STAGES)
        self._settled = False  # every process has learnt, in a stage, that the construction fails

    @classmethod
    def detect(cls, group: Any = None) -> DataParallel | None:
        """The given group (or :class:`DataParallel`, returned as it is), or the default one when
        ``torch.distributed`` is initialised with more than one process; None for a one-process run."""
        if isinstance(group, DataParallel):
            return group
        if group is None:
            if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
                return None
            group = dist.group.WORLD
        return cls(group)

    # ---- construction: every process joins each stage once, failed or not -------------------------
    def _stage(self, name: str, payload: Any, failure: BaseException | None = None) -> list[Any]:
        """Joins construction stage ``name`` (the next of :data:`STAGES`): all-gathers ``payload``, or this
        process's ``failure``; returns every process's payload, in rank order. When a process failed, every
        process raises here: the failed one ``failure`` itself, the others a ``RuntimeError`` naming it."""
        if self._joined >= len(STAGES) or STAGES[self._joined] != name:
            raise RuntimeError(f"data-parallel construction: stage {name!r} out of order (joined "
                               f"{self._joined} of {list(STAGES)})")
        self._joined += 1
        failed = None if failure is None else f"{type(failure).__name__}: {failure}"
        every: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(every, (name, failed, None if failed else payload), group=self.group)
        except BaseException:  # the group itself failed (a process died, a timeout): no later stage either
            self._settled = True
            raise
        stages = {stage for stage, _, _ in every}
        if stages != {name}:  # a process joined another stage: a bug of this protocol, never a user's
            self._settled = True
            raise RuntimeError(f"data-parallel construction: the processes joined different stages {stages}")
        failures = {rank: error for rank, (_, error, _) in enumerate(every) if error is not None}
        if failures:
            self._settled = True
            if failure is not None:
                raise failure
            listed = "; ".join(f"rank {rank}: {error}" for rank, error in failures.items())
            raise RuntimeError(
                f"data-parallel run: make_private failed on another process ({listed}); nothing was released "
                "on any process"
            )
        return [p for _, _, p in every]

    def abandon(self, failure: BaseException) -> None:
        """Called with the error that ended this process's construction: joins the next stage with it (so
        that every process learns of it there and raises), unless every process already knows of a failure
        or has joined every stage."""
        if not self._settled and self._joined < len(STAGES):
            try:
                self._stage(STAGES[self._joined], None, failure)
            except BaseException as err:  # it raises failure itself, as it should
                if err is not failure:
                    raise

    def check(self, spec: AlgorithmSpec, module: nn.Module,
              settings: Mapping[str, Any] | None = None) -> None:
        """Refuses (``ValueError``) what this split cannot run as one logical run: a model wrapped in
        ``DistributedDataParallel``, what the algorithm itself refuses for these ``settings``
        (:attr:`~dpvr.registry.AlgorithmSpec.data_parallel`: an algorithm registered without stating its
        support is refused whole), and the clipping modes whose releases are not all-reduced."""
        if isinstance(module, nn.parallel.DistributedDataParallel):
            raise ValueError(
                "module: wrapped in DistributedDataParallel, whose gradient all-reduce would run beside "
                "dpvr's all-reduce of the clipped sums; pass the plain module (ddp_model.module): "
                "make_private trains data-parallel over the process group itself"
            )
        settings = settings or {}
        refusal = spec.data_parallel(settings)
        if refusal is not None:
            raise ValueError(refusal)
        if settings.get("clipping") is False:
            raise ValueError(
                "clipping: False asserts that every per-example gradient norm of a batch is at most clip, "
                "which no process can check over a process group (each sees its share's norms); keep "
                "clipping=True, or run it in one process"
            )
        if settings.get("clipping") == "adaptive":
            raise ValueError(
                "clipping: 'adaptive' releases a count of the batch's records whose gradient norm is at most "
                "the radius, which is not all-reduced over a process group here; use clipping=True or "
                "'per_layer' (both all-reduced), or run it in one process"
            )

    def runtime(self, runtime: RuntimeConfig) -> RuntimeConfig:
        """``runtime`` with one sampler seed and one noise generator for every process: drawn on rank 0 and
        shared in the group (kept inside it, like any noise seed), or the user's own, refused unless every
        process was given the same. The construction's first stage: one all-gather, whatever each process
        was given (a broadcast on some processes beside an all-gather on others would not match)."""
        given = runtime.generator is not None or runtime.sampler_seed is not None
        mine = (runtime.sampler_seed, None if runtime.generator is None else _digest(runtime.generator))
        fresh = [secrets.randbits(63), secrets.randbits(63)] if self.rank == 0 else None
        every = self._stage("runtime", (given, mine, fresh))
        if not any(g for g, _, _ in every):
            seeds = every[0][2]
            return dataclasses.replace(runtime, sampler_seed=seeds[0],
                                       generator=NoiseGenerator(seeds[1], reproducible=True))
        if any(other != mine for _, other, _ in every) or None in mine:
            self._settled = True
            raise ValueError(
                "runtime: a data-parallel run needs the same sampler_seed and noise generator on every "
                "process (give both, equal everywhere, or neither: then rank 0 draws them for all)"
            )
        return runtime

    def run_binding(self, algorithm: PrivateAlgorithm) -> dict[str, Any]:
        """What the processes of a run must agree on (module documentation, "Agreement"), as a flat dictionary
        of canonical values: the algorithm's binding (data aside), every field of its privacy and runtime
        configurations (the noise generator aside: agreed in the first stage), the accountant and relation in
        force, the trainable parameters' values, and each sharded dataset's content fingerprint."""
        bound = dict(algorithm.binding(data=False))
        for group, config in (("privacy", algorithm.privacy), ("runtime", algorithm.runtime)):
            for f in dataclasses.fields(config):
                if f.name != "generator":
                    bound[f"{group}.{f.name}"] = canonical(getattr(config, f.name))
        bound["accountant"] = algorithm.accountant.accountant
        bound["neighbouring"] = algorithm.accountant.neighbouring
        for name, p in zip(algorithm.param_names, algorithm.params):
            bound[f"value.{name}"] = canonical(p)
        for k, records in enumerate(self.sharded):
            bound["data" if len(self.sharded) == 1 else f"data.{k}"] = records.content_fingerprint()
        return bound

    def agree_run(self, algorithm: PrivateAlgorithm) -> None:
        """The construction's last stage: refuses the run on every process (``ValueError`` naming each
        setting that differs and the ranks holding each value) unless every process holds the same
        :meth:`run_binding`. One all-gather of a digest; a second of the settings only when they differ."""
        bound = self.run_binding(algorithm)
        digests = self._stage("binding", hashlib.sha256(_dumps(bound).encode()).hexdigest())
        if len(set(digests)) == 1:
            return
        self._settled = True
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, bound, group=self.group)
        differing = []
        for name in sorted(set().union(*every)):
            holders: dict[str, list[int]] = {}
            for rank, other in enumerate(every):
                holders.setdefault(_shown(other[name]) if name in other else "(absent)", []).append(rank)
            if len(holders) > 1:
                values = "; ".join(f"{value} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                                   for value, r in holders.items())
                differing.append(f"{name}: {values}")
        listed = "\n  - ".join(differing or ["(none by name: the digests differ)"])
        raise ValueError(
            f"data-parallel run: the processes do not hold the same run ({len(differing)} setting(s) "
            "differ); "
            "every process must run the same settings on the same data, in the same order (a record at "
            "another index on another process would be counted twice in a batch's all-reduced sum), so "
            f"nothing was released on any process:\n  - {listed}"
        )

    def agree(self, algorithm: Any) -> None:
        """Refuses to go on (``RuntimeError``) unless every process holds the same run: step, ledger position
        and parameters (by digest)."""
        digest = hashlib.sha256()
        for p in algorithm.params:
            digest.update(p.detach().cpu().numpy().tobytes())
        ledger = algorithm.ledger
        mine = (algorithm.steps_done, ledger.run, ledger.segment, ledger.seq, digest.hexdigest())
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, mine, group=self.group)
        if any(other != mine for other in every):
            raise RuntimeError(f"data-parallel run: the processes disagree after loading ({every}); load the "
                               "same checkpoint file on every process")

    def records(self, records: Records) -> ShardedRecords:
        sharded = ShardedRecords(records, self.rank, self.world)
        self.sharded.append(sharded)
        return sharded

    def gradients(self, engine: ClippedGradients) -> AllReducedGradients:
        return AllReducedGradients(engine, self.group)


def constructed(make_private: Any) -> Any:
    """``make_private`` with the data-parallel construction protocol (module documentation, "Agreement"):
    under a process group, it runs with the group's :class:`DataParallel` (passed on as ``process_group``),
    the processes agree on the whole run (:meth:`DataParallel.agree_run`) before the trainer is returned, and
    an error raised on one process reaches every process in the next collective instead of leaving them
    waiting. Without one, ``make_private`` itself."""

    @functools.wraps(make_private)
    def wrapper(*args: Any, process_group: Any = None, **kwargs: Any) -> Any:
        parallel = DataParallel.detect(process_group)
        if parallel is None:
            return make_private(*args, process_group=None, **kwargs)
        try:
            trainer = make_private(*args, process_group=parallel, **kwargs)
            parallel.agree_run(trainer.algorithm)  # before anything runs: nothing is released in make_private
        except Exception as err:
            parallel.abandon(err)
            raise
        return trainer

    return wrapper


def _dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _shown(value: Any, width: int = 72) -> str:
    """A setting's value as the refusal shows it: its JSON, shortened past ``width`` characters."""
    text = _dumps(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _digest(generator: NoiseGenerator) -> str:
    return hashlib.sha256(repr(sorted(generator.state_dict().items())).encode()).hexdigest()


class ShardedRecords(Records):
    """The records of one process: every draw is the whole batch's indices, of which this process loads
    every ``world``-th, from its ``rank``; its length, probe and fingerprint are the whole dataset's."""

    def __init__(self, records: Records, rank: int, world: int) -> None:
        self.records, self.rank, self.world = records, rank, world
        self._full: tuple[tuple[Any, ...], Batch] | None = None  # the share of the full batch, and its key

    def __len__(self) -> int:
        return len(self.records)

    def batch(self, indices: np.ndarray | Sequence[int]) -> Batch:
        return self.records.batch(np.asarray(indices)[self.rank :: self.world])

    def full(self) -> Batch:
        """This process's share of every record. Kept, and the same tensors returned, while the records'
        own full batch would be the same tensors (tensors unchanged since, or a dataset with
        ``cache_full``), so that each process reuses its recording of its own records (DIFF2-GD's
        difference rounds); loaded afresh otherwise, as the records' own full batch is."""
        records = self.records
        if isinstance(records, TensorRecords):
            key: tuple[Any, ...] | None = (records.inputs, records.inputs._version,
                                           records.targets, records.targets._version)
        else:
            key = () if isinstance(records, DatasetRecords) and records.cache_full else None
        if key is None:
            return self.batch(np.arange(len(self)))
        if self._full is None or not _same(self._full[0], key):
            self._full = key, self.batch(np.arange(len(self)))
        return self._full[1]

    def chunks(self, size: int = CHUNK) -> Iterator[Batch]:
        raise ValueError(
            "a pass over every record (PrivateDiff's y_release='output') is not split across the processes "
            "of a data-parallel run: run it in one process"
        )

    def probe(self, k: int = 1) -> Batch:
        return self.records.probe(k)

    def fingerprint(self) -> str:
        return self.records.fingerprint()

    def content_fingerprint(self) -> str:
        """The whole dataset's (every record this process could load, not its share's): what the processes
        compare."""
        return self.records.content_fingerprint()

    def close(self) -> None:
        self.records.close()


def _same(kept: tuple[Any, ...], key: tuple[Any, ...]) -> bool:
    """Whether ``key`` holds the very objects of ``kept`` (tensors by identity, versions by value)."""
    return len(kept) == len(key) and all(a is b or (isinstance(a, int) and a == b) for a, b in zip(kept, key))


class AllReducedGradients:
    """A :class:`~dpvr.optim.gradients.ClippedGradients` whose sums are the whole batch's: each process's
    clipped sum of its records, all-reduced (one flat buffer per call, with the non-finite count), added to
    ``out``. A record that raises under ``nonfinite="raise"`` raises on every process, after the
    all-reduce."""

    def __init__(self, engine: ClippedGradients, group: Any) -> None:
        self.engine, self.group = engine, group

    @property
    def mode(self) -> str:
        return self.engine.mode

    @property
    def model(self) -> nn.Module:
        return self.engine.model

    def sum(self, inputs: torch.Tensor, targets: torch.Tensor, clip: float, out: Sequence[torch.Tensor],
            point: Sequence[torch.Tensor] | None = None, norms: torch.Tensor | None = None,
            weights: torch.Tensor | None = None, losses: torch.Tensor | None = None, *,
            replace: bool = False) -> int:
        if norms is not None:
            raise ValueError("norms: not gathered across processes (clipping=False is not data-parallel)")
        return self._reduce(out, lambda scratch: self.engine.sum(inputs, targets, clip, scratch, point=point,
                                                                 weights=weights, losses=losses),
                            replace=replace)

    def diff_sum(self, inputs: torch.Tensor, targets: torch.Tensor, point: Sequence[torch.Tensor],
                 previous: Sequence[torch.Tensor], clip: float, out: Sequence[torch.Tensor],
                 a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> int:
        return self._reduce(out, lambda scratch: self.engine.diff_sum(inputs, targets, point, previous, clip,
                                                                      scratch, a=a, b=b))

    def batch_mean(self, losses: torch.Tensor | None, count: int) -> tuple[int, torch.Tensor | None]:
        """The whole batch's size and mean loss: this process's loss sum and record count, all-reduced."""
        loss = losses.detach().sum() if losses is not None else next(self.model.parameters()).new_zeros(())
        total = torch.stack([loss, loss.new_tensor(float(count))])
        dist.all_reduce(total, group=self.group)
        whole = int(total[1])
        return whole, (total[0] / total[1] if losses is not None and whole else None)

    def rows(self, values: torch.Tensor, clip: float, out: Sequence[torch.Tensor]) -> int:
        return self._reduce(out, lambda scratch: self.engine.rows(values, clip, scratch))

    def clamped_diff_sum(self, now: torch.Tensor, before: torch.Tensor, low: float, high: float,
                         out: Sequence[torch.Tensor], weight: float = 1.0) -> int:
        return self._reduce(out, lambda scratch: self.engine.clamped_diff_sum(now, before, low, high, scratch,
                                                                              weight=weight))

    def _reduce(self, out: Sequence[torch.Tensor], local: Any, *, replace: bool = False) -> int:
        """``local(scratch)`` (this process's sum into zeroed ``scratch``, returning its non-finite count),
        all-reduced and added to ``out`` (written there, with ``replace``); the whole batch's non-finite
        count.

        ``scratch`` and the all-reduce are float64 whatever ``out``'s dtype: a float32 all-reduce would round
        the batch's sum at its own magnitude (one record could then move it by more than its clip radius);
        ``out`` gets it rounded once (float64 ``out``, as the algorithms keep, not at all)."""
        scratch = [torch.zeros_like(o, dtype=torch.float64) for o in out]
        failure: FloatingPointError | None = None
        try:
            dropped = local(scratch)
        except FloatingPointError as err:  # nonfinite="raise": every process must leave the all-reduce too
            failure, dropped = err, 0
        like = scratch[0]
        flat = torch.cat([s.reshape(-1) for s in scratch]
                         + [torch.tensor([float(dropped), float(failure is not None)], dtype=like.dtype,
                                         device=like.device)])
        dist.all_reduce(flat, group=self.group)
        if failure is not None:
            raise failure
        if flat[-1] > 0:
            raise FloatingPointError("a record of this batch on another process of the data-parallel run had "
                                     "non-finite values (nonfinite='raise')")
        start = 0
        for o in out:
            whole = flat[start : start + o.numel()].view_as(o)
            if replace:
                o.copy_(whole)
            else:
                o.add_(whole)
            start += o.numel()
        return int(flat[-2])
