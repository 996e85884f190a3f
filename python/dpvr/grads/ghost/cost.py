"""The per-layer choice of how an :class:`~dpvr.grads.ghost.rules.Outer` part's norms are computed, by
predicted time under a memory budget, from the part's shapes and this machine's rates.

An Outer part (a linear map's weight applied at ``T`` steps, a convolution's after unfolding; ``B``
samples, widths ``p`` and ``q``) has three forms:

- ``"materialise"``: the ``(B, q, p)`` per-sample matrices in one batched matmul in the parameters' dtype
  (``2 B T p q`` flops at the batched float32 matmul rate); the norms and the clipped sum then read those
  matrices (memory-bound passes). It holds ``B p q`` entries until the clipped sums, plus their float64
  copy while its sum is formed, so it is refused when that exceeds what is left of the memory budget
  (:func:`direct_budget_bytes`), which bounds all the parts materialised at one parameter point together
  (the clipper charges them in the layers' order).
- ``"gram"``: the native float64 Gram form over pairs of steps (``B T (T + 1) / 2 (p + q)`` multiply-adds at
  the native kernel's rate), then the clipped sum as one float64 matmul over samples and steps
  (``2 B T p q`` flops at the float64 matmul rate). Memory: the recording only.
- ``"direct"``: the native float64 direct form, which forms one sample's ``(q, p)`` matrix at a time (the
  direct form streamed sample by sample: its memory is one matrix per thread, whatever ``B``), then the same
  float64 sum as the Gram form.
- ``"chunked"``: the direct form streamed in chunks of samples through torch's batched float64 matmul
  (``2 B T p q`` flops at the float64 matmul rate, then the squares read once), whose chunks hold at most
  :data:`~dpvr.grads.ghost.norms.SCRATCH_ENTRIES` float64 entries (128 MiB, and one temporary as large),
  whatever ``B``; then the same float64 sum. Its bound is the torch path's
  (:func:`~dpvr.grads.ghost.norms.ghost_norms`, form ``"direct"``).
- ``"gram32"`` (float32 parameters only): the Gram form from float32 blocks
  (:func:`~dpvr.grads.ghost.norms.gram32_term`): the steps cut into blocks of :data:`GRAM32_BLOCK`, each
  pair of blocks ``I <= J`` two batched float32 matmuls (``2 B T_I T_J (p + q)`` flops at the batched
  float32 matmul rate), then float64 passes over the blocks (the products summed, and the weighted sums
  that price the float32 rounding: :data:`GRAM32_ENTRY_TRAFFIC` bytes per entry at the copy rate), then
  the same float64 sum. Its value plus its a-priori rounding bound (about ``(p + q) 2^-24 (1 + T /
  sqrt(min(p, q)))`` of the squared norm where the steps are uncorrelated, more where they cancel) is an
  upper bound on the exact squared norm, as the native forms' are. Memory: chunks of samples' pairs of
  blocks, at most :data:`GRAM32_SCRATCH` bytes or what the memory budget leaves after the parts
  materialised at the point, if less, and at least one sample's largest pair of blocks
  (:data:`GRAM32_ENTRY_BYTES` per entry: 384 KiB for 128-step blocks), which the budget does not bound: it is
  freed with the part's norm, as the chunked form's one-sample float64 matrix is (never refused either).
  Refused only when the widths are too large for the bound.

Each non-materialised form then writes its clipped sum ``S = sum_i f_i u_i`` (``u_i = sum_t n_it m_it^T``)
in one of two ways (:data:`SUM_FORMS`), chosen apart from the norm form (:func:`predict_sums`), for a part
at one parameter point:

- ``"float64"``: one float64 matmul over samples and steps, the pieces widened to float64
  (``2 B T p q`` flops at the float64 matmul rate, and the widening: ``B T (p + q)`` entries read, written
  in float64 and read again, at the copy rate);
- ``"record32"`` (float32 parameters only): each record's matrix ``w_i = fl32(sum_t n_it m_it^T)`` by a
  float32 matmul over the steps that record reads (``2 B T p q`` flops at the batched float32 matmul rate;
  at most :data:`RECORD32_ENTRIES` float32 entries of its rows at a time), then ``sum_i f_i w_i`` in
  float64
  (:func:`~dpvr.grads.ghost.rules.weighted_sum64`: the factors and entries widened exactly, a column
  block at a time): :data:`RECORD32_ENTRY_TRAFFIC` bytes
  per entry of ``w_i`` at the copy rate, and two more reads of the pieces (their largest entries, which
  the rounding bound reads). Its rounding, ``gamma_K`` of the part's ``R_i`` with the float32
  unit, is priced per part by :func:`~dpvr.grads.ghost.norms.write_error`. A difference's part
  (:meth:`~dpvr.grads.ghost.rules.Outer.combine`, a rule's own difference) keeps the float64 sum: its
  ``R_i`` is relative to the two points' terms, which may nearly cancel, so ``gamma_K R_i`` could exceed
  the small difference and clip it away.

The rates come from a short micro-benchmark (:func:`calibrate`, well under a second) run once per machine
and cached as JSON under the user's cache directory (``$XDG_CACHE_HOME/dpvr`` or ``~/.cache/dpvr``), keyed
by the CPU model, torch's thread count, the torch version and the dpvr version. ``DPVR_GHOST_CALIBRATE=0``
turns calibration off: the fixed :data:`DEFAULT_RATES` are used. ``DPVR_GHOST_DIRECT_MIB`` sets the memory
budget of the materialised form (default :data:`DEFAULT_DIRECT_MIB`). Tests pin the rates
(:func:`pinned_rates`), so their choices are deterministic.

Privacy: the choice (of the norm form and of the sum form) depends on the shapes ``(B, T, p, q)``, the
dtype and the machine only, never on the values of the recorded tensors. It changes the time, not the
guarantee: the native forms return upper bounds on the exact per-sample norms that include their float64
rounding (:func:`dpvr.ops.ghost_norms`), the float32 Gram form one that includes its float32 rounding (its
price: a looser bound, so a clipped record is scaled a little further below the radius), and the clipped
sum's rounding (either sum form's) is bounded separately (:func:`~dpvr.grads.ghost.norms.write_error`);
a materialised part's norms are upper bounds on the norms of the very matrices that its clipped sum
writes (one rounding per entry, priced by the clip margin). So each record's written contribution has
norm at most the clip radius, and the release's sensitivity bound holds, whichever form is chosen. The
``"record32"`` sum computes each record's float32 matrix from that record's own inputs only, by a matmul
whose shape is the record's own (its read steps; row blocks fixed by ``p`` and ``q``), so a neighbour that
changes which steps the batch reads leaves every other record's ``w_i`` bit for bit
(:meth:`~dpvr.grads.ghost.rules.Outer._record32_total`), and its sum over records stays in float64, so
replacing one record moves the sum by at most twice the radius plus float64 roundings, as with the
``"float64"`` sum: no accountant changes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

import torch

from ... import ops

FORMS = ("materialise", "gram", "direct", "chunked", "gram32")
GRAM32_BLOCK = 128  # steps per block of the float32 Gram form
GRAM32_SCRATCH = float(1 << 26)  # bytes of scratch its blocks may use (64 MiB) unless the budget is less
GRAM32_ENTRY_BYTES = 24  # scratch per Gram entry: two float32 blocks and their float64 copies
GRAM32_ENTRY_TRAFFIC = 96.0  # bytes moved per float32 Gram entry: written, widened, read, abs, weighted
DEFAULT_DIRECT_MIB = 256.0
SUM_FORMS = ("float64", "record32")
# float32 entries of one block of a record's matrix in the "record32" sum (16 MiB): below the C library's
# threshold for mapping fresh pages, so the block's buffer is reused without page faults.
RECORD32_ENTRIES = 1 << 22
# entries of the (q, p) float64 sum formed at a time when one record's matrix fills a quarter of a block or
# more and is wider than tall (Outer._record32_by_block): 2 MiB, which stays in cache while every record's
# block is added to it.
RECORD32_SUM_BLOCK = 1 << 18
# bytes moved per entry of a record's float32 matrix: written and read (8), its float64 block written and
# read in cache (16); matches the weighted column-block sum's measured rate on a 2-core AVX-512 host.
RECORD32_ENTRY_TRAFFIC = 24.0
WIDEN_ENTRY_TRAFFIC = 16.0  # bytes per entry of a float64 sum's widened pieces beyond reading them
CALIBRATE_ENV = "DPVR_GHOST_CALIBRATE"
BUDGET_ENV = "DPVR_GHOST_DIRECT_MIB"


@dataclass(frozen=True)
class Rates:
    """A machine's rates: ``matmul32`` and ``matmul64`` flop/s of a batched float32 matmul and of a float64
    matmul; ``gram`` and ``direct`` multiply-adds per second of the native Gram and direct norm kernels (per
    pair of steps and width entry; per step and matrix entry); ``bandwidth`` bytes per second of a copy."""

    matmul32: float
    matmul64: float
    gram: float
    direct: float
    bandwidth: float


# Measured on an idle 2-core AVX-512 host (two threads); used when calibration is off.
DEFAULT_RATES = Rates(matmul32=1.0e11, matmul64=5.0e10, gram=8.0e9, direct=1.2e10, bandwidth=1.0e10)


@dataclass(frozen=True)
class Choice:
    """The form chosen for one Outer part and the predicted seconds of each form (``inf``: refused by the
    memory budget, or not applicable: the materialised form needs several steps)."""

    form: str
    seconds: dict[str, float]
    shapes: tuple[int, int, int, int]  # (B, T, p, q)
    itemsize: int = 4  # bytes per entry of the recorded tensors (what a materialised matrix holds)
    # the clipped sum's form of a non-materialised part (SUM_FORMS; "materialised" for that form) and the
    # predicted seconds of each sum form
    sum_form: str = "float64"
    sum_seconds: dict[str, float] = field(default_factory=dict)


def direct_budget_bytes() -> float:
    """The memory the materialised form may take (``DPVR_GHOST_DIRECT_MIB``, default 256 MiB)."""
    raw = os.environ.get(BUDGET_ENV)
    if raw is None:
        return DEFAULT_DIRECT_MIB * 2**20
    try:
        mib = float(raw)
    except ValueError:
        raise ValueError(f"{BUDGET_ENV}: expected a number of MiB, got {raw!r}") from None
    if not mib >= 0:
        raise ValueError(f"{BUDGET_ENV}: must be >= 0 MiB, got {raw!r}")
    return mib * 2**20


def predict(batch: int, steps: int, p: int, q: int, itemsize: int, rates: Rates,
            budget: float, *, difference: bool = False) -> dict[str, float]:
    """Predicted seconds of each form for an Outer part of these shapes (see the module docstring); the
    non-materialised forms pay the clipped sum's form that :func:`choose` takes (``difference``: a
    difference's part, whose sum is always ``"float64"``)."""
    b, t = float(batch), float(steps)
    entries = b * p * q
    sums = predict_sums(batch, steps, p, q, itemsize, rates)
    float64_sum = sums["float64" if difference else _sum_form(sums)]
    materialise = float("inf")
    if steps > 1 and entries * (itemsize + 8) <= budget:
        # the batched matmul; then write the matrices, read them for the norms, widen them for the sum
        materialise = (2.0 * b * t * p * q / rates.matmul32
                       + entries * (3 * itemsize + 8) / rates.bandwidth)
    gram = b * t * (t + 1) / 2.0 * (p + q) / rates.gram + float64_sum
    direct = b * t * p * q / rates.direct + float64_sum
    chunked = float("inf")
    if steps > 1:  # the matrices in float64, then their squares summed: a write and two reads
        chunked = 2.0 * b * t * p * q / rates.matmul64 + entries * 24.0 / rates.bandwidth + float64_sum
    gram32 = float("inf")
    if itemsize == 4 and gram32_fits(steps, p, q):
        blocks = gram32_blocks([steps])
        pairs = (sum(blocks) ** 2 + sum(k * k for k in blocks)) / 2.0  # Gram entries of the pairs I <= J
        # the float32 blocks of both sides and their float64 passes; each pair reads its blocks' inputs
        traffic = b * pairs * GRAM32_ENTRY_TRAFFIC + 4.0 * b * t * (p + q) * (len(blocks) + 1)
        gram32 = 2.0 * b * pairs * (p + q) / rates.matmul32 + traffic / rates.bandwidth + float64_sum
    return {"materialise": materialise, "gram": gram, "direct": direct, "chunked": chunked, "gram32": gram32}


