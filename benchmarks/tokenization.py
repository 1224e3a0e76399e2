"""Tokenization of one long text and of many prompts, sequential vs parallel (issue: the chat protocol layer;
docs/benchmarks.md "Tokenization").

    python benchmarks/tokenization.py [--tokens 100000] [--prompts 1000] [--repeats 7]

Text: Python's own `pydoc_data.topics` (no network), cut to about --tokens tokens of the embedded model's tokenizer;
prompts: --prompts consecutive 300-character slices of it. Sequential: `tokenizers`' encode of the whole text, and
one encode per prompt; jaxinfer's Tokenizer.encode / encode_batch with `parallel` off (the same) and on (the text
cut where its tokenization does not change, engine/text_chunks.py, and the pieces or prompts encoded on every
core: in worker processes where malloc is limited to one arena, jaxinfer/host_memory.py's default, on which
tokenizers' threads would queue; on tokenizers' thread pool with JAXINFER_MALLOC=default). All give the same ids
(checked); the best of --repeats runs is printed (the workers start in the first).
"""

from __future__ import annotations

import argparse
import os
import time

import pydoc_data.topics

from jaxinfer import host_memory
from jaxinfer.default_model import path as default_model_path
from jaxinfer.engine.tokenizer import Tokenizer


def best_ms(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    tok = Tokenizer.from_dir(str(default_model_path()))
    corpus = "\n".join(pydoc_data.topics.topics.values())
    text = corpus[:int(len(corpus) * args.tokens / len(tok._tok.encode(corpus).ids))]
    prompts = [corpus[i * 300:(i + 1) * 300] for i in range(args.prompts)]
    print(f"cores {os.cpu_count()}, malloc {'one arena (jaxinfer tuned)' if host_memory.ONE_ARENA else 'default'},"
          f" Tokenizer.parallel {tok.parallel}")
    for name, sequential, ours in [
            (f"one text of {len(tok._tok.encode(text).ids)} tokens ({len(text)} characters)",
             lambda: tok._tok.encode(text).ids, lambda: tok.encode(text)),
            (f"{len(prompts)} prompts of 300 characters",
             lambda: [tok._tok.encode(p).ids for p in prompts], lambda: tok.encode_batch(prompts))]:
        seq, want = best_ms(sequential, args.repeats)
        par = {}
        for parallel in (False, True):
            tok.parallel = parallel
            par[parallel], got = best_ms(ours, args.repeats)
            assert got == want
        print(f"{name}: sequential {seq:.1f} ms; Tokenizer parallel off {par[False]:.1f} ms, on {par[True]:.1f} ms "
              f"({seq / par[True]:.2f}x)")

if __name__ == "__main__":
    main()
