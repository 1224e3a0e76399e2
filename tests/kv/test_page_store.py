"""jaxinfer/kv/page_store.py: pages round-trip through files bit for bit; every kind of bad file (flipped bytes,
truncated, empty, padded, another page's, another model's, another format or layout) is rejected, counted and
removed, never returned; the bound holds with LRU order by mtime; a directory that cannot be written is a warning,
not an error; two processes writing one directory at once leave only whole, verified pages."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import default_model
from jaxinfer.config import ModelConfig
from jaxinfer.kv import page_store
from jaxinfer.kv.page_store import DirectoryPageStore, model_salt

SHAPE = (3, 64, 40)  # [layers, page_size, width]: small pages


def _store(path, salt=b"model-a", dtype=jnp.bfloat16, shape=SHAPE, max_bytes=None):
    return DirectoryPageStore(path, salt=salt, dtype=dtype, shape=shape, max_bytes=max_bytes)


def _page(seed, dtype=jnp.bfloat16, shape=SHAPE):
    rng = np.random.default_rng(seed)
    if jnp.issubdtype(dtype, jnp.integer):  # the cache's bit patterns (paged_cache's as_bits storage)
        return rng.integers(0, 1 << 16, shape).astype(dtype)
    return np.asarray(rng.standard_normal(shape), dtype=dtype)


def _key(i):
    return i.to_bytes(16, "little")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.uint16])
def test_a_page_round_trips_bit_for_bit(tmp_path, dtype):
    store = _store(tmp_path, dtype=dtype)
    page = _page(1, dtype)
    assert store.put(_key(1), page)
    assert not store.put(_key(1), page)  # already stored
    got = _store(tmp_path, dtype=dtype).get(_key(1))  # another store on the directory: another process
    assert got.dtype == page.dtype and got.shape == page.shape
    np.testing.assert_array_equal(got.view(np.uint8), page.view(np.uint8))
    assert store.get(_key(2)) is None
    assert (store.stats.writes, store.stats.bytes_written, store.stats.misses) == (1, store.page_bytes, 1)
    assert os.path.getsize(store.file(_key(1))) == store.page_bytes
    assert store.page_bytes > page.nbytes


def _flip(offset):
    def fault(path, store):
        with open(path, "r+b") as f:
            f.seek(offset if offset >= 0 else store.page_bytes + offset)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x10]))
    return fault


def _truncate(path, store):
    with open(path, "r+b") as f:
        f.truncate(store.page_bytes - 1)


def _empty(path, store):
    open(path, "wb").close()


def _padded(path, store):
    with open(path, "ab") as f:
        f.write(b"\0")


def _other_page(path, store):  # another page's whole, valid file under this page's name
    other = _store(os.path.dirname(os.path.dirname(path)) + "-other")
    other.put(_key(7), _page(7))
    os.replace(other.file(_key(7)), path)


def _other_model(path, store):  # the same key written by a model of the same layout but other weights (salt)
    other = _store(os.path.dirname(os.path.dirname(path)) + "-other", salt=b"model-b")
    other.put(_key(1), _page(1))
    os.replace(other.file(_key(1)), path)


def _other_version(path, store):  # a valid file of another format version (checksum recomputed)
    with open(path, "rb") as f:
        body = f.read()[:-32]
    magic, _, n = struct.unpack_from("<8sII", body)
    body = struct.pack("<8sII", magic, page_store.FORMAT_VERSION + 1, n) + body[16:]
    with open(path, "wb") as f:
        f.write(body + hashlib.blake2b(body, digest_size=32).digest())


FAULTS = {"payload byte": _flip(-100), "header byte": _flip(20), "checksum byte": _flip(-1),
          "magic byte": _flip(0), "truncated": _truncate, "empty": _empty, "padded": _padded,
          "another page": _other_page, "another model": _other_model, "another version": _other_version}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_bad_file_is_a_counted_miss_and_is_removed(tmp_path, fault):
    store = _store(tmp_path / "kv")
    page = _page(1)
    store.put(_key(1), page)
    FAULTS[fault](store.file(_key(1)), store)
    assert store.get(_key(1)) is None
    assert (store.stats.rejected_files, store.stats.misses, store.stats.hits) == (1, 1, 0)
    assert not os.path.exists(store.file(_key(1)))
    assert store.put(_key(1), page)  # written again, whole
    np.testing.assert_array_equal(store.get(_key(1)).view(np.uint16), page.view(np.uint16))


def test_a_store_of_another_layout_rejects_the_file(tmp_path):
    _store(tmp_path).put(_key(1), _page(1))
    for other in (_store(tmp_path, shape=(3, 64, 41)), _store(tmp_path, dtype=jnp.float16)):
        assert other.get(_key(1)) is None  # same salt and key, so the same name: the header tells them apart
        assert other.stats.rejected_files == 1
        _store(tmp_path).put(_key(1), _page(1))


def test_a_page_of_the_wrong_layout_is_refused(tmp_path):
    with pytest.raises(ValueError, match="bfloat16"):
        _store(tmp_path).put(_key(1), np.zeros(SHAPE, np.float32))


def test_the_bound_holds_with_lru_order_by_mtime(tmp_path):
    probe = _store(tmp_path)
    store = _store(tmp_path, max_bytes=3 * probe.page_bytes + probe.page_bytes // 2)  # room for 3 pages
    t0 = 1_700_000_000
    for i in range(3):
        store.put(_key(i), _page(i))
        os.utime(store.file(_key(i)), (t0 + i, t0 + i))  # written in order 0, 1, 2
    assert store.get(_key(0)) is not None  # read: the most recent now
    store.put(_key(3), _page(3))  # evicts the least recently used: 1
    assert [store.contains(_key(i)) for i in range(4)] == [True, False, True, True]
    assert store.stats.evicted_files == 1
    os.utime(store.file(_key(2)), (t0, t0))
    assert not store.put(_key(2), _page(2))  # already stored: made recent instead
    assert os.path.getmtime(store.file(_key(2))) > t0 + 10
    for i in range(4, 12):
        store.put(_key(i), _page(i))
        assert store.size_bytes() <= store.max_bytes
    assert [store.contains(_key(i)) for i in range(9, 12)] == [True] * 3


def test_a_bound_below_one_page_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="below one page"):
        _store(tmp_path, max_bytes=100)


def test_an_unwritable_directory_is_a_warning_and_no_tier(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.warns(RuntimeWarning, match="not writable"):
        store = _store(blocker / "kv")
    assert not store.enabled
    assert store.get(_key(1)) is None and not store.put(_key(1), _page(1)) and not store.contains(_key(1))


def test_a_write_the_directory_refuses_is_skipped_with_one_warning(tmp_path):
    store = _store(tmp_path)
    for i in (1, 2):  # a file where the page's subdirectory belongs: its write fails
        (tmp_path / store.name(_key(i))[:2]).write_text("in the way")
    with pytest.warns(RuntimeWarning, match="could not write") as caught:
        assert not store.put(_key(1), _page(1))
        assert not store.put(_key(2), _page(2))
    assert len(caught) == 1 and store.stats.failed_writes == 2
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]


WRITER = textwrap.dedent("""
    import os, sys, time
    import jax.numpy as jnp
    import numpy as np
    from jaxinfer.kv.page_store import DirectoryPageStore
    path, first, bound, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    store = DirectoryPageStore(path, salt=b"model-a", dtype=jnp.bfloat16, shape={shape}, max_bytes=bound or None)
    pages = [np.asarray(np.random.default_rng(i).standard_normal({shape}), dtype=jnp.bfloat16)
             for i in range(first, first + 80)]
    print("ready", flush=True)
    while not os.path.exists(go):  # every writer starts at once
        time.sleep(0.001)
    for i, page in enumerate(pages, first):  # overlapping ranges: pages 40-79 are written by both
        store.put(i.to_bytes(16, "little"), page)
        store.get(max(i - 3, 0).to_bytes(16, "little"))
    print(store.stats.writes, store.stats.rejected_files)
