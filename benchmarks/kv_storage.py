"""Time to first token of a long shared prefix read from the KV storage tier vs computed, and the tier's read
bandwidth against the disk's own (issue: the KV cache storage tier; docs/benchmarks.md "KV storage tier (CPU)").

    python benchmarks/kv_storage.py [--shapes embedded,bench] [--prefix-lens 256,512,1024,2048,4032]
        [--suffix-len 16] [--rounds 3] [--dtype DTYPE]

Per shape (``embedded``: the embedded default model; the others bench_model.py's SHAPES, random weights) and
prefix length L: a writer engine stores the pages of prompts of L random tokens + --suffix-len more; a second
engine (a fresh LLM on the same directory, as a later process would be) then runs, per round, one prompt whose
prefix the tier holds ("storage") and one it does not ("recompute"), each a first of its kind (no device prefix
cache hit), alternating; one warm-up of each kind first (compilation; then the programs compiled ahead are
waited for). TTFT = the request's ``ttft_s`` of a
``generate(max_tokens=1)``; medians over the rounds. Read bandwidth: the tier's page files of one prefix read and
verified (``DirectoryPageStore.get``, page cache warm: the engine's case right after a write) and the same files
read cold (``posix_fadvise(DONTNEED)`` first: from the disk), in MB/s.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="embedded,bench")
    p.add_argument("--prefix-lens", default="256,512,1024,2048,4032",
                   help="prefix lengths (those that do not fit the model's positions with the suffix are skipped)")
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default=None, help="the engine's dtype (default: LLM's, bfloat16)")
    args = p.parse_args()
    lens = [int(n) for n in args.prefix_lens.split(",")]
    for shape in args.shapes.split(","):
        run_shape(shape, lens, args)


def _checkpoint(shape: str, tmp: str) -> str:
    if shape == "embedded":
        from jaxinfer import default_model

        return str(default_model.path())
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_model import build_reference

    _, ref = build_reference(2, shape=shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref.save_pretrained(tmp)
    return tmp


def run_shape(shape: str, lens: list[int], args) -> None:
    from jaxinfer import LLM, SamplingParams
    from jaxinfer.kv.page_store import page_key
    from jaxinfer.kv.prefix_cache import page_hashes

    ckpt_dir = tempfile.TemporaryDirectory()
    store_dir = tempfile.TemporaryDirectory(dir=os.environ.get("KV_BENCH_DIR"))
    path = _checkpoint(shape, ckpt_dir.name)
    options = dict(max_num_seqs=4, max_num_batched_tokens=max(lens) + args.suffix_len,
                   **({"dtype": args.dtype} if args.dtype else {}))
    first = SamplingParams(temperature=0, max_tokens=1)
    rng = np.random.default_rng(0)
    writer = LLM(path, kv_cache_dir=store_dir.name, **options)
    vocab = writer.model.config.vocab_size
    max_len = writer.config.max_model_len
    lens = [n for n in lens if n + args.suffix_len + 1 <= max_len]
    prompts = {n: [rng.integers(0, vocab, n + args.suffix_len).tolist() for _ in range(2 * (args.rounds + 1))]
               for n in lens}
    for n in lens:  # the even prompts of each length are stored; the odd ones are not
        writer.generate(prompts[n][0::2], first, use_tqdm=False)
    writer.cache_stats()  # waits for the writes
    store = writer.engine.kv_store
    print(f"{shape}: {writer.model.config.num_hidden_layers} layers, {writer.config.dtype}, page file "
          f"{store.page_bytes / 1e3:.1f} kB ({store.shape} {store.dtype.name}), suffix {args.suffix_len} tokens, "
          f"median of {args.rounds} alternating rounds", flush=True)
    del writer
    reader = LLM(path, kv_cache_dir=store_dir.name, **options)
    for n in lens:
        ttft = {"storage": [], "recompute": []}
        hits = []
        for r in range(args.rounds + 1):  # round 0: warm-up (compilation)
            if r == 1:
                reader.wait_for_compilations()  # the prefill block counts compiled ahead: not during the rounds
            for kind, prompt in (("storage", prompts[n][2 * r]), ("recompute", prompts[n][2 * r + 1])):
                out = reader.generate([prompt], first, use_tqdm=False)[0]
                if r:
                    ttft[kind].append(out.metrics["ttft_s"])
                    if kind == "storage":
                        hits.append(out.metrics["num_storage_cached_prompt_tokens"])
        pages = [page_key(h) for h in page_hashes(prompts[n][0][:n])]
        warm_mb_s, cold_mb_s = _read_bandwidth(reader.engine.kv_store, pages)
        s, c = statistics.median(ttft["storage"]), statistics.median(ttft["recompute"])
        print(f"  prefix {n:5d}: TTFT from storage {s * 1e3:8.1f} ms (hits {min(hits)}-{max(hits)} tokens), "
              f"recomputed {c * 1e3:8.1f} ms -> {c / s:5.2f}x; reading {len(pages)} pages: "
              f"{warm_mb_s:7.0f} MB/s (page cache), {cold_mb_s:7.0f} MB/s (disk)", flush=True)
    store_dir.cleanup()
    ckpt_dir.cleanup()


def _read_bandwidth(store, keys: list[bytes]) -> tuple[float, float]:
    """MB/s of ``store.get`` over ``keys`` (read + verify), page cache warm, then cold (min of 3 each)."""
    files = [store.file(k) for k in keys]
    total = sum(os.path.getsize(f) for f in files)

    def timed(cold: bool) -> float:
        best = float("inf")
        for _ in range(3):
            if cold:
                for f in files:
                    fd = os.open(f, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages leave the page cache
                    os.close(fd)
            t0 = time.perf_counter()
            for k in keys:
                assert store.get(k) is not None
            best = min(best, time.perf_counter() - t0)
        return total / best / 1e6

    return timed(False), timed(True)


if __name__ == "__main__":
    main()
