"""jaxinfer/checkpoint/fingerprint.py: a checkpoint's weights digest follows its weight files' content (one byte
changes it; a copy elsewhere keeps it; tokenizer files do not count), is computed once per file version (the cache
by path, size and mtime), and survives a corrupt cache file. The oracle for "content" is hashlib over the files."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer import default_model
from jaxinfer.checkpoint import fingerprint
from jaxinfer.checkpoint.orbax_io import save_pytree


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "model"
    shutil.copytree(default_model.path(), path)
    return path


def _flip_last_byte(file):
    with open(file, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte ^ 1]))


def test_the_digest_follows_the_weights_content(ckpt, tmp_path):
    digest = fingerprint.weights_digest(ckpt)
    assert fingerprint.weight_files(ckpt) == [ckpt / "model.safetensors"]
    assert fingerprint.file_digest(ckpt / "model.safetensors") == hashlib.blake2b(
        (ckpt / "model.safetensors").read_bytes(), digest_size=32).hexdigest()
    copy = tmp_path / "copy"
    shutil.copytree(ckpt, copy)
    assert fingerprint.weights_digest(copy) == digest  # moved or copied: the same weights
    (copy / "tokenizer_config.json").write_text("{}")
    assert fingerprint.weights_digest(copy) == digest  # not a weight file
    _flip_last_byte(copy / "model.safetensors")
    assert fingerprint.weights_digest(copy) != digest


def test_each_file_is_hashed_once_per_version(ckpt, tmp_path, monkeypatch):
    cache = tmp_path / "digests.json"
    digest = fingerprint.weights_digest(ckpt, cache)
    hashed = []
    monkeypatch.setattr(fingerprint, "file_digest", lambda f: hashed.append(f) or "x")
    assert fingerprint.weights_digest(ckpt, cache) == digest and not hashed  # from the cache
    _flip_last_byte(ckpt / "model.safetensors")
    st = (ckpt / "model.safetensors").stat()
    os.utime(ckpt / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert fingerprint.weights_digest(ckpt, cache) != digest and hashed == [ckpt / "model.safetensors"]


def test_a_corrupt_cache_is_ignored(ckpt, tmp_path):
    cache = tmp_path / "digests.json"
    digest = fingerprint.weights_digest(ckpt)
    for junk in ("{not json", '["a list"]', '{"key": 3}'):
        cache.write_text(junk)
        assert fingerprint.weights_digest(ckpt, cache) == digest
    cache.write_text(json.dumps({"elsewhere|1|2": "ab"}))
    fingerprint.weights_digest(ckpt, cache)
    assert "elsewhere|1|2" in json.loads(cache.read_text())  # another checkpoint's entry kept


def test_an_orbax_checkpoint_counts_every_file(tmp_path):
    save_pytree(tmp_path / "a", {"w": jnp.asarray(np.arange(8.0))})
    save_pytree(tmp_path / "b", {"w": jnp.asarray(np.arange(8.0) + 1)})
    files = fingerprint.weight_files(tmp_path / "a")
    assert len(files) > 1 and all(f.is_file() for f in files)
    assert fingerprint.weights_digest(tmp_path / "a") != fingerprint.weights_digest(tmp_path / "b")