def predict_sums(batch: int, steps: int, p: int, q: int, itemsize: int, rates: Rates) -> dict[str, float]:
    """Predicted seconds of each clipped-sum form (:data:`SUM_FORMS`) of a non-materialised Outer part of
    these shapes (see the module docstring); ``inf``: not applicable (float64 pieces)."""
    b, t = float(batch), float(steps)
    flops = 2.0 * b * t * p * q
    widen = b * t * (p + q) * (itemsize + WIDEN_ENTRY_TRAFFIC) if itemsize != 8 else 0.0
    float64 = flops / rates.matmul64 + widen / rates.bandwidth
    record32 = float("inf")
    # (the float32 rounding bound needs K u < 1/2: far more steps than any layer has)
    if itemsize == 4 and steps * 2.0 ** -24 < 0.25:
        # ... and the pieces read twice more for their largest entries (the rounding bound's underflow term)
        traffic = b * p * q * RECORD32_ENTRY_TRAFFIC + 2.0 * b * t * (p + q) * itemsize
        record32 = flops / rates.matmul32 + traffic / rates.bandwidth
    return {"float64": float64, "record32": record32}


def gram32_fits(steps: int, p: int, q: int) -> bool:
    """Whether the float32 Gram form can run for these shapes: its rounding bound exists (``k u < 1/2`` for
    the widths and the float64 sums, :func:`~dpvr.grads.ghost.norms.gram32_term`)."""
    return max(p, q) * 2.0 ** -24 < 0.5 and (2.0 * steps * steps + 8.0) * 2.0 ** -53 < 0.5


