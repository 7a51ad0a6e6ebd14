"""The global random generators (``random``, ``numpy``, ``torch``): saving, restoring,
comparing and seeding them, for sources that seed reads per unit and for inline reads that
must not disturb the caller's draws; and the generators a dataset holds of its own
(:func:`is_generator`), seeded per unit from their state at ``iter()`` (:func:`seed_held`).

A dataset's own generator (``self.rng = np.random.default_rng(0)`` in ``__init__``) goes on, in
each of torch's worker processes, from its state at ``iter()`` through the batches that worker
reads; torch hands worker ``j`` batches ``j, j + w, ...``, so the draws are the same run to run.
Workers that take units as they free up, in numbers a tuner moves, would draw them in an order
that changes run to run. So where a source seeds its units (``seed_each_batch``), a read sets
each generator the dataset holds (itself, or through a dataset or a plain object such as its
transform: :mod:`~torchtune_pipe.sources.views`) to a state drawn from its state at ``iter()``,
the epoch and the unit's place in it before it reads (:func:`seed_held`): the same batches run
to run whatever the worker count, the scheduling or a resume, as torch's are, decided by the
seed the user gave the generator (not by torch's), different from batch to batch and from epoch
to epoch. Torch's own values differ (its non-persistent workers draw the same numbers every
epoch, and each worker's first batch the same as every other's).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import ctypes
import hashlib
import pickle
import random
import sys
from collections.abc import Iterator
from typing import Any

from torchtune_pipe.errors import StateError


def rng_states() -> tuple:
    """The global generators' states (``random``, ``numpy``, ``torch``), as
    :func:`same_rng_states` compares them."""
    import numpy as np
    import torch

    return random.getstate(), np.random.get_state(), torch.get_rng_state()


@contextlib.contextmanager
def isolated_rng() -> Iterator[None]:
    """The global generators as they were on entry, put back on exit: reads in the caller's
    thread seeded as a worker's leave the caller's own draws alone. Around every unit read
    inline: numpy's generator is saved and put back by :class:`_LegacyGlobal` (a few
    microseconds, where ``get_state``/``set_state`` take 70)."""
    import torch

    saved = random.getstate(), _NUMPY.save(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(saved[0])
        _NUMPY.restore(saved[1])
        torch.set_rng_state(saved[2])


class _LegacyGlobal:
    """numpy's global generator (the ``RandomState`` behind ``np.random.*``), saved and put
    back exactly: its Mersenne Twister state copied as bytes, and the gaussian it may hold
    from an odd count of legacy normal draws. ``get_state`` and ``set_state`` copy the 624
    words one by one in Python (~35 us each way); this copies them at once.

    The cached gaussian is not readable apart from ``get_state``; a draw reveals it: a
    ``standard_normal()`` that leaves the twister unchanged returned the cached value, one that
    changes it drew a pair (the second is taken too, and the twister put back). A bit
    generator other than an ``MT19937``, or one whose state is not laid out as checked once
    (the key then the position, as ``MT19937.state`` gives them), takes the slow way."""

    _BYTES = 624 * 4 + 4  # uint32 key[624]; int pos

    def __init__(self) -> None:
        self._bits: Any = None  # the bit generator whose state address was checked
        self._address: int | None = None

    def _state_address(self, r: Any) -> int | None:
        bits = r._bit_generator
        if bits is self._bits:
            return self._address
        import numpy as np

        address = None
        if type(bits) is np.random.MT19937:
            got = bits.state["state"]
            want = np.ascontiguousarray(got["key"], dtype=np.uint32).tobytes()
            want += int(got["pos"]).to_bytes(4, sys.byteorder, signed=True)
            at = bits.ctypes.state_address
            if ctypes.string_at(at, self._BYTES) == want:
                address = at
        self._bits, self._address = bits, address
        return address

    def save(self) -> tuple:
        import numpy as np

        r = np.random.mtrand._rand
        at = self._state_address(r)
        if at is None:
            return ("state", r.get_state())
        twister = ctypes.string_at(at, self._BYTES)
        cached = r.standard_normal()
        if ctypes.string_at(at, self._BYTES) == twister:
            return (twister, cached)  # it held ``cached``: taken
        r.standard_normal()  # it held none and drew a pair: take the second, undo the draw
        ctypes.memmove(at, twister, self._BYTES)
        return (twister, None)

    def restore(self, saved: tuple) -> None:
        import numpy as np

        r = np.random.mtrand._rand
        twister, cached = saved
        if isinstance(twister, str):
            r.set_state(cached)
            return
        at = self._state_address(r)
        if at is not None:
            ctypes.memmove(at, twister, self._BYTES)
            r.standard_normal()  # a gaussian the read left cached is taken...
            if ctypes.string_at(at, self._BYTES) != twister:  # ...or a pair was drawn
                r.standard_normal()
                ctypes.memmove(at, twister, self._BYTES)
            if cached is None:
                return
        # A cached gaussian to give back (or a bit generator the read replaced): all of it.
        key = np.frombuffer(twister, dtype=np.uint32, count=624).copy()
        pos = int.from_bytes(twister[-4:], sys.byteorder, signed=True)
        gauss = (1, float(cached)) if cached is not None else (0, 0.0)
        r.set_state(("MT19937", key, pos, *gauss))


_NUMPY = _LegacyGlobal()


def same_rng_states(a: tuple, b: tuple) -> bool:
    """Whether two :func:`rng_states` are the same states."""
    import numpy as np
    import torch

    np_a, np_b = a[1], b[1]  # (name, keys array, position, has_gauss, cached_gaussian)
    return (
        a[0] == b[0]
        and np.array_equal(np_a[1], np_b[1])
        and np_a[2:] == np_b[2:]
        and torch.equal(a[2], b[2])
    )


def seed_all(seed: int, numpy_seed: Any = None) -> None:
    """Seed the three generators with ``seed`` (numpy's with its low 32 bits, or with
    ``numpy_seed`` where given).

    torch's CPU generator is seeded, MPS's where it exists, and CUDA's (XPU's, MTIA's) where
    this process has initialised it. ``torch.manual_seed`` would also queue a seed for every
    accelerator not yet initialised, and queuing records the caller's stack
    (``traceback.format_stack``): 0.1-0.5 ms a call, which a source paid for every unit it
    read (a sixth of a worker's time on cheap rows)."""
    import numpy as np
    import torch

    random.seed(seed)
    torch.default_generator.manual_seed(seed)
    torch.mps.manual_seed(seed)  # seeds at once where MPS exists, nothing elsewhere
    for name in ("cuda", "xpu", "mtia"):
        device = getattr(torch, name, None)
        if device is not None and device.is_initialized():
            device.manual_seed_all(seed)
    np.random.seed(seed % (1 << 32) if numpy_seed is None else numpy_seed)


def seed_as_torch_worker(base_seed: int, index: int) -> None:
    """Seed the three generators as torch seeds its worker ``index`` of an epoch whose base
    seed is ``base_seed``: ``random`` and ``torch`` with ``base_seed + index``, ``numpy``
    from torch's ``_generate_state(base_seed, index)``."""
    from torch.utils.data._utils.worker import _generate_state

    seed_all(base_seed + index, _generate_state(base_seed, index))


def draw_seed(generator: Any = None, peek: bool = False) -> int:
    """The base seed torch's ``DataLoader`` iterator draws: one int64 from ``generator`` (None:
    the global generator). ``peek``: read from a copy, the generator left as it is."""
    import torch

    if peek:
        copy = torch.Generator()
        copy.set_state(torch.get_rng_state() if generator is None else generator.get_state())
        generator = copy
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def rng_state_text(state: Any) -> str:
    """A torch generator's state (a uint8 tensor) as base64 text: plain data for a saved
    loader state."""
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def rng_state_from_text(value: Any, field: str) -> Any:
    """A torch generator's state from :func:`rng_state_text` (or the uint8 tensor itself), as
    ``torch.set_rng_state`` takes it.

    Raises:
        StateError: ``value`` is neither, or not of a CPU generator state's size; the message
            names ``field``.
    """
    import torch

    size = torch.get_rng_state().numel()  # every CPU generator's state has this size
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value.encode("ascii"), validate=True)
        except ValueError:
            raw = b""
        value = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else None
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.numel() != size:
        raise StateError(
            f"Loader: {field} is not a generator state of {size} bytes (base64 text from "
            "Loader.state_dict()); load a state saved by this loader"
        )
    return value


