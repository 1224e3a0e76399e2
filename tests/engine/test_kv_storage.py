"""The KV storage tier through the engine (EngineConfig.kv_cache_dir; kv/page_store.py, engine/page_io.py): a fresh
process reads the pages two other processes wrote at once and computes only the rest of the prompt, with the same greedy
tokens as an engine without the tier (the oracle: that engine's output, float32); bad files, pages of another
model, a full bound and an unwritable directory never change a token; the counts are reported (cache_stats)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from jaxinfer import LLM, SamplingParams, default_model
from jaxinfer.checkpoint.fingerprint import weights_digest
from jaxinfer.kv.page_store import SUFFIX, DirectoryPageStore, model_salt, page_key
from jaxinfer.kv.prefix_cache import page_hashes

PAGE = 64
PREFIX = 300  # tokens shared by a writer's and a reader's prompt: 4 full pages (the 5th is partial)
OPTIONS = dict(mesh="1x1", dtype="float32", max_num_seqs=8)
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def _prompts(suffix_seed: int) -> list[list[int]]:
    """One prompt per prefix: 5 prefixes of PREFIX tokens, a suffix of 20 that depends on the seed."""
    rng = np.random.default_rng(suffix_seed)
    prefixes = [np.random.default_rng(100 + i).integers(10, 1000, PREFIX).tolist() for i in range(5)]
    return [p + rng.integers(10, 1000, 20).tolist() for p in prefixes]


WRITER = textwrap.dedent("""
    import json, sys
    from jaxinfer import LLM, SamplingParams
    options, prompts, path = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    llm = LLM(kv_cache_dir=path, **options)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    print(json.dumps(llm.cache_stats()))
