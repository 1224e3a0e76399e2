"""safetensors reader/writer: bit-exact round trips, interop with the official library, memory mapping, errors."""

import json
import mmap
import struct
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest

from jaxinfer.checkpoint import safetensors_io
from jaxinfer.checkpoint.errors import CheckpointError
from jaxinfer.checkpoint.safetensors_io import (
    INDEX_FILE,
    SafetensorsCheckpoint,
    StagingBuffers,
    host_array,
    write_safetensors,
    write_sharded_safetensors,
)

DTYPES = [np.float64, np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
          ml_dtypes.float8_e8m0fnu, np.int64, np.int32, np.int16, np.int8, np.uint64, np.uint32, np.uint16, np.uint8,
          np.bool_]


def random_array(rng, shape, dtype):
    """Random bit patterns of ``dtype`` (NaN payloads included), so round trips are checked bit for bit."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    raw = rng.integers(0, 256, (*shape, dtype.itemsize), dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def assert_bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    assert a.tobytes() == b.tobytes()


def raw_file(path, header, data=b"", header_len=None):
    """Writes a safetensors file by hand (for corrupt cases): u64 length, JSON header, data."""
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if header_len is None else header_len) + body + data)
    return path


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_round_trip_all_dtypes_bit_exact(tmp_path, rng):
    tensors = {f"t.{np.dtype(d).name}": random_array(rng, (3, 5), d) for d in DTYPES}
    tensors["scalar"] = np.array(1.5, np.float32)
    tensors["empty"] = np.zeros((0, 4), ml_dtypes.bfloat16)
    tensors["transposed"] = random_array(rng, (3, 4), ml_dtypes.bfloat16).T  # not C-contiguous
    big_endian = np.arange(6, dtype=">i4")
    path = write_safetensors(tmp_path / "m.safetensors", tensors, metadata={"format": "pt"})
    ckpt = SafetensorsCheckpoint(path)
    assert ckpt.names() == sorted(tensors) and len(ckpt) == len(tensors) and "scalar" in ckpt
    assert ckpt.metadata == {"m.safetensors": {"format": "pt"}}
    assert_bits_equal(SafetensorsCheckpoint(write_safetensors(tmp_path / "be.safetensors", {"b": big_endian}))
                      .read("b"), np.arange(6, dtype="<i4"))
    for name, arr in tensors.items():
        info = ckpt.info(name)
        assert (info.dtype, info.shape, info.nbytes) == (arr.dtype, arr.shape, arr.nbytes)
        assert info.offset % max(arr.dtype.itemsize, 1) == 0  # the writer aligns every tensor
        assert_bits_equal(ckpt.read(name), arr)


def test_read_is_memory_mapped_and_read_only(tmp_path, rng):
    arr = rng.standard_normal((64, 32)).astype(np.float32)
    path = write_safetensors(tmp_path / "m.safetensors", {"w": arr, "b": arr[0]})
    ckpt = SafetensorsCheckpoint(path)
    out = ckpt.read("w")
    base = out
    while isinstance(base, (np.ndarray, memoryview)):
        base = base.base if isinstance(base, np.ndarray) else base.obj
    assert isinstance(base, mmap.mmap)  # a view into the mapped file, no copy
    assert not out.flags.writeable
    with pytest.raises(ValueError):
        out[0, 0] = 1.0
    ckpt.close()  # arrays already handed out stay valid
    np.testing.assert_array_equal(out, arr)


def test_read_into_page_aligned_host_arrays(tmp_path, rng, monkeypatch):
    """read_into copies a tensor's bytes (any dtype, the destination's dtype free) into a host_array, which is
    page-aligned and writable, alone or in parallel pieces; a destination of the wrong size is refused, and a
    file cut short after its header was read is a CheckpointError, not silent garbage."""
    tensors = {f"t.{np.dtype(d).name}": random_array(rng, (7, 129), d) for d in DTYPES}
    path = write_safetensors(tmp_path / "m.safetensors", tensors)
    ckpt = SafetensorsCheckpoint(path)
    for name, arr in tensors.items():
        out = host_array(arr.shape, arr.dtype)
        assert out.ctypes.data % mmap.PAGESIZE == 0 and out.flags.writeable and out.flags.c_contiguous
        ckpt.read_into(name, out)
        assert_bits_equal(out, arr)
    with ThreadPoolExecutor(2) as pool:  # in pieces of READ_CHUNK bytes (3 and a partial one here)
        monkeypatch.setattr(safetensors_io, "READ_CHUNK", 2000)
        out = host_array((7, 129), np.float64)
        ckpt.read_into("t.float64", out, pool)
        assert_bits_equal(out, tensors["t.float64"])
    stacked = host_array((2, 7, 129), ml_dtypes.bfloat16)  # a slot of a stacked array
    ckpt.read_into("t.bfloat16", stacked[1])
    assert_bits_equal(stacked[1], tensors["t.bfloat16"])
    with pytest.raises(ValueError, match="C-contiguous array of 7224 bytes"):
        ckpt.read_into("t.float64", np.empty((7, 128)))
    with pytest.raises(ValueError, match="contiguous: False"):
        ckpt.read_into("t.uint8", np.empty((129, 7), np.uint8).T)
    last = max(tensors, key=lambda n: ckpt.info(n).offset)
    with open(path, "r+b") as f:
        f.truncate(ckpt.info(last).offset + 3)
    with pytest.raises(CheckpointError, match=f"ends before tensor '{last}'"):
        ckpt.read_into(last, host_array(tensors[last].shape, tensors[last].dtype))
    assert host_array((0, 3), np.float32).shape == (0, 3)


def test_staging_buffers_are_reused_one_generation_late():
    """A buffer comes back two releases after it was handed out (its generation was filled, then in flight); the
    smallest free one that fits and is less than twice the size asked is reused (page-aligned, writable), else one
    is mapped anew; a release keeps the largest free buffers within its byte budget."""
    staging = StagingBuffers()
    first = staging.take((64, 1024), np.uint8)
    small = staging.take((3, 5), np.float32)
    staging.release(keep=1 << 20)  # first, small: in flight
    second = staging.take((64, 1024), np.uint8)
    assert not np.shares_memory(second, first)
    staging.release(keep=1 << 20)  # first, small: free; second: in flight
    assert staging.take((2, 7), np.float32).ctypes.data == small.ctypes.data
    half = staging.take((16, 1024), ml_dtypes.bfloat16)  # 32 KiB: first's 64 KiB is twice that, kept for more
    assert not np.shares_memory(half, first)
    big = staging.take((17, 1024), ml_dtypes.bfloat16)  # 34 KiB
    assert big.ctypes.data == first.ctypes.data and big.shape == (17, 1024) and big.flags.writeable
    bigger = staging.take((65, 1024), np.uint8)  # nothing free fits
    assert bigger.ctypes.data % mmap.PAGESIZE == 0
    assert staging.take((0, 4), np.float32).shape == (0, 4)
    staging.release(keep=0)  # second: free, and unmapped at once (nothing kept)
    staging.release(keep=65 * 1024)  # of small, half, first and bigger only bigger (65 KiB) stays
    assert staging.take((65, 1024), np.uint8).ctypes.data == bigger.ctypes.data
    assert staging.take((3, 5), np.float32).ctypes.data != small.ctypes.data


def test_our_files_read_by_official_library(tmp_path, rng):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    plain = {"f32": rng.standard_normal((4, 3)).astype(np.float32), "i64": rng.integers(-9, 9, (5,))}
    path = write_safetensors(tmp_path / "plain.safetensors", plain)
    loaded = load_file(path)
    for name, arr in plain.items():
        assert_bits_equal(loaded[name], arr)

    import torch

    low = {"bf16": random_array(rng, (4, 6), ml_dtypes.bfloat16),
           "e4m3": rng.standard_normal((8, 2)).astype(ml_dtypes.float8_e4m3fn)}
    path = write_safetensors(tmp_path / "low.safetensors", low)
    with safe_open(path, framework="pt") as f:
        t_bf16, t_e4m3 = f.get_tensor("bf16"), f.get_tensor("e4m3")
    assert (t_bf16.dtype, t_e4m3.dtype) == (torch.bfloat16, torch.float8_e4m3fn)
    assert t_bf16.view(torch.int16).numpy().tobytes() == low["bf16"].tobytes()
    assert t_e4m3.view(torch.uint8).numpy().tobytes() == low["e4m3"].tobytes()


def test_read_files_written_by_official_library(tmp_path, rng):
    import torch
    from safetensors.numpy import save_file
    from safetensors.torch import save_file as torch_save_file

    plain = {"f32": rng.standard_normal((4, 3)).astype(np.float32),
             "f16": rng.standard_normal((7,)).astype(np.float16), "i32": rng.integers(-9, 9, (2, 2), dtype=np.int32)}
    save_file(plain, tmp_path / "np.safetensors")
    gen = torch.Generator().manual_seed(0)
    low = {"bf16": torch.randn(5, 3, generator=gen).to(torch.bfloat16),
           "e4m3": (torch.randn(4, 130, generator=gen) * 100).to(torch.float8_e4m3fn)}
    torch_save_file(low, tmp_path / "pt.safetensors")

    ckpt = SafetensorsCheckpoint(tmp_path)  # no index: both files are read
    assert ckpt.names() == sorted([*plain, *low])
    for name, arr in plain.items():
        assert_bits_equal(ckpt.read(name), arr)
    assert ckpt.read("bf16").dtype == ml_dtypes.bfloat16
    assert ckpt.read("bf16").tobytes() == low["bf16"].view(torch.int16).numpy().tobytes()
    assert ckpt.read("e4m3").dtype == ml_dtypes.float8_e4m3fn
    assert ckpt.read("e4m3").tobytes() == low["e4m3"].view(torch.uint8).numpy().tobytes()


def test_sharded_round_trip(tmp_path, rng):
    tensors = {f"layers.{i}.w": random_array(rng, (16, 8 + i), ml_dtypes.bfloat16) for i in range(6)}
    tensors["big"] = random_array(rng, (64, 64), np.float32)  # larger than one shard: a shard of its own
    max_bytes = 600
    index_path = write_sharded_safetensors(tmp_path / "ckpt", tensors, max_bytes, metadata={"format": "pt"})
    assert index_path == tmp_path / "ckpt" / INDEX_FILE
    index = json.loads(index_path.read_text())
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(index["weight_map"]) == sorted(tensors)

    ckpt = SafetensorsCheckpoint(tmp_path / "ckpt")
    assert ckpt.names() == sorted(tensors) and len(ckpt.files) == len(files)
    for name, arr in tensors.items():
        assert_bits_equal(ckpt.read(name), arr)
        assert ckpt.info(name).file.name == index["weight_map"][name]
    for file in files:  # every shard respects the limit unless it holds a single oversized tensor
        names = [n for n, f in index["weight_map"].items() if f == file]
        assert len(names) == 1 or sum(tensors[n].nbytes for n in names) <= max_bytes
    assert SafetensorsCheckpoint(index_path).names() == ckpt.names()  # the index file itself is a valid path


# --- errors: each names the offending file or tensor ---------------------------------------------------------

def _valid(tmp_path):
    return write_safetensors(tmp_path / "ok.safetensors", {"w": np.arange(32, dtype=np.float32).reshape(4, 8)})


def test_truncated_data(tmp_path):
    path = _valid(tmp_path)
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CheckpointError, match=rf"ok.safetensors is truncated: expected at least {size} bytes.*"
                                              rf"'w'.*file has {size - 10}"):
        SafetensorsCheckpoint(path)


def test_truncated_header(tmp_path):
    raw_file(tmp_path / "a.safetensors", b"{}", header_len=1000)
    with pytest.raises(CheckpointError, match=r"a.safetensors is truncated: header needs 1008 bytes, file has 10"):
        SafetensorsCheckpoint(tmp_path / "a.safetensors")
    (tmp_path / "b.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match=r"b.safetensors is truncated: 2 bytes"):
        SafetensorsCheckpoint(tmp_path / "b.safetensors")


def test_absurd_header_length(tmp_path):
    raw_file(tmp_path / "a.safetensors", b"{}", header_len=2**40)
    with pytest.raises(CheckpointError, match=rf"a.safetensors: header length {2**40} bytes is absurd"):
        SafetensorsCheckpoint(tmp_path / "a.safetensors")


@pytest.mark.parametrize("header", [b"{not json}", b"\xff\xfe", b"[1, 2]", b'{"w": 1, "w": 2}'],
                         ids=["syntax", "utf8", "not-object", "duplicate-key"])
def test_malformed_header(tmp_path, header):
    raw_file(tmp_path / "a.safetensors", header)
    with pytest.raises(CheckpointError, match=r"a.safetensors: (malformed JSON header|header is a JSON list)"):
        SafetensorsCheckpoint(tmp_path / "a.safetensors")


def test_unknown_dtype(tmp_path):
    raw_file(tmp_path / "a.safetensors", {"w": {"dtype": "F4X", "shape": [2], "data_offsets": [0, 2]}}, b"\0\0")
    with pytest.raises(CheckpointError, match=r"a.safetensors: tensor 'w' has unknown dtype 'F4X'"):
        SafetensorsCheckpoint(tmp_path / "a.safetensors")


def test_offsets_inconsistent_with_shape(tmp_path):
    raw_file(tmp_path / "a.safetensors", {"w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 8]}}, b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"tensor 'w' data_offsets \[0, 8\] span 8 bytes, but shape \(2, 3\) "
                                              r"x BF16 \(2 bytes\) needs 12"):
        SafetensorsCheckpoint(tmp_path / "a.safetensors")


def test_index_points_to_missing_file(tmp_path):
    _valid(tmp_path)
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"w": "ok.safetensors", "v": "gone.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"maps tensor 'v' .*gone.safetensors, which is missing"):
        SafetensorsCheckpoint(tmp_path)


def test_index_name_not_in_file(tmp_path):
    _valid(tmp_path)
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"w": "ok.safetensors", "v": "ok.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"maps tensor 'v' to .*ok.safetensors, which does not contain it"):
        SafetensorsCheckpoint(tmp_path)


def test_same_name_in_two_files(tmp_path):
    write_safetensors(tmp_path / "a.safetensors", {"w": np.zeros(2, np.float32)})
    write_safetensors(tmp_path / "b.safetensors", {"w": np.ones(2, np.float32)})
    with pytest.raises(CheckpointError, match=r"tensor 'w' is in two files: .*a.safetensors and .*b.safetensors"):
        SafetensorsCheckpoint(tmp_path)


def test_directory_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"holds no \*.safetensors files"):
        SafetensorsCheckpoint(tmp_path)
    with pytest.raises(CheckpointError, match=r"nowhere does not exist"):
        SafetensorsCheckpoint(tmp_path / "nowhere")


def test_unknown_tensor_name(tmp_path):
    ckpt = SafetensorsCheckpoint(_valid(tmp_path))
    with pytest.raises(CheckpointError, match=r"tensor 'ww' not in checkpoint .*close names: \['w'\]"):
        ckpt.read("ww")


def test_writer_rejects_bad_input(tmp_path):
    with pytest.raises(CheckpointError, match=r"tensor 'c': dtype complex64"):
        write_safetensors(tmp_path / "a.safetensors", {"c": np.zeros(2, np.complex64)})
    with pytest.raises(CheckpointError, match=r"metadata must map str to str"):
        write_safetensors(tmp_path / "a.safetensors", {"w": np.zeros(2)}, metadata={"n": 1})
    with pytest.raises(CheckpointError, match=r"max_shard_bytes must be a positive int"):
        write_sharded_safetensors(tmp_path / "d", {"w": np.zeros(2)}, 0)
