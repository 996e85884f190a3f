"""Counter-based Gaussian noise: a seed, named streams, and per-stream step counters.

Every noise draw is addressed by (seed, stream, step, element) through Philox-4x32-10, so the CPU and CUDA
backends produce the same numbers, independent noise sources never share randomness, and a run can be resumed
exactly from the generator's state.

What "the same numbers" means: both backends draw identical Philox words and apply one Box-Muller transform
in double to 53-bit uniforms, written with fdlibm's polynomial log, sin and cos in correctly rounded IEEE
operations that neither compiler fuses; so float64 noise is bit for bit the same on the CPU and on CUDA
(within 3 ulp of the math library's log, sin and cos, whose implementations differ between the two), and
float32 noise is the float64 noise rounded. The polynomial form also lets the CPU loop vectorise (the library
calls cost 80 % of the generator's time); the privacy analysis (a Gaussian of the stated scale) is unchanged.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

_MAX_STREAMS = 2**32
_MAX_STEPS = 2**32


class PredictableNoiseError(ValueError):
    """A fixed seed was given without ``reproducible=True``: anyone who knows the seed can subtract the noise
    and void the privacy guarantee, so it is refused unless the caller opts in."""


@dataclass(frozen=True)
class NoiseKey:
    """Address of one noise draw: the generator's seed, a stream id and the step within that stream."""

    seed: int
    stream: int
    step: int


class NoiseGenerator:
    """Source of Gaussian noise for DP mechanisms.

    Args:
        seed: 64-bit key. ``None`` (the default) draws it from the operating system's CSPRNG, which is what
            a private run needs. A fixed seed makes the noise reproducible *and predictable*.
        reproducible: must be ``True`` to use a fixed seed (tests, debugging, experiments that must be
            replayed); a fixed seed without it raises :class:`PredictableNoiseError`.

    Privacy note: the generator's state contains the seed. A checkpoint holding it must be protected like the
    training data, since the seed lets anyone regenerate and remove the noise.

    Binding (what the algorithms use): after :meth:`bind` with a run's context (a digest of every setting
    that shapes its releases), each key's seed is ``H(seed, context, release, inputs)``: ``release`` names the
    release being made (:meth:`for_release`: the run, segment and sequence number of its ledger entry, which
    never repeat within a run, across every resume), and ``inputs`` is a digest of the signal the noise is
    added to (:func:`dpvr.ops.noisy_update` computes it for host arrays). Two releases of a run never share
    a noise draw, on any device; on the host they would not even if a ledger were lost, unless their
    signals were bit-identical (their difference is then a function of earlier releases).
    """

    def __init__(self, seed: int | None = None, *, reproducible: bool = False) -> None:
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        else:
            if not isinstance(seed, int) or not 0 <= seed < 2**64:
                raise ValueError(f"seed: must be an integer in [0, 2**64), got {seed!r}")
            if not reproducible:
                raise PredictableNoiseError(
                    "seed: a fixed seed makes the privacy noise predictable to anyone who knows it; pass "
                    "reproducible=True to opt into reproducible noise, or no seed for private noise"
                )
        self._seed = seed
        self.reproducible = reproducible
        self._streams: dict[str, list[int]] = {}  # name -> [stream id, next step]
        self._context: bytes | None = None
        self._release: bytes = b""

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def bound(self) -> bool:
        """Whether keys depend on a run's context and each release's inputs (see :meth:`bind`)."""
        return self._context is not None

    def bind(self, context: bytes) -> None:
        """Derive every later key from ``context`` and the release's inputs (see the class documentation)."""
        if not isinstance(context, bytes) or not context:
            raise ValueError("context: must be non-empty bytes")
        self._context = context

    def for_release(self, release: bytes) -> None:
        """Derive the keys of the release about to be made from ``release`` too (see the class
        documentation); it names that release for as long as the next one has not been named."""
        if not isinstance(release, bytes) or not release:
            raise ValueError("release: must be non-empty bytes")
        self._release = release

    @property
    def release(self) -> bytes:
        """The name of the release being made (empty before :meth:`for_release`)."""
        return self._release

    def stream_id(self, name: str) -> int:
        """The id of stream ``name``; ids are assigned in order of first use."""
        if name not in self._streams:
            if len(self._streams) >= _MAX_STREAMS:
                raise RuntimeError("NoiseGenerator: too many streams")
            self._streams[name] = [len(self._streams), 0]
        return self._streams[name][0]

    def next_key(self, name: str, inputs: bytes = b"") -> NoiseKey:
        """Reserves the next draw of stream ``name`` and returns its address; on a bound generator the key's
        seed also depends on the context and on ``inputs``, the digest of what the draw is added to."""
        self.stream_id(name)
        entry = self._streams[name]
        if entry[1] >= _MAX_STEPS:
            raise RuntimeError(f"NoiseGenerator: stream '{name}' has used all {_MAX_STEPS} steps")
        seed = self._seed
        if self._context is not None:
            digest = hashlib.blake2b(digest_size=8)
            for part in (seed.to_bytes(8, "little"), self._context, self._release, inputs):
                digest.update(len(part).to_bytes(8, "little"))
                digest.update(part)
            seed = int.from_bytes(digest.digest(), "little")
        key = NoiseKey(seed, entry[0], entry[1])
        entry[1] += 1
        return key

    def steps(self, name: str) -> int:
        """How many draws stream ``name`` has made."""
        return self._streams.get(name, [0, 0])[1]

    def state_dict(self) -> dict[str, Any]:
        """Seed and step counters. The binding context is not kept: the algorithm that loads the state
        binds it again with its own context."""
        return {
            "seed": self._seed,
            "reproducible": self.reproducible,
            "streams": {k: list(v) for k, v in self._streams.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            seed = int(state["seed"])
            reproducible = bool(state.get("reproducible", False))
            streams = {str(k): [int(v[0]), int(v[1])] for k, v in state["streams"].items()}
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise ValueError(f"state: not a NoiseGenerator state ({err})") from None
        ids = sorted(v[0] for v in streams.values())
        if not 0 <= seed < 2**64 or ids != list(range(len(ids))) or any(v[1] < 0 for v in streams.values()):
            raise ValueError("state: corrupt NoiseGenerator state (seed range, stream ids or step counters)")
        self._seed, self._streams, self.reproducible = seed, streams, reproducible

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> NoiseGenerator:
        gen = cls.__new__(cls)
        gen._seed, gen._streams, gen._context, gen._release, gen.reproducible = 0, {}, None, b"", False
        gen.load_state_dict(state)
        return gen