def gram32_blocks(steps: list[int]) -> list[int]:
    """The step blocks of the float32 Gram form: each piece's steps cut into runs of at most
    :data:`GRAM32_BLOCK` (as :func:`~dpvr.grads.ghost.norms.gram32_term` cuts them)."""
    return [min(GRAM32_BLOCK, t - s) for t in steps for s in range(0, t, GRAM32_BLOCK)]


def gram32_scratch(budget: float) -> float:
    """The scratch the float32 Gram form's blocks may use under ``budget`` bytes (at most 64 MiB; none when
    the budget is spent: :func:`~dpvr.grads.ghost.norms.gram32_term` then takes one sample at a time)."""
    return max(min(float(budget), GRAM32_SCRATCH), 0.0)


def choose(batch: int, steps: int, p: int, q: int, itemsize: int, rates: Rates | None = None,
           budget: float | None = None, *, difference: bool = False) -> Choice:
    """The fastest form of an Outer part with these shapes (ties: the first of :data:`FORMS`) and its
    clipped sum's form; ``difference``: a difference's part (two points' pieces), whose sum is always
    ``"float64"`` (its ``R_i`` is relative to the two points, see
    :meth:`~dpvr.grads.ghost.rules.Outer.combine`)."""
    rates = machine_rates() if rates is None else rates
    budget = direct_budget_bytes() if budget is None else budget
    seconds = predict(batch, steps, p, q, itemsize, rates, budget, difference=difference)
    form = min(FORMS, key=lambda f: seconds[f])
    sums = predict_sums(batch, steps, p, q, itemsize, rates)
    sum_form = "materialised" if form == "materialise" else "float64" if difference else _sum_form(sums)
    return Choice(form, seconds, (batch, steps, p, q), itemsize, sum_form, sums)