""").format(shape=SHAPE)


def test_processes_write_one_directory_at_once(tmp_path):
    """Two writers on an unbounded directory and two on a bounded one, all at once; then a reader."""
    bound = 50 * _store(tmp_path / "probe").page_bytes
    go = tmp_path / "go"
    runs = [(tmp_path / name, first, b) for name, b in (("open", 0), ("bounded", bound)) for first in (0, 40)]
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(first), str(b), str(go)],
                                stdout=subprocess.PIPE, text=True) for path, first, b in runs]
    for w in writers:
        assert w.stdout.readline().strip() == "ready"
    go.touch()
    results = [w.communicate(timeout=120)[0].split() for w in writers]
    assert [w.returncode for w in writers] == [0] * 4
    assert [rejected for _, rejected in results] == ["0"] * 4  # no process ever read a torn file
    for name in ("open", "bounded"):
        reader = _store(tmp_path / name)
        present = [i for i in range(120) if reader.contains(_key(i))]
        for i in present:
            np.testing.assert_array_equal(reader.get(_key(i)).view(np.uint16), _page(i).view(np.uint16))
        assert reader.stats.rejected_files == 0
        leftovers = [n for d in os.listdir(tmp_path / name) for n in os.listdir(tmp_path / name / d)
                     if not n.endswith(page_store.SUFFIX)]
        assert not leftovers
        if name == "bounded":  # each writer may exceed the bound by the page it adds after its listing
            assert reader.size_bytes() <= bound + 2 * reader.page_bytes and len(present) >= 40
        else:
            assert present == list(range(120))


def test_the_salt_separates_what_changes_the_pages():
    config = ModelConfig.from_hf_config(default_model.path())
    w = b"w" * 32
    base = model_salt(config, jnp.bfloat16, "off", w, SHAPE)
    assert model_salt(config, jnp.bfloat16, "off", w, SHAPE) == base  # stable (no salted hash())
    others = [model_salt(config, jnp.float32, "off", w, SHAPE), model_salt(config, jnp.bfloat16, "weights", w, SHAPE),
              model_salt(config, jnp.bfloat16, "off", b"v" * 32, SHAPE),
              model_salt(config, jnp.bfloat16, "off", w, (4, 64, 40)),
              model_salt(dataclasses.replace(config, rms_norm_eps=config.rms_norm_eps * 2), jnp.bfloat16, "off", w,
                         SHAPE)]
    assert len({base, *others}) == 6