""")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """A directory of pages written by two other processes at once (the same 5 prompts of 320 tokens: 5 full pages
    each, so both write the same files), and the greedy tokens of the readers' prompts from an engine without
    the tier (the oracle)."""
    path = tmp_path_factory.mktemp("kv") / "store"
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, json.dumps(OPTIONS), json.dumps(_prompts(0)),
                                 str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=os.environ | {"PYTHONWARNINGS": "ignore"}) for _ in range(2)]
    results = [w.communicate(timeout=600) for w in writers]
    for w, (_, err) in zip(writers, results):
        assert w.returncode == 0, err[-3000:]
    per_writer = [json.loads(out.strip().splitlines()[-1]) for out, _ in results]
    stats = {k: sum(s[k] for s in per_writer) for k in ("storage_bytes_written", "storage_rejected_files")}
    assert stats["storage_rejected_files"] == 0  # neither ever read a torn file
    reference = LLM(**OPTIONS)
    want = [o.outputs[0].token_ids for o in reference.generate(_prompts(1), GREEDY, use_tqdm=False)]
    computed = reference.stats.prefill_tokens
    return path, stats, want, computed


def _files(path) -> list[str]:
    return sorted(os.path.join(d, n) for d, _, names in os.walk(path) for n in names if n.endswith(SUFFIX))


def _page_file(store: DirectoryPageStore, prompt: list[int], index: int) -> str:
    return store.file(page_key(page_hashes(prompt[:(index + 1) * PAGE])[index]))


def test_a_fresh_process_reads_the_pages_another_wrote(written, tmp_path):
    path, writer_stats, want, computed = written
    assert writer_stats["storage_bytes_written"] > 0  # (a writer later than the other may also read pages)
    assert len(_files(path)) == 25  # 5 prompts x 5 full pages of 64 (320 tokens)
    store = tmp_path / "store"
    shutil.copytree(path, store)
    llm = LLM(kv_cache_dir=store, **OPTIONS)
    outs = llm.generate(_prompts(1), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    for o in outs:  # the prefix's 4 full pages, read from storage
        assert o.metrics["num_cached_prompt_tokens"] == o.metrics["num_storage_cached_prompt_tokens"] == 4 * PAGE
    assert llm.stats.prefill_tokens == computed - 5 * 4 * PAGE
    stats = llm.cache_stats()
    assert stats["storage_hit_tokens"] == 5 * 4 * PAGE and stats["device_hit_tokens"] == 0
    assert stats["prompt_tokens"] == 5 * 320 and stats["hit_rate"] == pytest.approx(4 * PAGE / 320)
    assert stats["storage_bytes_read"] == 20 * os.path.getsize(_files(path)[0])
    assert stats["storage_rejected_files"] == 0
    assert stats["storage_bytes_written"] > 0  # its own new pages (the suffixes differ)


def test_pages_written_on_one_mesh_load_on_another(written, tmp_path):
    """The writer ran on one device; here 8 DP ranks (2x4) read the pages, one prompt per rank: a page is the
    latent of every layer, not a sharded layout (the oracle: the 1x1 engine without the tier; the engine's greedy
    tokens on 2x4 equal transformers' as on 1x1, tests/engine/test_llm.py)."""
    path, _, want, _ = written
    shutil.copytree(path, tmp_path / "store")
    llm = LLM(kv_cache_dir=tmp_path / "store", **{**OPTIONS, "mesh": "2x4"})
    outs = llm.generate(_prompts(1), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert [o.metrics["num_storage_cached_prompt_tokens"] for o in outs] == [4 * PAGE] * 5
    assert sum(cache.num_cached > 0 for cache in llm.engine.scheduler.caches) == 5  # one prompt per rank


def test_bad_files_and_foreign_pages_never_change_a_token(written, tmp_path):
    """One engine, five prefixes, each with another fault on its stored pages (or none), under a bound."""
    path, _, want, _ = written
    store_dir = tmp_path / "store"
    shutil.copytree(path, store_dir)
    page_bytes = os.path.getsize(_files(path)[0])
    bound = 30 * page_bytes
    llm = LLM(kv_cache_dir=store_dir, kv_cache_max_bytes=bound, **OPTIONS)  # reads nothing before generate
    store, prompts = llm.engine.kv_store, _prompts(0)

    def flip(f):
        data = bytearray(open(f, "rb").read())
        data[len(data) // 2] ^= 0x01
        open(f, "wb").write(bytes(data))

    flip(_page_file(store, prompts[1], 1))                           # prefix 1: its 2nd page corrupt
    with open(_page_file(store, prompts[2], 0), "r+b") as f:         # prefix 2: its 1st page truncated
        f.truncate(page_bytes // 2)
    open(_page_file(store, prompts[3], 2), "wb").close()             # prefix 3: its 3rd page empty
    # prefix 4: its pages under the names a model of the same config but other weights gives them (the engine's
    # salt recipe on a copy of the checkpoint with one weight byte changed)
    other_ckpt = tmp_path / "other-model"
    shutil.copytree(default_model.path(), other_ckpt)
    with open(other_ckpt / "model.safetensors", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 1]))
    model = llm.engine.model
    salt = model_salt(model.config, model.dtype, model.layout.get("fp8", "off"), weights_digest(other_ckpt),
                      store.shape)
    assert salt != store.salt
    other = DirectoryPageStore(store_dir, salt=salt, dtype=store.dtype, shape=store.shape)
    for page in range(5):
        key = page_key(page_hashes(prompts[4][:(page + 1) * PAGE])[page])
        os.makedirs(os.path.dirname(other.file(key)), exist_ok=True)
        os.replace(store.file(key), other.file(key))
    outs = llm.generate(_prompts(1), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    hits = [o.metrics["num_storage_cached_prompt_tokens"] // PAGE for o in outs]
    assert hits == [4, 1, 0, 2, 0]  # up to the first bad page; none of another model's
    stats = llm.cache_stats()
    assert stats["storage_rejected_files"] == 3
    assert stats["storage_bytes"] <= bound + page_bytes


def test_an_unwritable_directory_runs_without_the_tier(written, tmp_path):
    _, _, want, _ = written
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.warns(RuntimeWarning, match="not writable"):
        llm = LLM(kv_cache_dir=blocker / "kv", **OPTIONS)
    # No tier at all: the engine is the one without kv_cache_dir (no reads, no copies, no writes).
    assert llm.engine.kv_store is None and llm.engine.scheduler.storage is None and llm.engine.runner.page_io is None
    assert llm.generate(_prompts(1)[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want[0]
    assert llm.cache_stats()["storage_bytes_written"] == 0


@pytest.mark.parametrize("options, match", [
    (dict(kv_cache_max_bytes=10 ** 9), "needs kv_cache_dir"),
    (dict(kv_cache_dir="/tmp/x", enable_prefix_caching=False), "enable_prefix_caching"),
    (dict(kv_cache_dir="/tmp/x", kv_cache_max_bytes=0), "kv_cache_max_bytes"),
])
def test_bad_options_are_value_errors(options, match):
    from jaxinfer.engine.config import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig(**options)
