"""Safetensors reader (memory-mapped, one tensor at a time) and writers (one file, or HF-style shards + index).

Hand-written rather than built on ``safetensors.numpy``: that reader cannot return F8_E4M3 nor BF16 arrays
(numpy has no such dtypes), and DeepSeek's FP8 releases consist of exactly those. The format is small
(https://github.com/huggingface/safetensors, README "Format"):

    [u64 little-endian N][N bytes of JSON header, may be padded with trailing spaces][data section]
    header = {name: {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, "__metadata__": {str: str}}

``data_offsets`` count bytes from the start of the data section (file byte 8 + N). Data is little-endian, C order.
We map each file once (``mmap``, read-only) and return ``np.frombuffer`` views with ``ml_dtypes`` dtypes, so a
tensor is paged in from disk only when used and never the whole file at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import mmap
import os
import pathlib
import struct
from collections.abc import Mapping
from concurrent.futures import Executor

import ml_dtypes
import numpy as np

from jaxinfer.checkpoint.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
# The official reader refuses larger headers (safetensors/src/tensor.rs, MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000

# safetensors dtype code -> numpy dtype (multi-byte types explicitly little-endian, as the format stores them).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype(np.bool_),
}
_CODES: dict[np.dtype, str] = {dtype: code for code, dtype in DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: ``offset`` is the absolute byte offset of its data in ``file``."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    file: pathlib.Path
    offset: int
    nbytes: int


def _json_object_no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """json ``object_pairs_hook``: a repeated key would silently drop a tensor, so it is an error."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_entry(file: pathlib.Path, name: str, entry: object, data_start: int) -> TensorInfo:
    """Validates one header entry; ``data_start`` = 8 + header length."""
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
        raise CheckpointError(f"{file}: header entry for tensor {name!r} needs dtype, shape, data_offsets: {entry!r}")
    code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if code not in DTYPES:
        raise CheckpointError(
            f"{file}: tensor {name!r} has unknown dtype {code!r} (supported: {', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(f"{file}: tensor {name!r} has invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{file}: tensor {name!r} has invalid data_offsets {offsets!r}")
    dtype = DTYPES[code]
    nbytes = math.prod(shape) * dtype.itemsize
    begin, end = offsets
    if end - begin != nbytes:
        raise CheckpointError(
            f"{file}: tensor {name!r} data_offsets [{begin}, {end}] span {end - begin} bytes, but shape "
            f"{tuple(shape)} x {code} ({dtype.itemsize} bytes) needs {nbytes}")
    return TensorInfo(name, dtype, tuple(shape), file, data_start + begin, nbytes)


def read_header(file: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Reads and validates the header of one safetensors file; returns ({name: TensorInfo}, __metadata__)."""
    file = pathlib.Path(file)
    size = file.stat().st_size
    if size < 8:
        raise CheckpointError(f"{file} is truncated: {size} bytes, less than the 8-byte header length field")
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > MAX_HEADER_BYTES:
            raise CheckpointError(
                f"{file}: header length {header_len} bytes is absurd (limit {MAX_HEADER_BYTES}); "
                "not a safetensors file?")
        if 8 + header_len > size:
            raise CheckpointError(
                f"{file} is truncated: header needs {8 + header_len} bytes, file has {size}")
        raw = f.read(header_len)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_json_object_no_duplicates)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError and duplicate keys are all ValueErrors
        raise CheckpointError(f"{file}: malformed JSON header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: header is a JSON {type(header).__name__}, expected an object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{file}: __metadata__ must map strings to strings, got {metadata!r}")
    data_start = 8 + header_len
    infos = {name: _parse_entry(file, name, entry, data_start) for name, entry in header.items()}
    if infos:
        last = max(infos.values(), key=lambda i: i.offset + i.nbytes)
        if last.offset + last.nbytes > size:
            raise CheckpointError(
                f"{file} is truncated: expected at least {last.offset + last.nbytes} bytes (tensor "
                f"{last.name!r} ends there), file has {size}")
    return infos, metadata


def _read_index(index: pathlib.Path) -> dict[str, str]:
    """Returns the weight_map {tensor name: file name} of a ``model.safetensors.index.json``."""
    try:
        doc = json.loads(index.read_text(encoding="utf-8"), object_pairs_hook=_json_object_no_duplicates)
    except ValueError as e:
        raise CheckpointError(f"{index}: malformed JSON ({e})") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: expected {{\"weight_map\": {{tensor name: file name}}}}")
    if not weight_map:
        raise CheckpointError(f"{index}: weight_map lists no tensors")
    for name, fname in weight_map.items():
        if pathlib.PurePath(fname).is_absolute() or ".." in pathlib.PurePath(fname).parts:
            raise CheckpointError(f"{index}: tensor {name!r} maps to {fname!r}, outside the checkpoint directory")
    return weight_map


def checkpoint_files(path: str | os.PathLike) -> list[pathlib.Path]:
    """The safetensors files a ``SafetensorsCheckpoint`` of ``path`` reads (sorted)."""
    return sorted(SafetensorsCheckpoint._locate(pathlib.Path(path))[1])


class SafetensorsCheckpoint:
    """Tensors of one safetensors checkpoint: headers read eagerly, data memory-mapped lazily.

    ``path`` is a directory with ``model.safetensors.index.json`` (sharded HF checkpoint), a directory of
    ``*.safetensors`` files without an index (all of them are read; a name may appear in one file only), a single
    ``.safetensors`` file, or the index file itself. Arrays from ``read`` stay valid after ``close``.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        self._infos: dict[str, TensorInfo] = {}
        self._metadata: dict[str, dict[str, str]] = {}
        self._mmaps: dict[pathlib.Path, mmap.mmap] = {}
        base, files, weight_map = self._locate(self.path)
        headers = {file: read_header(file) for file in files}
        self._metadata = {file.name: meta for file, (_, meta) in headers.items()}
        if weight_map is None:
            for file, (infos, _) in headers.items():
                for name, info in infos.items():
                    if name in self._infos:
                        raise CheckpointError(
                            f"tensor {name!r} is in two files: {self._infos[name].file} and {file}")
                    self._infos[name] = info
        else:
            for name, fname in weight_map.items():
                infos = headers[base / fname][0]
                if name not in infos:
                    raise CheckpointError(
                        f"{INDEX_FILE} maps tensor {name!r} to {base / fname}, which does not contain it "
                        f"({len(infos)} tensors there)")
                self._infos[name] = infos[name]

    @staticmethod
    def _locate(path: pathlib.Path) -> tuple[pathlib.Path, list[pathlib.Path], dict[str, str] | None]:
        """Returns (directory, files to read, weight_map or None when there is no index)."""
        if not path.exists():
            raise CheckpointError(f"checkpoint path {path} does not exist")
        if path.is_file() and not path.name.endswith(".index.json"):
            return path.parent, [path], None
        index = path if path.is_file() else path / INDEX_FILE
        if index.is_file():
            weight_map = _read_index(index)
            files = sorted({index.parent / fname for fname in weight_map.values()})
            for file in files:
                if not file.is_file():
                    example = next(n for n, f in weight_map.items() if index.parent / f == file)
                    raise CheckpointError(
                        f"{index} maps tensor {example!r} (and maybe others) to {file.name}, which is missing")
            return index.parent, files, weight_map
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path} holds no *.safetensors files and no {INDEX_FILE}")
        return path, files, None

    def names(self) -> list[str]:
        """All tensor names, sorted."""
        return sorted(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def __repr__(self) -> str:
        return f"SafetensorsCheckpoint({str(self.path)!r}: {len(self)} tensors in {len(self._metadata)} files)"

    @property
    def files(self) -> list[pathlib.Path]:
        """The safetensors files read, sorted."""
        return sorted({info.file for info in self._infos.values()})

    @property
    def metadata(self) -> dict[str, dict[str, str]]:
        """``__metadata__`` of each file, keyed by file name (HF writes ``{"format": "pt"}``)."""
        return {k: dict(v) for k, v in self._metadata.items()}

    def info(self, name: str) -> TensorInfo:
        """Dtype, shape and location of one tensor; CheckpointError if absent."""
        try:
            return self._infos[name]
        except KeyError:
            parent = str(name).rpartition(".")[0]  # hint among siblings only: cheap even for ~100k names
            siblings = [n for n in self._infos if n.startswith(parent)][:1000]
            close = difflib.get_close_matches(str(name), siblings, n=3)
            hint = f"; close names: {close}" if close else ""
            raise CheckpointError(
                f"tensor {name!r} not in checkpoint {self.path} ({len(self)} tensors){hint}") from None

    def read(self, name: str) -> np.ndarray:
        """Read-only array of one tensor, a view into the memory-mapped file (nothing is copied)."""
        info = self.info(name)
        if info.nbytes == 0:
            empty = np.empty(info.shape, info.dtype)
            empty.flags.writeable = False
            return empty
        try:
            flat = np.frombuffer(self._mmap(info.file), info.dtype, math.prod(info.shape), info.offset)
        except ValueError as e:  # the file shrank after its header was validated
            raise CheckpointError(f"{info.file} changed since it was opened, cannot read {name!r}: {e}") from None
        return flat.reshape(info.shape)

    def read_into(self, name: str, out: np.ndarray, pool: Executor | None = None) -> None:
        """Copies one tensor's bytes into ``out`` (C-contiguous, of the tensor's size in bytes, any dtype) with
        positioned reads (``os.preadv``): one copy from the page cache, without mapping the file's pages. With a
        thread pool, pieces of ``READ_CHUNK`` bytes are read in parallel (the first touch of fresh memory, not the
        copy, bounds a read: docs/benchmarks.md "Checkpoint loading")."""
        info = self.info(name)
        if not out.flags.c_contiguous or out.nbytes != info.nbytes:
            raise ValueError(f"read_into {name!r}: needs a C-contiguous array of {info.nbytes} bytes, got "
                             f"{out.nbytes} bytes (contiguous: {out.flags.c_contiguous})")
        view = memoryview(out.reshape(-1).view(np.uint8))
        if pool is None or info.nbytes <= READ_CHUNK:
            _pread(info, view, 0, info.nbytes)
            return
        for piece in [pool.submit(_pread, info, view, begin, min(begin + READ_CHUNK, info.nbytes))
                      for begin in range(0, info.nbytes, READ_CHUNK)]:
            piece.result()

    def _mmap(self, file: pathlib.Path) -> mmap.mmap:
        if file not in self._mmaps:
            with open(file, "rb") as f:
                self._mmaps[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return self._mmaps[file]

    def close(self) -> None:
        """Drops this object's file mappings; a mapping still used by a returned array lives until that array dies."""
        for mm in self._mmaps.values():
            try:
                mm.close()
            except BufferError:  # arrays from read() still point into it
                pass
        self._mmaps.clear()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


READ_CHUNK = 8 << 20  # bytes per parallel read of one tensor


def _pread(info: TensorInfo, view: memoryview, begin: int, end: int) -> None:
    """Bytes [begin, end) of a tensor's data into view[begin:end]."""
    fd = os.open(info.file, os.O_RDONLY)
    try:
        while begin < end:  # preadv may return fewer bytes than asked (e.g. > 2 GiB at once)
            got = os.preadv(fd, [view[begin:end]], info.offset + begin)
            if got == 0:
                raise CheckpointError(f"{info.file} ends before tensor {info.name!r} does (changed since it was "
                                      f"opened?)")
            begin += got
    finally:
        os.close(fd)


def host_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised array in its own page-aligned anonymous mapping, released with the last array viewing it.

    Why not ``np.empty``: XLA:CPU takes a page-aligned numpy array as a device buffer without copying it
    (``device_put`` aliases it), while numpy's large allocations start 16 bytes into a page and are copied: a
    loaded checkpoint would sit in memory twice while it is placed (docs/benchmarks.md "Checkpoint loading")."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return np.frombuffer(buffer, dtype).reshape(shape)


class StagingBuffers:
    """Page-aligned host buffers handed out and taken back: host memory for bytes that only pass through.

    Loading FP8 weights in a float dtype places each tensor's e4m3 bytes, dequantizes them on the device and drops
    them. Reading every tensor into fresh memory (``host_array``) faults every page in anew, and on CPU hosts those
    first touches, not the copy, bound the read (docs/benchmarks.md "Checkpoint loading"); buffers taken back here
    are reused, their pages already touched. ``take`` hands out the smallest free buffer that fits and is less than
    twice the size asked (else maps a new one). ``release(keep)`` ends a generation: the buffers handed out before
    the previous ``release`` are free again (one generation in flight, one being filled), so by then the caller's
    arrays over them must be gone and the device work reading them done; of the free buffers, the largest are kept
    while they total at most ``keep`` bytes (what the caller may still ask for at once) and the rest unmapped.
    """

    def __init__(self):
        self._free: list[mmap.mmap] = []
        self._filling: list[mmap.mmap] = []
        self._in_flight: list[mmap.mmap] = []

    def take(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return np.empty(shape, dtype)
        fits = [b for b in self._free if nbytes <= len(b) < 2 * nbytes]  # a big one stays for a big tensor
        if fits:
            buffer = min(fits, key=len)
            self._free.remove(buffer)
        else:
            buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._filling.append(buffer)
        return np.frombuffer(buffer, dtype, math.prod(shape)).reshape(shape)

    def release(self, keep: int) -> None:
        free, self._free = sorted(self._free + self._in_flight, key=len, reverse=True), []
        for buffer in free:
            if len(buffer) <= keep:
                self._free.append(buffer)  # the others are unmapped with the last array viewing them
                keep -= len(buffer)
        self._in_flight, self._filling = self._filling, []


def _as_writable_array(name: object, value: object) -> np.ndarray:
    """Checks one tensor to write; returns it as a C-contiguous little-endian numpy array."""
    if not isinstance(name, str) or not name or name == "__metadata__":
        raise CheckpointError(f"invalid tensor name {name!r}")
    arr = np.asarray(value)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if arr.dtype not in _CODES:
        raise CheckpointError(f"tensor {name!r}: dtype {arr.dtype} cannot be stored in safetensors "
                              f"(supported: {', '.join(str(d) for d in _CODES)})")
    return arr if arr.flags.c_contiguous else arr.copy(order="C")  # (ascontiguousarray makes 0-d 1-d)


def _write_file(path: pathlib.Path, arrays: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None) -> None:
    """Writes already-checked arrays; tensors are laid out by decreasing itemsize, then name (as the official
    writer does), so with the 8-byte-aligned header every tensor is aligned to its itemsize."""
    if metadata is not None and not (isinstance(metadata, Mapping) and
                                     all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise CheckpointError(f"safetensors metadata must map str to str, got {metadata!r}")
    order = sorted(arrays, key=lambda n: (-arrays[n].dtype.itemsize, n))
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        arr = arrays[name]
        header[name] = {"dtype": _CODES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format allows trailing spaces as padding
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name in order:
            f.write(arrays[name].reshape(-1).view(np.uint8).data)
    os.replace(tmp, path)  # readers never see a half-written file


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> pathlib.Path:
    """Writes ``tensors`` (any dtype of ``DTYPES``, numpy or jax arrays) to one safetensors file at ``path``."""
    path = pathlib.Path(path)
    arrays = {name: _as_writable_array(name, value) for name, value in tensors.items()}
    _write_file(path, arrays, metadata)
    return path


def write_sharded_safetensors(directory: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                              max_shard_bytes: int, metadata: Mapping[str, str] | None = None) -> pathlib.Path:
    """Writes ``model-0000i-of-0000N.safetensors`` shards and ``model.safetensors.index.json`` as HF does.

    Tensors go to shards in the order given; a shard is closed when the next tensor would push it past
    ``max_shard_bytes`` (a tensor larger than that gets a shard of its own). The index is
    ``{"metadata": {"total_size": bytes of all tensors}, "weight_map": {name: file}}``. Returns the index path.
    """
    if not _is_int(max_shard_bytes) or max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    arrays = {name: _as_writable_array(name, value) for name, value in tensors.items()}
    if not arrays:
        raise CheckpointError("no tensors to write")
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, arr in arrays.items():
        if shards[-1] and shard_bytes + arr.nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += arr.nbytes
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_file(directory / fname, {n: arrays[n] for n in shard}, metadata)
        weight_map.update({n: fname for n in shard})
    index = {"metadata": {"total_size": sum(a.nbytes for a in arrays.values())},
             "weight_map": dict(sorted(weight_map.items()))}
    index_path = directory / INDEX_FILE
    tmp = index_path.with_name(INDEX_FILE + ".tmp")
    tmp.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, index_path)
    return index_path
