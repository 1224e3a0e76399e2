"""engine/packing.py: a step's host arrays packed into one int32 array and unpacked inside jit, bit for bit.

Oracle: the arrays that went in (compared as raw bytes, so NaN payloads, -0.0 and uint32 values past 2**31 count).
"""

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxinfer.engine import packing
from jaxinfer.engine.sampler import SamplingTensors
from jaxinfer.engine.sampling_params import SamplingParams


def _same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def _roundtrip(tree):
    packed, layout = packing.pack(tree)
    assert packed.dtype == np.int32 and packed.ndim == 2
    return jax.jit(packing.unpack, static_argnums=1)(packed, layout)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 5), width=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_roundtrip_is_bit_exact(rows, width, seed):
    rng = np.random.default_rng(seed)
    floats = rng.standard_normal((rows, width)).astype(np.float32)
    floats.flat[0] = np.float32(-0.0)
    if floats.size > 1:
        floats.flat[1] = np.nan
    tree = {
        "ids": rng.integers(-2**31, 2**31 - 1, (rows, width), dtype=np.int64).astype(np.int32),
        "floats": floats,
        "keys": rng.integers(0, 2**32 - 1, (rows, 2), dtype=np.uint64).astype(np.uint32),
        "flags": rng.random(rows) < 0.5,
        "cube": rng.standard_normal((rows, 2, width)).astype(np.float32),
        "none": None,
    }
    out = _roundtrip(tree)
    assert out["none"] is None
    for name in ("ids", "floats", "keys", "flags", "cube"):
        _same_bits(out[name], tree[name])


def test_sampling_tensors_roundtrip():
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3, logprobs=2),
              SamplingParams(temperature=0.0)]
    tensors = SamplingTensors.build(params, 32, num_rows=4, engine_seed=11)
    out = _roundtrip(tensors)
    assert out.max_logprobs == tensors.max_logprobs and out.output_counts is None
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(tensors)):
        _same_bits(got, want)


@pytest.mark.parametrize("tree, match", [
    ({"a": np.zeros((2, 3), np.int32), "b": np.zeros((3,), np.int32)}, "rows=2"),
    ({"a": np.zeros((2,), np.float64)}, "float64"),
    ({"a": np.int32(1)}, "rows"),
    ({}, "nothing"),
])
def test_bad_trees(tree, match):
    with pytest.raises(ValueError, match=match):
        packing.pack(tree)
