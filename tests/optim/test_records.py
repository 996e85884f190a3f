"""Records: the algorithms read exactly the records their accounted sampler draws, from tensors in memory or
from a user's Dataset loaded batch by batch (fresh augmentations, lazy datasets, per-batch collates)."""

import gc
import math
import tracemalloc
import weakref

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import dpvr
from dpvr.algorithms import DIFF2, DPGD, DPSGD
from dpvr.optim import DatasetRecords, PrivacyConfig, RuntimeConfig, TensorRecords
from dpvr.optim.records import FINGERPRINT_RECORDS, PROBE
from dpvr.optim.sampling import BatchSampler, batch_rows
from dpvr.trainer.data import dataset_records

TINY = 1e-100  # noise this small is absorbed by float64 rounding: the run is noise-free
SET_UP = PROBE + FINGERPRINT_RECORDS  # the most records a DatasetRecords reads before the first step


def data(n=40, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    return x, torch.randn(n, generator=g, dtype=torch.float64)


def model_fn(d=5):
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(d, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def loss(output, target):
    return 0.5 * (output.squeeze() - target) ** 2


def gen(seed=7):
    return dpvr.NoiseGenerator(seed=seed, reproducible=True)


class Counted(Dataset):
    """``(x[i], y[i])`` records, counting every ``__getitem__`` (``calls``: the indices read, in order);
    ``noise`` > 0 adds a fresh random augmentation at every access."""

    def __init__(self, x, y, noise=0.0):
        self.x, self.y, self.noise, self.calls = x, y, noise, []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        self.calls.append(int(i))
        x = self.x[i]
        if self.noise:
            x = x + self.noise * torch.randn(x.shape, dtype=x.dtype)
        return x, self.y[i]


def logged(sampler):
    """Logs every index set ``sampler.draw()`` returns (what the algorithm consumes), in ``sampler.log``."""
    draw, sampler.log = sampler.draw, []

    def logging_draw():
        indices = draw()
        sampler.log.append(indices.tolist())
        return indices

    sampler.draw = logging_draw
    return sampler


def same_fingerprint(records, like):
    """``records`` bound as ``like`` is: the noise keys of the same run then coincide (they depend on the
    data's binding)."""
    fingerprint = like.fingerprint()
    records.fingerprint = lambda: fingerprint
    return records


def test_tensor_records_index_as_the_algorithms_did():
    x, y = data()
    records = TensorRecords(x, y)
    rng = np.random.default_rng(0)
    for indices in (np.array([], dtype=np.int64), np.array([3]), np.sort(rng.choice(40, 9, replace=False))):
        rows = batch_rows(indices, x.device)
        bx, by = batch = records.batch(indices)
        assert len(batch) == len(indices)
        assert torch.equal(bx, x[rows]) and bx.shape == x[rows].shape and bx.dtype == x.dtype
        assert torch.equal(by, y[rows]) and by.shape == y[rows].shape
    assert records.full().inputs is x and records.full().targets is y  # the tensors themselves
    assert records.draw(BatchSampler("full", 40)).inputs is x
    sampler, twin = BatchSampler("poisson", 40, 8, seed=3), BatchSampler("poisson", 40, 8, seed=3)
    for _ in range(5):
        assert torch.equal(records.draw(sampler).inputs, x[batch_rows(twin.draw(), x.device)])
    assert records.fingerprint() == dpvr.optim.binding.data_fingerprint([x, y])
    # cast per batch to the model's dtype; the cast full batch is made once and kept
    cast = TensorRecords(x, y, dtype=torch.float32)
    assert torch.equal(cast.batch([1, 2]).inputs, x[1:3].float())
    assert cast.batch([1, 2]).inputs.dtype == torch.float32
    assert cast.full().inputs is cast.full().inputs and cast.full().inputs.dtype == torch.float32
    with pytest.raises(ValueError, match="targets: 39 rows for 40 inputs"):
        TensorRecords(x, y[:-1])


@pytest.mark.parametrize("sampling", ["poisson", "wor"])
def test_dp_sgd_on_tensor_records_releases_what_it_does_on_tensors(sampling):
    x, y = data()
    options = dict(lr=0.3, clip=0.5, steps=6, batch_size=8, sampling=sampling, noise=1.0)
    runs = []
    for given in ((x, y), (TensorRecords(x, y),)):
        runtime = RuntimeConfig(generator=gen(), sampler_seed=4)
        alg = DPSGD(model_fn(), loss, *given, **options, runtime=runtime)
        alg.run(progress=False)
        runs.append(alg)
    for a, b in zip(runs[0].params, runs[1].params):
        assert torch.equal(a, b)
    assert runs[0].binding() == runs[1].binding()
    with pytest.raises(TypeError, match="targets"):
        DPSGD(model_fn(), loss, TensorRecords(x, y), y, **options)
    with pytest.raises(TypeError, match="targets"):
        DPSGD(model_fn(), loss, x, **options)


def test_each_step_loads_exactly_the_drawn_records_with_fresh_augmentations():
    x, y = data()
    dataset = Counted(x, y, noise=0.1)
    records = DatasetRecords(dataset)
    assert len(dataset.calls) <= PROBE  # set-up: the probe only
    alg = DPSGD(model_fn(), loss, records, lr=0.3, clip=0.5, steps=8, batch_size=8, noise=1.0,
                runtime=RuntimeConfig(generator=gen(), sampler_seed=4))
    assert len(dataset.calls) <= SET_UP  # and the fingerprint's few records
    sampler = logged(alg.sampler)
    for _ in range(8):
        dataset.calls.clear()
        alg.step()
        assert dataset.calls == sampler.log[-1]  # exactly the drawn records, in order, once each
    assert sum(len(d) for d in sampler.log) > 0
    # each access runs __getitem__ again: a record's augmentation differs between two loads
    first, second = records.batch([3]).inputs, records.batch([3]).inputs
    assert not torch.equal(first, second)
    assert torch.allclose(first, x[3:4], atol=1.0) and torch.allclose(second, x[3:4], atol=1.0)
    # the fingerprint reads its records under fixed randomness: a checkpoint of the run still binds
    assert DatasetRecords(dataset).fingerprint() == records.fingerprint()


class Lazy(Dataset):
    """``n`` records generated on access from their index, counting the accesses."""

    def __init__(self, n, d=4):
        self.n, self.d, self.calls = n, d, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.calls += 1
        x = torch.arange(self.d, dtype=torch.float64) * ((i % 101) / 101) - 0.5
        return x, torch.tensor(float(i % 7) / 7, dtype=torch.float64)


def test_a_million_lazy_records_cost_a_batch_not_the_dataset():
    dataset = Lazy(10**6)
    tracemalloc.start()
    records = DatasetRecords(dataset)
    alg = DPSGD(model_fn(4), loss, records, lr=0.1, clip=1.0, steps=3, batch_size=16, noise=1.0,
                runtime=RuntimeConfig(generator=gen(), sampler_seed=2))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 4 * 2**20  # set-up allocates nothing of the dataset's size (one float64 per record: 8 MB)
    assert dataset.calls <= SET_UP
    sampler = logged(alg.sampler)
    before = dataset.calls
    alg.step()
    assert dataset.calls - before == len(sampler.log[0]) < 100  # ~16 drawn of 10^6


def pad_longest(batch):
    """Pads every sequence of the batch with zeros to the batch's longest (a per-batch collate)."""
    sequences, targets = zip(*batch)
    longest = max(len(s) for s in sequences)
    padded = torch.stack([torch.cat([s, s.new_zeros(longest - len(s))]) for s in sequences])
    pad_longest.lengths.append(longest)
    return padded, torch.stack(targets)


pad_longest.lengths = []


class Sequences(Dataset):
    def __init__(self, n=30):
        g = torch.Generator().manual_seed(5)
        lengths = torch.randint(1, 9, (n,), generator=g)
        self.items = [(torch.randn(int(k), generator=g, dtype=torch.float64),
                       torch.randn((), generator=g, dtype=torch.float64)) for k in lengths]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class SumLinear(torch.nn.Module):
    """A model that ignores zero padding: a linear function of the sequence's sum."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.linear = torch.nn.Linear(1, 1).double()

    def forward(self, x):
        return self.linear(x.sum(dim=1, keepdim=True))


def test_a_per_batch_padding_collate_pads_each_batch_to_its_longest():
    dataset = Sequences()
    records = DatasetRecords(dataset, pad_longest)
    # noise off: the two paddings round the sums differently, and the noise keys digest the signal
    options = dict(lr=0.2, clip=1.0, steps=5, batch_size=6, sampling="wor", noise=TINY)
    alg = DPSGD(SumLinear(), loss, records, **options, runtime=RuntimeConfig(generator=gen(), sampler_seed=1))
    sampler = logged(alg.sampler)
    pad_longest.lengths.clear()
    alg.run(progress=False)
    longest = [max(len(dataset.items[i][0]) for i in drawn) for drawn in sampler.log]
    assert pad_longest.lengths == longest  # one collate per drawn batch, padded to that batch's longest
    # the same run on every record padded to the dataset's longest: the same model, up to rounding
    padded, targets = pad_longest([dataset[i] for i in range(len(dataset))])
    runtime = RuntimeConfig(generator=gen(), sampler_seed=1)
    ref = DPSGD(SumLinear(), loss, TensorRecords(padded, targets), **options, runtime=runtime)
    ref.run(progress=False)
    for a, b in zip(alg.params, ref.params):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # a full batch is one batch: collated once when its chunks would pad differently
    chunked = DatasetRecords(dataset, pad_longest, chunk=7)
    assert torch.equal(chunked.full().inputs, padded)


@pytest.mark.parametrize("kind", ["dp-sgd", "dp-gd"])
@pytest.mark.parametrize("workers", [0, 2])
def test_dataset_records_release_what_tensor_records_release(kind, workers):
    x, y = data()
    tensors = TensorRecords(x, y)
    streamed = same_fingerprint(DatasetRecords(Counted(x, y), num_workers=workers), tensors)
    cls, options = (DPSGD, dict(batch_size=8, sampling="poisson")) if kind == "dp-sgd" else (DPGD, {})
    runs = []
    for records in (tensors, streamed):
        alg = cls(model_fn(), loss, records, lr=0.3, clip=0.5, steps=5, noise=1.0, **options,
                  runtime=RuntimeConfig(generator=gen(), sampler_seed=4))
        alg.run(progress=False)
        runs.append(alg)
    for a, b in zip(runs[0].params, runs[1].params):
        assert torch.equal(a, b)
    streamed.close()


def test_diff2_full_batch_rounds_on_dataset_records():
    x, y = data(60)
    shards = [(x[i * 20 : (i + 1) * 20], y[i * 20 : (i + 1) * 20]) for i in range(3)]
    # noise off (the bindings differ, and with them the noise keys): the releases are the clipped means
    options = dict(lr=0.2, steps=5, restart=3, clip={"restart": 0.5, "difference": 1.0},
                   noise={"restart": TINY, "difference": TINY})

    def run(clients):
        alg = DIFF2(model_fn(), loss, clients, **options, runtime=RuntimeConfig(generator=gen()))
        forwards = [0]
        alg.model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        alg.run(progress=False)
        return alg, forwards[0]

    tensors, tensor_forwards = run(shards)
    # kept full batches: the same tensors every round, so DIFF2 reuses its recordings as on tensors
    kept, kept_forwards = run([DatasetRecords(Counted(*s), cache_full=True) for s in shards])
    assert kept_forwards == tensor_forwards
    for a, b in zip(tensors.params, kept.params):
        assert torch.equal(a, b)
    # reloaded every round (as fresh augmentations need): recorded again, the same up to rounding
    fresh, fresh_forwards = run([DatasetRecords(Counted(*s)) for s in shards])
    assert fresh_forwards > tensor_forwards
    for a, b in zip(tensors.params, fresh.params):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_from_a_checkpoint_of_dataset_records_is_exact(tmp_path, workers):
    x, y = data()

    def make():
        records = DatasetRecords(Counted(x, y), num_workers=workers, prefetch_factor=2 if workers else None)
        return DPSGD(model_fn(), loss, records, lr=0.3, clip=0.5, steps=8, batch_size=8, noise=1.0,
                     runtime=RuntimeConfig(generator=gen(), sampler_seed=4))

    straight = make()
    straight.run(progress=False)
    first = make()
    first.run(3, progress=False)
    if workers:  # the loader drew ahead: those draws are pending, saved with the sampler
        assert first.sampler.pending
        assert "pending" in first.state_dict()["extra"]["sampler"]
    path = tmp_path / "ckpt"
    first.save_checkpoint(path)
    resumed = make()
    resumed.load_checkpoint(path)
    assert [p.tolist() for p in resumed.sampler.pending] == [p.tolist() for p in first.sampler.pending]
    resumed.run(progress=False)
    for a, b in zip(straight.params, resumed.params):
        assert torch.equal(a, b)
    resumed.records.close()
    # prefetching does not change the draws: the same run without workers releases the same
    if workers:
        x0 = DPSGD(model_fn(), loss, DatasetRecords(Counted(x, y)), lr=0.3, clip=0.5, steps=8, batch_size=8,
                   noise=1.0, runtime=RuntimeConfig(generator=gen(), sampler_seed=4))
        x0.run(progress=False)
        for a, b in zip(straight.params, x0.params):
            assert torch.equal(a, b)


def test_a_loaded_state_replaces_what_was_drawn_ahead():
    """Loading a state into a running object voids the batches its loader drew ahead: the run goes on from
    the loaded sampler state (its own pending draws first), not from the prefetched ones."""
    x, y = data()
    records = DatasetRecords(Counted(x, y), num_workers=1, prefetch_factor=2)
    sampler = BatchSampler("wor", 40, 5, seed=0)
    twin = BatchSampler("wor", 40, 5, seed=0)
    expected = [x[batch_rows(twin.draw(), x.device)] for _ in range(6)]
    state = sampler.state_dict()
    for k in range(3):
        assert torch.equal(records.draw(sampler).inputs, expected[k])
    sampler.load_state_dict(state)  # back to the start
    for k in range(6):
        assert torch.equal(records.draw(sampler).inputs, expected[k])
    records.close()


def test_dataset_records_from_a_user_dataset_or_loader():
    x, y = data()
    with pytest.warns(UserWarning, match="sampler and shuffling are replaced"):
        loader_records = dataset_records(DataLoader(Counted(x, y), batch_size=4, num_workers=2,
                                                    prefetch_factor=3, shuffle=True))
    assert isinstance(loader_records, DatasetRecords)
    assert loader_records.num_workers == 2 and loader_records._options["prefetch_factor"] == 3
    # a TensorDataset is already in memory: its tensors are indexed, cast per batch to the model's dtype
    in_memory = dataset_records(TensorDataset(x, y), torch.float32)
    assert isinstance(in_memory, TensorRecords) and in_memory.inputs is x
    assert in_memory.batch([0]).inputs.dtype == torch.float32
    streamed = dataset_records(Counted(x, y), torch.float32)
    assert torch.equal(streamed.batch([4, 1]).inputs, in_memory.batch([4, 1]).inputs)
    assert torch.equal(dataset_records(Counted(x, y), torch.float32).full().inputs, x.float())

    class Stream(IterableDataset):
        def __iter__(self):
            yield x[0], y[0]

    with pytest.raises(TypeError, match="map-style"):
        dataset_records(Stream())
    with pytest.raises(ValueError, match="empty"):
        dataset_records(Counted(x[:0], y[:0]))
    with pytest.raises(TypeError, match=r"\(input, target\) pair"):
        dataset_records(TensorDataset(x))


def test_empty_poisson_draws_load_nothing():
    x, y = data()
    dataset = Counted(x, y)
    records = DatasetRecords(dataset)
    sampler = BatchSampler("poisson", 40, 1, seed=0)
    empty = 0
    for _ in range(30):
        dataset.calls.clear()
        bx, by = records.draw(sampler)
        assert len(dataset.calls) == len(bx) == len(by)
        if len(bx) == 0:
            empty += 1
            assert bx.shape == (0, 5) and bx.dtype == x.dtype
    assert empty > 0


def _algorithms():
    """``name -> (build(records) -> algorithm, data)``: every algorithm that indexes data, on sampled
    streams where it has them, with real noise."""
    from dpvr.algorithms import DPSGDA, DoubleSpider, PrivateDiff, RecursiveSpider
    from dpvr.objectives import AUCMargin, AUCModel, ChiSquare
    from dpvr.objectives.dro import cross_entropy
    from dpvr.optim import L1

    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 5, generator=g, dtype=torch.float64)
    binary, classes = (torch.rand(24, generator=g) < 0.4).long(), torch.randint(0, 3, (24,), generator=g)
    unit = x / x.norm(dim=1, keepdim=True)

    def auc_model():
        torch.manual_seed(1)
        net = torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))
        return AUCModel(net).double()

    def linear():
        torch.manual_seed(1)
        return torch.nn.Linear(5, 1).double()

    def classifier():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(5, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3)).double()

    def logistic(output, target):
        return torch.nn.functional.binary_cross_entropy_with_logits(output.squeeze(), target)

    def runtime():
        return RuntimeConfig(generator=gen(), sampler_seed=5)

    spider_clip = {"eta-refresh": 1.0, "eta-difference": (1.0, 1.0), "x-refresh": 1.0,
                   "x-difference": (1.0, 1.0)}
    recursive_clip = {"v-refresh": 1.0, "v-difference": 1.0, "u-refresh": 1.0, "u-difference": 1.0, "s": 1.0}
    problem = AUCMargin(0.4)
    return {
        "cyclic": (lambda r: DPSGD(
            linear(), logistic, r, lr=1.0, clip=math.sqrt(2), steps=6, batch_size=6,
            sampling="cyclic", weak_convexity=0.0, smoothness=0.5, prox=L1(0.01), noise=5.0,
            runtime=runtime(),
        ), (unit, binary.double())),
        "random-allocation": (lambda r: DPSGD(
            model_fn(), loss, r, lr=0.3, clip=0.5, steps=5, batch_size=6, sampling="random-allocation",
            noise=1.0, runtime=runtime(), privacy=PrivacyConfig(public_dataset_size=24),
        ), (x, x[:, 0])),
        "double-spider": (lambda r: DoubleSpider(
            classifier(), cross_entropy, r, divergence=ChiSquare(), lam=1.0, steps=5, restart=3,
            batch_sizes=(12, 6, 12, 6), lr=0.2, lr_eta=0.3, max_move=1.0, clip=spider_clip,
            noise=dict.fromkeys(spider_clip, 1.0), runtime=runtime(),
        ), (x, classes)),
        "recursive-spider": (lambda r: RecursiveSpider(
            classifier(), cross_entropy, r, rho=0.5, lam0=1e-3, steps=5, restart=3,
            batch_sizes=(12, 6, 12, 6), lr=0.2, lr_lam=0.05, beta=0.5, loss_bound=5.0, clip=recursive_clip,
            noise=dict.fromkeys(recursive_clip, 1.0), runtime=runtime(),
        ), (x, classes)),
        "dp-sgda": (lambda r: DPSGDA(
            auc_model(), problem, r, lr=0.1, lr_y=0.1, steps=5, batch_size=6, clip={"x": 1.0, "y": 1.0},
            noise={"x": 1.0, "y": 1.0}, runtime=runtime(),
        ), (x, binary)),
        "private-diff": (lambda r: PrivateDiff(
            auc_model(), problem, r, lr=0.1, lr_y=0.1, steps=5, restart=2, y_steps=2, batch_size=6,
            clip={"y": 1.0, "checkpoint": 1.0, "difference": (1.0, 0.1)},
            noise={"checkpoint": 1.0, "difference": 1.0, "y": 1.0}, runtime=runtime(),
        ), (x, binary)),
        "private-diff-output": (lambda r: PrivateDiff(
            auc_model(), problem, r, lr=0.1, steps=3, restart=2, y_steps=4, batch_size=None, sampling="full",
            clip={"checkpoint": 1.0, "difference": (1.0, 0.1)}, y_release="output",
            noise={"checkpoint": 1.0, "difference": 1.0, "y": 1.0}, runtime=runtime(),
        ), (x, binary)),
    }


ALGORITHMS = ["cyclic", "random-allocation", pytest.param("double-spider", marks=pytest.mark.slow),  # 20 s
              "recursive-spider", "dp-sgda", "private-diff", "private-diff-output"]


@pytest.mark.parametrize("name", ALGORITHMS)
def test_every_algorithm_releases_the_same_on_dataset_records(name):
    build, (x, y) = _algorithms()[name]
    tensors = build(TensorRecords(x, y))
    tensors.run(progress=False)
    dataset = Counted(x, y)
    streamed = build(same_fingerprint(DatasetRecords(dataset), TensorRecords(x, y)))
    streamed.run(progress=False)
    for a, b in zip(tensors.params, streamed.params):
        assert torch.equal(a, b)
    for buffer in tensors._buffers():
        for a, b in zip(tensors._buffers()[buffer], streamed._buffers()[buffer]):
            assert torch.equal(a, b)


def test_diff2_local_steps_load_their_batches():
    x, y = data(60)
    shards = [(x[i * 20 : (i + 1) * 20], y[i * 20 : (i + 1) * 20]) for i in range(3)]
    options = dict(lr=0.2, steps=4, restart=2, clip={"restart": 0.5, "difference": 1.0, "local": 1.0},
                   noise={"restart": TINY, "difference": TINY, "local": TINY}, routine="bvr-l-sgd",
                   local_steps=3, local_batch=5)
    runs = [
        DIFF2(model_fn(), loss, clients, **options, runtime=RuntimeConfig(generator=gen(), sampler_seed=2))
        for clients in (shards, [DatasetRecords(Counted(*s)) for s in shards])
    ]
    for alg in runs:
        alg.run(progress=False)
    for a, b in zip(*(alg.params for alg in runs)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(TypeError, match="a list of records"):
        DIFF2(model_fn(), loss, DatasetRecords(Counted(*shards[0])), **options)


def test_a_collate_must_give_one_row_per_record():
    x, y = data()

    def first_only(batch):
        return batch[0][0][None], batch[0][1][None]

    with pytest.raises(ValueError, match="one row of each per record"):
        DatasetRecords(Counted(x, y), first_only)


def test_records_dropped_without_close_are_freed_at_once_with_their_workers():
    """Records with loader workers, dropped mid-run without close(), are freed by reference counting (their
    streams hold no reference back to them), so their workers shut down then. In a reference cycle they
    waited for a garbage-collector pass, whose shutdown of each worker ran into its join timeout."""
    x, y = data()
    records = DatasetRecords(Counted(x, y), num_workers=2, prefetch_factor=2)
    run = DPSGD(model_fn(), loss, records, lr=0.3, clip=0.5, steps=8, batch_size=8, noise=1.0,
                runtime=RuntimeConfig(generator=gen(), sampler_seed=4))
    run.run(3, progress=False)  # mid-run: the loader has drawn ahead
    alive = weakref.ref(records)
    gc.disable()
    try:
        del run, records
        assert alive() is None
    finally:
        gc.enable()


def _subsets(x, y):
    """The ``TensorDataset`` forms whose records are gathered, not loaded one by one: the dataset itself, a
    ``random_split`` part, a subset of a subset (out of index order, with a repeated index)."""
    whole = TensorDataset(x, y)
    part = torch.utils.data.random_split(whole, [30, 10], generator=torch.Generator().manual_seed(3))[0]
    nested = torch.utils.data.Subset(torch.utils.data.Subset(whole, list(range(39, -1, -1))),
                                     [5, 2, 2, 31, 0, *range(6, 30)])
    return {"whole": whole, "split": part, "nested": nested}


@pytest.mark.parametrize("form", ["whole", "split", "nested"])
def test_a_tensor_dataset_or_its_subsets_gather_what_the_loader_loads(form):
    """A ``TensorDataset`` (or ``Subset`` of one) with the default collate is indexed, not loaded record by
    record; each batch, empty draw, chunk and full batch is bit for bit what the ``DataLoader`` (the same
    records through another collate that stacks alike) gives, in the model's dtype."""
    from torch.utils.data.dataloader import default_collate

    x, y = data()
    dataset = _subsets(x, y)[form]
    gathered = DatasetRecords(dataset, dtype=torch.float32)
    loaded = DatasetRecords(dataset, lambda batch: default_collate(batch), dtype=torch.float32)
    assert gathered._rows is not None and loaded._rows is None  # the two paths compared
    n = len(dataset)
    for indices in ([3, 0, 7], [], list(range(n)), [n - 1, n - 1]):
        a, b = gathered.batch(indices), loaded.batch(indices)
        for s, t in zip(a, b):
            assert s.dtype == t.dtype == torch.float32 and torch.equal(s, t)
    for a, b in zip(gathered.chunks(7), loaded.chunks(7)):
        assert all(torch.equal(s, t) for s, t in zip(a, b))
    assert all(torch.equal(s, t) for s, t in zip(gathered.full(), loaded.full()))
    samplers = [BatchSampler("poisson", n, 1, seed=2) for _ in range(2)]  # rate 1 / n
    sizes = set()
    for _ in range(40):
        a, b = gathered.draw(samplers[0]), loaded.draw(samplers[1])
        sizes.add(len(a))
        assert all(s.shape == t.shape and torch.equal(s, t) for s, t in zip(a, b))
    assert {0, 1, 2} <= sizes  # Poisson draws of varying sizes, some empty
    assert gathered.fingerprint().startswith("records ")  # bound as a Dataset's records, as before


def test_a_subset_run_releases_what_the_loader_path_releases():
    """DP-SGD on a ``random_split`` part of a ``TensorDataset``: gathered or loaded through the
    ``DataLoader``, the same batches, the same released parameters bit for bit (and, the loader's records
    bound alike, the same noise)."""
    from torch.utils.data.dataloader import default_collate

    x, y = data()
    dataset = _subsets(x, y)["split"]
    gathered = DatasetRecords(dataset)
    loaded = same_fingerprint(DatasetRecords(dataset, lambda batch: default_collate(batch)), gathered)
    runs = []
    for records in (gathered, loaded):
        alg = DPSGD(model_fn(), loss, records, lr=0.3, clip=0.5, steps=6, noise=1.0, batch_size=8,
                    runtime=RuntimeConfig(generator=gen(), sampler_seed=4))
        alg.run(progress=False)
        runs.append(alg)
    assert runs[0].binding() == runs[1].binding()
    for a, b in zip(runs[0].params, runs[1].params):
        assert torch.equal(a, b)


def test_only_plain_tensor_datasets_in_this_process_are_gathered():
    """A subclass (its ``__getitem__`` may differ), another collate, workers, or a subset index out of
    range (the loader raises it where it is read) keep the ``DataLoader``."""
    x, y = data()

    class Flipped(TensorDataset):
        def __getitem__(self, i):
            return -self.tensors[0][i], self.tensors[1][i]

    assert DatasetRecords(TensorDataset(x, y))._rows is not None
    assert DatasetRecords(Flipped(x, y))._rows is None
    assert torch.equal(DatasetRecords(Flipped(x, y)).batch([1]).inputs, -x[1:2])
    assert DatasetRecords(TensorDataset(x, y), num_workers=1)._rows is None
    assert DatasetRecords(TensorDataset(x, y, y))._rows is None
    out_of_range = torch.utils.data.Subset(TensorDataset(x, y), [*range(PROBE), 40])  # set-up reads PROBE
    records = DatasetRecords(out_of_range)
    assert records._rows is None
    with pytest.raises(IndexError):
        records.batch([PROBE])