def choose_sum(batch: int, steps: int, p: int, q: int, itemsize: int, rates: Rates | None = None) -> str:
    """The fastest clipped-sum form (:data:`SUM_FORMS`) of a non-materialised Outer part with these shapes
    (ties: ``"float64"``), from shapes, dtype and rates only."""
    rates = machine_rates() if rates is None else rates
    return _sum_form(predict_sums(batch, steps, p, q, itemsize, rates))


def _sum_form(sums: dict[str, float]) -> str:
    if _forced_sums:
        return _forced_sums[-1] if sums[_forced_sums[-1]] < float("inf") else "float64"
    return min(SUM_FORMS, key=lambda f: sums[f])


_forced_sums: list[str] = []


@contextlib.contextmanager
def forced_sums(form: str) -> Iterator[None]:
    """Within the block, every non-materialised part's clipped sum at one point takes ``form``
    (:data:`SUM_FORMS`) where it applies (``"record32"`` needs float32 pieces; elsewhere ``"float64"``),
    whatever the rates predict: tests and same-run comparisons of the two."""
    if form not in SUM_FORMS:
        raise ValueError(f"form: must be one of {SUM_FORMS}, got {form!r}")
    _forced_sums.append(form)
    try:
        yield
    finally:
        _forced_sums.pop()


# ---- calibration ----

@functools.lru_cache(maxsize=1)
def _fixed_key() -> tuple[str, str]:
    """The CPU model and the dpvr version, read once per process (every layer's choice asks for the key)."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return model, metadata.version("dpvr")


def machine_key() -> str:
    """What the rates depend on: the CPU model, torch's thread count, the torch and dpvr versions."""
    model, version = _fixed_key()
    return f"{model}|threads={torch.get_num_threads()}|torch={torch.__version__}|dpvr={version}"


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dpvr" / "ghost_rates.json"


def _best(fn, rounds: int = 7) -> float:
    fn()  # warm-up: allocations, the thread pool's start, the kernels' first dispatch
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


