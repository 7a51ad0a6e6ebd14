"""Tensors and arrays as views of larger buffers, described by picklable *recipes*.

A hypothesis strategy draws a recipe (plain tuples: a base buffer and the view operations
applied to it) while building the view, so the same view can be rebuilt anywhere: in the test
process to compare against, and inside a worker process, where the stage emits it as a real
view (nonzero storage offset, steps, transposes, expands, overlaps) into the transport.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st
from tensordict import TensorDict

TORCH_DTYPES = (
    "bool",
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
NUMPY_DTYPES = (
    "bool",
    "uint8",
    "int16",
    "int32",
    "int64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)


@dataclass
class Pair:
    """A user's dataclass carrying payloads."""

    left: Any
    right: Any


def _torch_base(dtype: str, n: int) -> torch.Tensor:
    # Distinct values per position (within each dtype's precision), so a shifted view differs.
    i = torch.arange(n, dtype=torch.int64)
    if dtype == "bool":
        return i % 3 == 1
    if dtype.startswith("complex"):
        return (i.double() + 1j * (-i.double())).to(getattr(torch, dtype))
    if dtype in ("uint8", "int8"):
        return (i % 127).to(getattr(torch, dtype))
    return (i + 1).to(getattr(torch, dtype))


def _numpy_base(dtype: str, n: int) -> np.ndarray:
    i = np.arange(n, dtype=np.int64)
    if dtype == "bool":
        return i % 3 == 1
    if dtype.startswith("complex"):
        return (i + 1j * -i).astype(dtype)
    if dtype == "uint8":
        return (i % 251).astype(dtype)
    if dtype == "float16":
        return (i % 2048 + 1).astype(dtype)  # exact in float16, no overflow to inf
    return (i + 1).astype(dtype)


def _apply_torch(t: torch.Tensor, op: tuple) -> torch.Tensor:
    kind = op[0]
    if kind == "slice":
        _, d, lo, hi, step = op
        return t[(slice(None),) * d + (slice(lo, hi, step),)]
    if kind == "select":
        return t.select(op[1], op[2])
    if kind == "transpose":
        return t.transpose(op[1], op[2])
    if kind == "expand":
        _, d, k = op
        u = t.unsqueeze(d)
        shape = list(u.shape)
        shape[d] = k
        return u.expand(shape)
    if kind == "unfold":  # overlapping windows: several elements share one storage slot
        return t.unfold(op[1], op[2], op[3])
    if kind == "conj":
        return t.conj()
    raise ValueError(op)


def _apply_numpy(a: np.ndarray, op: tuple) -> np.ndarray:
    kind = op[0]
    if kind == "slice":
        _, d, lo, hi, step = op
        return a[(slice(None),) * d + (slice(lo, hi, step),)]
    if kind == "select":
        return a[(slice(None),) * op[1] + (op[2], ...)]  # basic indexing: a view
    if kind == "transpose":
        return np.swapaxes(a, op[1], op[2])
    if kind == "expand":
        _, d, k = op
        u = np.expand_dims(a, d)
        shape = list(u.shape)
        shape[d] = k
        return np.broadcast_to(u, shape)
    if kind == "window":
        return np.lib.stride_tricks.sliding_window_view(a, op[2], axis=op[1])
    raise ValueError(op)


def build(recipe: tuple) -> Any:
    """The object a recipe describes (views are rebuilt from a fresh base each time)."""
    kind = recipe[0]
    if kind in ("torch", "numpy"):
        _, dtype, pad, shape, ops = recipe
        n = math.prod(shape)
        make, apply = (
            (_torch_base, _apply_torch) if kind == "torch" else (_numpy_base, _apply_numpy)
        )
        view = make(dtype, pad + n + 7)[pad : pad + n].reshape(shape)
        for op in ops:
            view = apply(view, op)
        return view
    if kind == "tuple":
        return tuple(build(r) for r in recipe[1])
    if kind == "list":
        return [build(r) for r in recipe[1]]
    if kind == "dict":
        return {k: build(r) for k, r in recipe[1]}
    if kind == "pair":
        return Pair(build(recipe[1]), build(recipe[2]))
    if kind == "td":
        return TensorDict({k: build(r) for k, r in recipe[1]}, batch_size=[])
    if kind == "leaf":
        return recipe[1]
    raise ValueError(recipe)


