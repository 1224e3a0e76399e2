"""Tokenization of one long text and of many prompts, sequential vs parallel (issue: the chat protocol layer;
docs/benchmarks.md "Tokenization").

    python benchmarks/tokenization.py [--tokens 100000] [--prompts 1000] [--repeats 7]

Text: Python's own `pydoc_data.topics` (no network), cut to about --tokens tokens of the embedded model's tokenizer;
prompts: --prompts consecutive 300-character slices of it. Sequential: `tokenizers`' encode of the whole text, and
one encode per prompt; parallel: jaxinfer's Tokenizer.encode (the text cut where its tokenization does not change,
engine/text_chunks.py, pieces encoded as one batch) and Tokenizer.encode_batch. Both give the same ids (checked);
the best of --repeats runs is printed. `tokenizers` runs a batch on every core (2 on the CPU machine), in threads
that jaxinfer starts before it limits glibc's malloc arenas (jaxinfer/host_memory.py); JAXINFER_MALLOC=default
leaves malloc alone.
"""

from __future__ import annotations

import argparse
import os
import time

import pydoc_data.topics

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
    print(f"cores {os.cpu_count()}, malloc {os.environ.get('JAXINFER_MALLOC', 'tuned')}")
    seq, want = best_ms(lambda: tok._tok.encode(text).ids, args.repeats)
    par, got = best_ms(lambda: tok.encode(text), args.repeats)
    assert got == want
    print(f"one text of {len(want)} tokens ({len(text)} characters): sequential {seq:.1f} ms, parallel {par:.1f} ms "
          f"({seq / par:.2f}x)")
    seq, want = best_ms(lambda: [tok._tok.encode(p).ids for p in prompts], args.repeats)
    par, got = best_ms(lambda: tok.encode_batch(prompts), args.repeats)
    assert got == want
    print(f"{len(prompts)} prompts of 300 characters: sequential {seq:.1f} ms, parallel {par:.1f} ms "
          f"({seq / par:.2f}x)")


if __name__ == "__main__":
    main()