_PROBE_SHAPE = (16, 64, 96, 96)  # (B, T, p, q) of the micro-benchmark


def _probe_pieces() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    b, t, p, q = _PROBE_SHAPE
    return torch.randn(b, t, p, generator=g), torch.randn(b, t, q, generator=g)


def _matmul32_rate(m: torch.Tensor, n: torch.Tensor) -> float:
    """Flop/s of the batched float32 matmul that forms per-sample matrices, on ``(B, T, p)`` and
    ``(B, T, q)`` pieces (about a millisecond on the probe's shapes)."""
    (b, t, p), q = m.shape, n.shape[-1]
    return 2.0 * b * t * p * q / _best(lambda: torch.bmm(n.transpose(1, 2), m))


def calibrate() -> Rates:
    """Measures this machine's rates on small shapes of the kinds the forms run (about half a second)."""
    m, n = _probe_pieces()
    b, t, p, q = _PROBE_SHAPE
    matmul32 = _matmul32_rate(m, n)
    m64, n64 = m.reshape(-1, p).double(), n.reshape(-1, q).double()
    matmul64 = 2.0 * b * t * p * q / _best(lambda: n64.t() @ m64)
    out = torch.empty(b, dtype=torch.float64)
    pairs = b * t * (t + 1) / 2.0 * (p + q)
    gram = pairs / _best(lambda: ops.ghost_norms(out, outer=[[(m, n)]], form="gram"))
    direct = b * t * p * q / _best(lambda: ops.ghost_norms(out, outer=[[(m, n)]], form="direct"))
    big = torch.empty(1 << 23)  # 32 MiB: beyond the caches of most hosts
    dst = torch.empty_like(big)
    bandwidth = 2.0 * big.numel() * big.element_size() / _best(lambda: dst.copy_(big))
    return Rates(matmul32, matmul64, gram, direct, bandwidth)


_pinned: list[Rates] = []
_measured: dict[str, Rates] = {}


@contextlib.contextmanager
def pinned_rates(rates: Rates) -> Iterator[None]:
    """Within the block, every choice uses ``rates`` (tests: deterministic choices)."""
    _pinned.append(rates)
    try:
        yield
    finally:
        _pinned.pop()


# A cached matmul rate this far below a fresh probe's was measured on a busy machine.
STALE_RATIO = 1.25


def _valid_rates(entry: object) -> Rates | None:
    """The rates of a cache entry, or None where it is missing, incomplete or not positive and finite."""
    try:
        rates = Rates(**{f: float(entry[f]) for f in Rates.__dataclass_fields__})  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        return None
    return rates if all(0 < v < float("inf") for v in asdict(rates).values()) else None


def machine_rates() -> Rates:
    """The rates choices use: pinned ones, else :data:`DEFAULT_RATES` when ``DPVR_GHOST_CALIBRATE=0``, else
    this machine's, from the cache file or measured once and written there (a cache that cannot be read or
    written is measured again, never an error).

    A process's first call probes the batched float32 matmul (about a millisecond); a cached rate more than
    :data:`STALE_RATIO` below the probe's was measured while other work shared the cores (the first
    calibration often runs inside a parallel test run, or beside a training job), and would have steered
    every later process's choices by it: the machine is measured again and each rate kept at the higher of
    its two measurements, so the cache only improves and a busy moment never degrades it. Why: a cache
    measured under a test run's two workers rated every form about 1.6x slow, and the ResNet's DP-SGD step
    took 1.51 s against 1.34-1.37 s with a quiet measurement."""
    if _pinned:
        return _pinned[-1]
    if os.environ.get(CALIBRATE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return DEFAULT_RATES
    key = machine_key()
    if key in _measured:
        return _measured[key]
    path = cache_path()
    stored: dict = {}
    with contextlib.suppress(OSError, ValueError):
        stored = json.loads(path.read_text(encoding="utf-8"))
    stored = stored if isinstance(stored, dict) else {}
    cached = _valid_rates(stored.get(key))
    if cached is not None and _matmul32_rate(*_probe_pieces()) <= STALE_RATIO * cached.matmul32:
        rates = cached
    else:  # none cached, or measured on a busy machine
        rates = calibrate()
        if cached is not None:
            best = {f: max(getattr(rates, f), getattr(cached, f)) for f in Rates.__dataclass_fields__}
            rates = Rates(**best)
        stored[key] = asdict(rates)
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(stored, indent=1, sort_keys=True), encoding="utf-8")
            os.replace(tmp, path)  # atomic: concurrent processes never read half a file
    _measured[key] = rates
    return rates