def is_generator(value: Any) -> bool:
    """Whether ``value`` is a random generator of its own: ``random.Random``,
    ``numpy.random.Generator`` or ``RandomState``, ``torch.Generator`` (a CPU one)."""
    import numpy as np
    import torch

    if isinstance(value, torch.Generator):
        return value.device.type == "cpu"
    return isinstance(value, (random.Random, np.random.Generator, np.random.RandomState))


def copied_generator(value: Any) -> Any:
    """A generator of the same kind and state as ``value``, drawing apart from it."""
    import torch

    if isinstance(value, torch.Generator):
        out = torch.Generator(device=value.device)
        out.set_state(value.get_state())
        return out
    return copy.deepcopy(value)


def generator_digest(value: Any) -> bytes:
    """A digest of a generator's state (:func:`is_generator`), the same in every process."""
    import numpy as np
    import torch

    if isinstance(value, torch.Generator):
        raw = value.get_state().numpy().tobytes()
    elif isinstance(value, np.random.Generator):
        raw = pickle.dumps(value.bit_generator.state, protocol=4)
    elif isinstance(value, np.random.RandomState):
        raw = pickle.dumps(value.get_state(), protocol=4)
    else:
        raw = pickle.dumps(value.getstate(), protocol=4)
    return hashlib.blake2b(type(value).__name__.encode() + raw, digest_size=16).digest()


def seed_held(held: list[tuple[Any, bytes]], epoch: int, unit: int) -> None:
    """Set each generator of ``held`` (a generator and the :func:`generator_digest` of its
    state at ``iter()``) to a state drawn from that digest, the ``epoch`` and the ``unit``'s
    place in it (module docstring)."""
    if not held:
        return
    import numpy as np
    import torch

    salt = int(epoch).to_bytes(8, "little", signed=True) + int(unit).to_bytes(8, "little")
    for gen, digest in held:
        n = int.from_bytes(hashlib.blake2b(digest + salt, digest_size=16).digest(), "little")
        if isinstance(gen, torch.Generator):
            gen.manual_seed(n & ((1 << 63) - 1))
        elif isinstance(gen, np.random.Generator):
            bits = gen.bit_generator
            try:
                bits.state = type(bits)(np.random.SeedSequence(n)).state
            except (TypeError, ValueError):  # a bit generator of the user's: its own seeding
                continue
        elif isinstance(gen, np.random.RandomState):
            gen.seed(np.random.SeedSequence(n).generate_state(4))
        else:
            gen.seed(n)
