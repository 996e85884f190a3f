"""Distributed DIFF2: P client processes and a trusted aggregator on ``torch.distributed``.

Roles. Rank 0 is the **aggregator**: it runs :class:`dpvr.algorithms.DIFF2` and alone holds the noise
generator (its seed), the accountant and budget guard, the estimator and the local-step samplers, and it
writes the checkpoints. Ranks 1..P are the **clients**: client ``p`` holds only its own shard and answers
each request with its clipped mean (:func:`dpvr.algorithms.diff2.algorithm.clipped_mean`) of per-sample
gradients at the point it was sent, or of same-sample differences between that point and the previous one.
Nothing else leaves a client; the aggregator averages the means in client order, adds the noise with the same
:func:`dpvr.ops.noisy_update` call and the same generator streams as the in-process run, and sends every
client the next point. A distributed run therefore releases bitwise the iterates of the simulation with
the same seed, shards and gradient mode.

BVR-L-SGD local steps. The paper lets client ``p_r`` run its K - 1 noisy local steps itself, but their noise
comes from the generator whose seed must stay with the aggregator. Here the aggregator performs each local
update: it draws the client's minibatch indices (the samplers are part of its state), sends client ``p_r``
the local point ``x_{k-1,r-1}`` and the indices, receives its clipped minibatch mean of differences, adds
the noise and steps. Cost: one round trip (one d-vector each way) per local step instead of one per round,
in exchange for keeping every noise draw, the accounting and the exact equivalence in one place. Handing
the client its noise vectors instead would save the round trips but let it subtract that noise from what it
releases, and a client-held seed would expose every other stream.

Threat model (the paper's section 2.1). Central differential privacy at record level: for each client
``p`` and each pair of datasets that differ in one record of ``D_p`` (replace-one), the sequence of
released iterates (everything the aggregator sends, and the final model) is (epsilon, delta)-DP, as
accounted by the aggregator's accountant. The aggregator is **trusted**: it sees each client's un-noised
clipped mean, which carries no DP guarantee of its own, and the minibatch indices. Clients are
honest-but-curious towards each other: each sees only released iterates (and, for ``p_r``, its own local
points), all post-processing of DP releases. Transport is not encrypted or authenticated (except the
runs a :class:`ClientPool` ships, which are pickled: a client checks their authentication code before
loading one): run it on a private network, or tunnel it. With **secure aggregation** (masking or MPC so
that the aggregator learns only the sum of the client means) the trust in the aggregator would shrink to
"adds honest noise and keeps the seed": the guarantee against the aggregator itself would then still rest
on it adding the noise, or on distributed noise generation by the clients, which would change the noise
and break bitwise equality with the simulation. BVR-L-SGD's local steps involve one client's data only and
could not be hidden by aggregation; they would have to run on the client with client-side noise. Neither
is implemented here.

Failures. A client that dies, raises or does not answer a step within ``timeout`` seconds ends the run:
the aggregator records the reason in the rendezvous store (first writer wins), wakes the other clients,
and every rank raises :class:`DistributedError` with that reason (e.g. ``client 2 (rank 3) did not answer
in round 7 within 10 s``). Checkpoints are written by the aggregator only, atomically, after complete
rounds, so a failed round leaves none. Resuming from one continues with the same iterates and the same
accounting.

Running: on one machine, :class:`ClientPool` keeps P client processes for run after run, with the calling
process aggregating (``dpvr experiment diff2 --backend torch-distributed --clients P`` uses it), and
:func:`launch` is a pool for one run; across machines, ``python -m dpvr.distributed`` under ``torchrun``
(see ``python -m dpvr.distributed --help``), with :func:`init_group`, :func:`aggregate` and :func:`serve`
for your own problem.
"""

from .aggregator import AggregatorResult, aggregate, run_rounds
from .client import serve, serve_runs
from .group import DistributedError, Group, init_group, join_group
from .launch import LaunchResult, launch
from .pool import ClientPool
from .protocol import Traffic
from .transport import RemoteClients

__all__ = [
    "AggregatorResult",
    "ClientPool",
    "DistributedError",
    "Group",
    "LaunchResult",
    "RemoteClients",
    "Traffic",
    "aggregate",
    "init_group",
    "join_group",
    "launch",
    "run_rounds",
    "serve",
    "serve_runs",
]
