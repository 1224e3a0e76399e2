"""A checkpoint's identity for caches that outlive the process (the KV storage tier: kv/page_store.py).

``weights_digest(path)``: blake2b over the content of every weight file (an HF directory's ``*.safetensors``
shards, or every file of an orbax directory), so two checkpoints of the same config but other weights never share
an identity. Reading a 671B checkpoint takes minutes, so each file's digest is cached, keyed by its absolute path,
size and mtime (a changed file is hashed again), in a JSON file the caller names (the KV tier keeps it in its
directory, shared by every process using it); the cache is rewritten atomically and a corrupt one is ignored.

The digest names files by their path relative to the checkpoint directory, so a moved or copied checkpoint keeps
its identity (its files are hashed again once, under their new paths).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import pathlib
import uuid

from jaxinfer.checkpoint.orbax_io import is_orbax_dir
from jaxinfer.checkpoint.safetensors_io import checkpoint_files

_CHUNK = 8 << 20  # bytes per read while hashing a file (hashlib releases the GIL for large updates)
_DIGEST_BYTES = 32


def weight_files(path: str | os.PathLike) -> list[pathlib.Path]:
    """The files holding a checkpoint's weights: every file under an orbax directory, else the safetensors files
    ``SafetensorsCheckpoint`` reads (sorted)."""
    path = pathlib.Path(path)
    if is_orbax_dir(path):
        return sorted(p for p in path.rglob("*") if p.is_file())
    return checkpoint_files(path)


def file_digest(path: pathlib.Path) -> str:
    """Hex blake2b-256 of a file's content."""
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def weights_digest(path: str | os.PathLike, cache_file: str | os.PathLike | None = None) -> bytes:
    """blake2b-256 over (relative name, content digest) of every weight file of the checkpoint at ``path``;
    per-file digests cached in ``cache_file`` (module doc)."""
    path = pathlib.Path(path).resolve()
    base = path if path.is_dir() else path.parent
    files = weight_files(path)
    cache = _read_cache(cache_file)
    keys = {f: _cache_key(f) for f in files}
    todo = [f for f in files if keys[f] not in cache]
    if todo:  # files hashed in parallel: reading, not hashing, bounds it on a large checkpoint
        with concurrent.futures.ThreadPoolExecutor(min(8, len(todo))) as pool:
            for f, digest in zip(todo, pool.map(file_digest, todo)):
                cache[keys[f]] = digest
        _write_cache(cache_file, {k: cache[k] for k in keys.values()})
    h = hashlib.blake2b(b"jaxinfer-weights", digest_size=_DIGEST_BYTES)
    for f in files:
        h.update(json.dumps([f.relative_to(base).as_posix(), cache[keys[f]]]).encode())
    return h.digest()


def _cache_key(f: pathlib.Path) -> str:
    st = f.stat()
    return f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def _read_cache(cache_file) -> dict[str, str]:
    if cache_file is None:
        return {}
    try:
        with open(cache_file) as fh:
            cache = json.load(fh)
    except (OSError, ValueError):
        return {}  # absent or corrupt: hashed again
    ok = isinstance(cache, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in cache.items())
    return cache if ok else {}


def _write_cache(cache_file, entries: dict[str, str]) -> None:
    """Merges ``entries`` into the cache file (another process's entries kept), atomically; best effort."""
    if cache_file is None:
        return
    merged = _read_cache(cache_file) | entries
    tmp = f"{cache_file}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        with open(tmp, "w") as fh:
            json.dump(merged, fh, sort_keys=True)
        os.replace(tmp, cache_file)
    except OSError:
        try:
            os.remove(tmp)
        except OSError:
            pass
