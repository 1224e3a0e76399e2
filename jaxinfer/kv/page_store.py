"""The storage tier of full KV pages: files in a directory that outlive the process (host side).

What a page is here: one full page of the latent cache across every layer, [L, S, W] in the cache's value dtype
(``paged_cache``: W = kv_lora_rank + qk_rope_head_dim, S = 64), stored under the page's chained prefix hash
(``prefix_cache.page_hashes``: it names the page's whole token prefix) salted with the model's fingerprint, so a
model of the same config but other weights never reads another's pages. DeepSeek serves V3/R1 with such a tier
(3FS, 56.3% of input tokens hit it); SGLang's HiCache and LMCache do the same for PyTorch engines.

``PageStore`` is the tier's interface (a host-memory tier can sit in front of the directory later);
``DirectoryPageStore`` keeps one file per page:

    <dir>/<name[:2]>/<name>.kvpage,  name = hex(blake2b_128(salt || key))
    file = MAGIC (8 bytes) | version (u32 LE) | header length (u32 LE) | header (JSON: name, dtype, shape)
           | payload (the page's bytes, C order) | blake2b_256 over everything before it

Rules (docs/architecture.md "KV storage tier"):
- Writes are atomic: a temporary file in the same directory, then ``os.replace``; a reader sees a whole file or
  none, and several processes may write and read one directory at once (a page two of them write is either's
  whole file: the same prefix's latents, equal up to the rounding of the batches that computed them).
- A file that is truncated, corrupt, of another format version, another page's (its header names another key)
  or of another layout is *rejected*: counted, removed, and reported as a miss. Nothing read from the tier is used
  unless its checksum and header match, so a bad file can cost a recompute, never a wrong token.
- The bound (``max_bytes``) holds with LRU eviction by file mtime (a read, or a write of a page already there,
  touches its file), with no shared index: before a write, the writer lists the directory and removes the oldest
  pages until its page fits, so the directory exceeds the bound by at most the pages other writers add between
  its listing and its write (one per concurrent writer). Listing costs O(files) per write; writes run behind the
  engine's steps.
- Faults of the directory itself (unwritable, disk full) never raise into the engine: the store warns once and
  reports misses / skipped writes.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import json
import math
import os
import struct
import threading
import time
import uuid
import warnings

import jax.numpy as jnp
import numpy as np

MAGIC = b"JXKVPAGE"
FORMAT_VERSION = 1
SUFFIX = ".kvpage"
_PREFIX = struct.Struct("<8sII")  # magic, format version, header length
_DIGEST_BYTES = 32  # blake2b-256 over everything before it
_NAME_BYTES = 16
_STALE_TMP_S = 600.0  # a temporary file this old is a dead writer's: removed when making room


def page_key(page_hash: int) -> bytes:
    """The storage key of a page: its chained prefix hash (prefix_cache.page_hashes, 128 bits), little-endian."""
    return page_hash.to_bytes(16, "little")


def model_salt(config, dtype, fp8_mode: str, weights_digest: bytes, shape: tuple[int, ...]) -> bytes:
    """A model's salt for ``DirectoryPageStore``: blake2b over the page format version, the model config (a
    ``ModelConfig``: every field), the cache's dtype, the FP8 mode, the weights' content digest
    (checkpoint/fingerprint.py) and the page shape (an engine with the MTP module's cache stores one layer more:
    its pages live beside the others', not in their place). Not the mesh: a page holds the latent, which no mesh
    shards."""
    h = hashlib.blake2b(b"jaxinfer-kv-pages", digest_size=32)
    fields = json.dumps(dataclasses.asdict(config), sort_keys=True, default=repr)
    for part in (str(FORMAT_VERSION), fields, jnp.dtype(dtype).name, fp8_mode, repr(tuple(shape))):
        h.update(part.encode() + b"\0")
    h.update(bytes(weights_digest))
    return h.digest()


@dataclasses.dataclass
class PageStoreStats:
    """Counters since the store was built (``LLM.cache_stats`` reports them)."""

    hits: int = 0            # pages read and verified
    misses: int = 0          # pages asked for and not there (rejected files included)
    rejected_files: int = 0  # files that failed verification (removed)
    bytes_read: int = 0      # file bytes of the hits
    writes: int = 0          # pages written
    bytes_written: int = 0   # file bytes written
    evicted_files: int = 0   # files this store removed to keep the bound
    failed_writes: int = 0   # writes the directory refused (unwritable, full)


class PageStore(abc.ABC):
    """A tier of full pages keyed by their chained prefix hash (bytes). Pages are numpy arrays of one layout."""

    stats: PageStoreStats

    @abc.abstractmethod
    def get(self, key: bytes) -> np.ndarray | None:
        """The page stored under ``key``, verified, or None (absent or rejected)."""

    @abc.abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether a page is stored under ``key`` (not verified: a later ``get`` may still reject it)."""

    @abc.abstractmethod
    def put(self, key: bytes, page: np.ndarray) -> bool:
        """Stores ``page`` under ``key``; False when it was not written (already there, or the tier failed)."""


class DirectoryPageStore(PageStore):
    """Pages as checksummed files in ``path`` (the module doc).

    Args:
      path: the directory (created if missing; shared by any number of processes).
      salt: the model's fingerprint (``model_salt``); pages of another salt are never read. An attribute that may
        be set after construction, before the first read or write (the engine checks the directory before it
        hashes the weights).
      dtype, shape: the layout of every page ([layers, page_size, width] in the cache's value dtype).
      max_bytes: the bound on the directory's page files (None: unbounded).
    """

    def __init__(self, path: str | os.PathLike, *, salt: bytes, dtype, shape: tuple[int, ...],
                 max_bytes: int | None = None):
        self.path = os.fspath(path)
        self.salt = bytes(salt)
        self.dtype = jnp.dtype(dtype)
        self.shape = tuple(int(n) for n in shape)
        self.payload_bytes = math.prod(self.shape) * self.dtype.itemsize
        self.page_bytes = (_PREFIX.size + len(self._header(b"\0" * _NAME_BYTES)) + self.payload_bytes
                           + _DIGEST_BYTES)  # every name has the same length: every file this many bytes
        if max_bytes is not None and max_bytes < self.page_bytes:
            raise ValueError(f"kv_cache_max_bytes={max_bytes} is below one page ({self.page_bytes} bytes)")
        self.max_bytes = max_bytes
        self.stats = PageStoreStats()
        self._lock = threading.Lock()  # the stats and the warning; file operations need none (atomic renames)
        self._warned = False
        self.enabled = self._check_writable()

    # ---- names and encoding --------------------------------------------------------------------------------
    def name(self, key: bytes) -> str:
        """The file name of ``key``'s page under this store's salt (hex of a 128-bit digest)."""
        return hashlib.blake2b(self.salt + bytes(key), digest_size=_NAME_BYTES).hexdigest()

    def file(self, key: bytes) -> str:
        name = self.name(key)
        return os.path.join(self.path, name[:2], name + SUFFIX)

    def _header(self, name: bytes) -> bytes:
        return json.dumps({"name": name.hex(), "dtype": self.dtype.name, "shape": list(self.shape)},
                          sort_keys=True, separators=(",", ":")).encode()

    def _encode(self, name: bytes, payload: np.ndarray) -> bytes:
        """The file's bytes."""
        header = self._header(name)
        data = np.ascontiguousarray(payload).tobytes()
        body = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header + data
        return body + hashlib.blake2b(body, digest_size=_DIGEST_BYTES).digest()

    def _decode(self, blob: bytes, name: bytes) -> np.ndarray | None:
        """The page in ``blob`` if it verifies as ``name``'s page of this layout, else None."""
        if len(blob) != self.page_bytes:  # truncated, zero-length, padded, or of another layout
            return None
        body, digest = blob[:-_DIGEST_BYTES], blob[-_DIGEST_BYTES:]
        if hashlib.blake2b(body, digest_size=_DIGEST_BYTES).digest() != digest:
            return None
        magic, version, header_len = _PREFIX.unpack_from(body)
        start = _PREFIX.size + header_len
        if magic != MAGIC or version != FORMAT_VERSION or body[_PREFIX.size:start] != self._header(name):
            return None  # another format, another page (the header names it), or another layout
        return np.frombuffer(body, self.dtype, offset=start).reshape(self.shape)

    # ---- the tier ------------------------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return self.enabled and os.path.exists(self.file(key))

    def get(self, key: bytes) -> np.ndarray | None:
        if not self.enabled:
            return None
        path = self.file(key)
        try:
            with open(path, "rb") as f:
                blob = f.read(self.page_bytes + 1)  # one byte more than a page: a longer file is rejected too
        except OSError:
            with self._lock:
                self.stats.misses += 1
            return None
        page = self._decode(blob, bytes.fromhex(self.name(key)))
        with self._lock:
            if page is None:
                self.stats.misses += 1
                self.stats.rejected_files += 1
            else:
                self.stats.hits += 1
                self.stats.bytes_read += len(blob)
        if page is None:
            _remove(path)
            return None
        try:
            os.utime(path)  # LRU: a read makes the page recent
        except OSError:
            pass  # evicted by another process meanwhile: the page read is still whole and verified
        return page

    def put(self, key: bytes, page: np.ndarray) -> bool:
        if not self.enabled:
            return False
        page = np.asarray(page)
        if page.shape != self.shape or page.dtype != self.dtype:
            raise ValueError(f"a page of this store is {self.dtype.name} {list(self.shape)}, got "
                             f"{page.dtype.name} {list(page.shape)}")
        path = self.file(key)
        if os.path.exists(path):
            try:
                os.utime(path)  # in use again: recent for the LRU bound
            except OSError:
                pass
            return False
        blob = self._encode(bytes.fromhex(self.name(key)), page)
        tmp = os.path.join(os.path.dirname(path), f".tmp-{os.getpid()}-{uuid.uuid4().hex}")
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if self.max_bytes is not None:
                self._make_room(len(blob))
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        except OSError as e:
            _remove(tmp)
            self._warn(f"could not write a KV page to {self.path!r} ({e}); pages that do not fit are skipped")
            with self._lock:
                self.stats.failed_writes += 1
            return False
        with self._lock:
            self.stats.writes += 1
            self.stats.bytes_written += len(blob)
        return True

    # ---- the bound -----------------------------------------------------------------------------------------
    def listing(self) -> list[tuple[float, int, str]]:
        """(mtime, bytes, path) of every page file in the directory, any writer's; stale temporary files of dead
        writers are removed on the way."""
        out = []
        now = time.time()
        try:
            subdirs = [e.path for e in os.scandir(self.path) if e.is_dir(follow_symlinks=False)]
        except OSError:
            return out
        for sub in subdirs:
            try:
                entries = list(os.scandir(sub))
            except OSError:
                continue
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue  # removed by another process meanwhile
                if e.name.endswith(SUFFIX):
                    out.append((st.st_mtime, st.st_size, e.path))
                elif e.name.startswith(".tmp-") and now - st.st_mtime > _STALE_TMP_S:
                    _remove(e.path)
        return out

    def size_bytes(self) -> int:
        """Bytes of the page files in the directory now (every writer's)."""
        return sum(size for _, size, _ in self.listing())

    def _make_room(self, incoming: int) -> None:
        """Removes the least recently used page files until ``incoming`` more bytes fit under the bound."""
        files = sorted(self.listing())  # oldest first
        total = sum(size for _, size, _ in files)
        for _, size, path in files:
            if total + incoming <= self.max_bytes:
                break
            if _remove(path):
                with self._lock:
                    self.stats.evicted_files += 1
            total -= size  # removed by us or, meanwhile, by another writer

    # ---- faults of the directory ---------------------------------------------------------------------------
    def _check_writable(self) -> bool:
        probe = os.path.join(self.path, f".tmp-{os.getpid()}-{uuid.uuid4().hex}")
        try:
            os.makedirs(self.path, exist_ok=True)
            with open(probe, "wb"):
                pass
            os.remove(probe)
        except OSError as e:
            self._warn(f"the KV cache directory {self.path!r} is not writable ({e}); running without the storage "
                       f"tier")
            return False
        return True

    def _warn(self, message: str) -> None:
        with self._lock:
            if self._warned:
                return
            self._warned = True
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _remove(path: str) -> bool:
    """Removes a file; False if it was already gone (another process removed it) or cannot be removed."""
    try:
        os.remove(path)
        return True
    except OSError:
        return False