def assert_equal(got: Any, want: Any, path: str = "x") -> None:
    """Same types, dtypes, shapes and values, all the way down."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: {type(got).__name__}, not a tensor"
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert torch.equal(got.resolve_conj(), want.resolve_conj()), (
            f"{path}: values differ\n got  {got.flatten()[:8].tolist()}\n want "
            f"{want.flatten()[:8].tolist()}"
        )
    elif isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), f"{path}: {type(got).__name__}, not an ndarray"
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        assert np.array_equal(got, want), f"{path}: values differ"
    elif isinstance(want, TensorDict):
        assert isinstance(got, TensorDict), f"{path}: {type(got).__name__}, not a TensorDict"
        assert set(got.keys()) == set(want.keys()), f"{path}: keys differ"
        for k in want.keys():
            assert_equal(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, dict):
        assert type(got) is type(want) and list(got) == list(want), f"{path}: keys differ"
        for k in want:
            assert_equal(got[k], want[k], f"{path}[{k!r}]")
    elif isinstance(want, list | tuple):
        assert type(got) is type(want) and len(got) == len(want), f"{path}: length differs"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_equal(g, w, f"{path}[{i}]")
    elif is_dataclass(want):
        assert type(got) is type(want), f"{path}: {type(got).__name__}"
        for f in fields(want):
            assert_equal(getattr(got, f.name), getattr(want, f.name), f"{path}.{f.name}")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


# -- strategies --------------------------------------------------------------------------


def _shape(draw, max_elems: int) -> list[int]:
    ndim = draw(st.integers(1, 3))
    if ndim == 1:
        return [draw(st.integers(0, max_elems))]
    side = int(round(max_elems ** (1 / ndim)))
    return [draw(st.integers(0, side)) for _ in range(ndim)]


def _view_op(draw, shape: list[int], lib: str, complex_: bool) -> tuple | None:
    """One view operation valid for ``shape`` (None: nothing applies)."""
    ndim = len(shape)
    kinds = ["expand"]
    if ndim:
        kinds += ["slice", "slice", "transpose"]
        if any(shape):
            kinds.append("select")
        kinds.append("unfold" if lib == "torch" else "window")
    if complex_ and lib == "torch":
        kinds.append("conj")
    kind = draw(st.sampled_from(kinds))
    if kind == "slice":
        d = draw(st.integers(0, ndim - 1))
        size = shape[d]
        lo = draw(st.integers(0, size))
        hi = draw(st.integers(lo, size))
        # numpy views may walk backwards (negative strides); torch has no negative steps.
        step = draw(st.sampled_from([1, 1, 2, 3, 7] + ([-1, -2] if lib == "numpy" else [])))
        if step < 0:
            lo, hi = (hi - 1 if hi > 0 else None), (lo - 1 if lo > 0 else None)
        return ("slice", d, lo, hi, step)
    if kind == "select":
        d = draw(st.sampled_from([i for i, s in enumerate(shape) if s > 0]))
        return ("select", d, draw(st.integers(0, shape[d] - 1)))
    if kind == "transpose":
        return ("transpose", draw(st.integers(0, ndim - 1)), draw(st.integers(0, ndim - 1)))
    if kind == "expand":
        if ndim >= 4:
            return None
        return ("expand", draw(st.integers(0, ndim)), draw(st.integers(1, 4)))
    if kind in ("unfold", "window"):
        d = draw(st.integers(0, ndim - 1))
        if shape[d] == 0:
            return None
        size = draw(st.integers(1, shape[d]))
        return (kind, d, size, draw(st.integers(1, 3))) if kind == "unfold" else (kind, d, size)
    return ("conj",)


@st.composite
def array_views(draw, lib: str = "torch", max_elems: int = 4096, max_pad: int = 100_000):
    """A recipe for a tensor (``lib="torch"``) or an ndarray view of a larger buffer."""
    dtypes = TORCH_DTYPES if lib == "torch" else NUMPY_DTYPES
    dtype = draw(st.sampled_from(dtypes))
    pad = draw(st.one_of(st.integers(0, 64), st.integers(0, max_pad)))
    shape = _shape(draw, max_elems)
    ops: list[tuple] = []
    view = build((lib, dtype, pad, shape, ()))
    for _ in range(draw(st.integers(0, 4))):
        op = _view_op(draw, list(view.shape), lib, dtype.startswith("complex"))
        if op is None:
            continue
        nxt = (_apply_torch if lib == "torch" else _apply_numpy)(view, op)
        if (nxt.numel() if lib == "torch" else nxt.size) > 20 * max_elems:
            continue  # expands and windows of windows: keep examples small
        ops.append(op)
        view = nxt
    return (lib, dtype, pad, shape, tuple(ops))


_KEYS = st.text("abcdefgh", min_size=1, max_size=4)
_LEAVES = st.one_of(
    array_views("torch"),
    array_views("numpy"),
    st.tuples(st.just("leaf"), st.one_of(st.text(max_size=12), st.integers(), st.none())),
)


def _containers(children):
    return st.one_of(
        st.tuples(st.just("tuple"), st.lists(children, max_size=3).map(tuple)),
        st.tuples(st.just("list"), st.lists(children, max_size=3).map(tuple)),
        st.tuples(
            st.just("dict"),
            st.lists(st.tuples(_KEYS, children), max_size=3, unique_by=lambda kv: kv[0]).map(tuple),
        ),
        st.tuples(st.just("pair"), children, children),
        st.tuples(
            st.just("td"),
            st.lists(
                st.tuples(_KEYS, array_views("torch")), max_size=3, unique_by=lambda kv: kv[0]
            ).map(tuple),
        ),
    )


payloads = st.recursive(_LEAVES, _containers, max_leaves=6)
"""Recipes of nested containers of views (tuples, lists, dicts, dataclasses, TensorDicts)."""


def emit_built(unit):
    """Source stage function: the unit is a tuple of recipes; emit the objects they build."""
    for recipe in unit:
        yield build(recipe)
