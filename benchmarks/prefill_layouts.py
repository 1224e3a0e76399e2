"""One layer's prefill attention on CPU in the two step layouts: today's [rows, T] grid (a chunk per row, right
aligned; jaxinfer/models/attention.py cached_and_new_attention) against query blocks of Q columns
(kernels_pallas/mla/query_blocks.py; a chunk over ceil(n / Q) rows, block tables of a fixed width), on the same
chunks. Both are checked against each other first.

    python benchmarks/prefill_layouts.py [--dims bench,v2lite] [--blocks 16,64] [--max-pages 64] [--repeats 15]

Scenarios (cached tokens, new tokens per chunk): fresh prompts of one 1024-token chunk, 4 x 256, 16 x 64; prefix-hit
tails (16 chunks of 8-64 tokens after 192-320 cached); a 1024-token chunk after 3072 cached; a mixed step. dims:
the attention of bench_model.SHAPES' "bench" (8 heads, latent 128 + rope 32) and "v2lite" (16 heads, 512 + 64).
Prints the median ms of calls under calibration.median_seconds and the number of rows each layout computes.
"""

from __future__ import annotations

import argparse

from calibration import median_seconds

DIMS = {"bench": (8, 128, 32), "v2lite": (16, 512, 64)}  # heads, latent, rope
PAGE = 64


def scenarios(rng) -> dict[str, list[tuple[int, int]]]:
    tails = [(int(c), int(n)) for c, n in zip(rng.integers(192, 321, 16), rng.integers(8, 65, 16))]
    return {"1 x 1024 fresh": [(0, 1024)], "4 x 256 fresh": [(0, 256)] * 4, "16 x 64 fresh": [(0, 64)] * 16,
            "16 prefix-hit tails": tails, "1024 after 3072 cached": [(3072, 1024)],
            "mixed": [(0, 500), (0, 9), (300, 200), (0, 64), (128, 37), (0, 150)]}


def bucket(n: int, minimum: int = 1) -> int:
    return 1 << (max(n, minimum) - 1).bit_length()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", default="bench,v2lite")
    p.add_argument("--blocks", default="16,64", help="query block widths Q")
    p.add_argument("--max-pages", type=int, default=64, help="the block layout's fixed block-table width")
    args = p.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.models.attention import CHUNK_TOKENS, cached_and_new_attention
    from kernels_pallas.mla.query_blocks import query_block_attention

    rows_fn = jax.jit(cached_and_new_attention, static_argnames=("head_dim_v", "softmax_scale"))
    blocks_fn = jax.jit(query_block_attention, static_argnames=("head_dim_v", "softmax_scale", "chunk_pages",
                                                               "blocks_per_step"))
    rng = np.random.default_rng(0)
    for dims in args.dims.split(","):
        heads, latent, rope = DIMS[dims]
        d = latent + rope
        for name, chunks in scenarios(rng).items():
            pages_per = [-(-(c + n) // PAGE) for c, n in chunks]
            cache = jnp.asarray(rng.standard_normal((1 + sum(pages_per), PAGE, 1, d)), jnp.float32)
            tables, first = [], 1
            for n_pages in pages_per:
                tables.append(list(range(first, first + n_pages)))
                first += n_pages
            new = [rng.standard_normal((n, d)).astype(np.float32) for _, n in chunks]
            q = [rng.standard_normal((n, heads, d)).astype(np.float32) for _, n in chunks]
            # [rows, T] grid
            rows, t = bucket(len(chunks)), bucket(max(n for _, n in chunks), 16)
            g_q = np.zeros((rows, t, heads, d), np.float32)
            g_new = np.zeros((rows, t, d), np.float32)
            g_slots = np.full((rows, t), -1, np.int32)
            g_table = np.zeros((rows, bucket(max(pages_per), 2)), np.int32)
            g_len = np.zeros(rows, np.int32)
            for i, ((c, n), tab) in enumerate(zip(chunks, tables)):
                g_q[i, t - n:], g_new[i, t - n:] = q[i], new[i]
                g_slots[i, t - n:] = 1  # any slot >= 0: a real token (nothing is written here)
                g_table[i, :len(tab)] = tab
                g_len[i] = c + n
            grid = [jnp.asarray(x) for x in (g_q, g_new)] + [cache] + [jnp.asarray(x) for x in
                                                                        (g_table, g_len, g_slots)]
            kw = dict(head_dim_v=latent, softmax_scale=0.1)
            ref = np.asarray(rows_fn(*grid, **kw))
            ref = [ref[i, t - n:] for i, (_, n) in enumerate(chunks)]
            ms = median_seconds(lambda *a: rows_fn(*a, **kw), grid) * 1e3
            line = f"{dims:7s} {name:24s} grid [{rows}, {t}]: {ms:8.2f} ms"
            for width in (int(w) for w in args.blocks.split(",")):
                nb = [-(-n // width) for _, n in chunks]
                blocks = bucket(sum(nb))
                b_q = np.zeros((blocks, width, heads, d), np.float32)
                b_new = np.zeros((blocks, width, d), np.float32)
                b_valid = np.zeros((blocks, width), bool)
                b_table = np.zeros((blocks, args.max_pages), np.int32)
                b_cached = np.zeros(blocks, np.int32)
                b_first = np.arange(blocks, dtype=np.int32)
                row = 0
                for i, ((c, n), tab) in enumerate(zip(chunks, tables)):
                    span = nb[i] * width
                    flat_q = np.zeros((span, heads, d), np.float32)
                    flat_new = np.zeros((span, d), np.float32)
                    flat_q[span - n:], flat_new[span - n:] = q[i], new[i]
                    b_q[row:row + nb[i]] = flat_q.reshape(nb[i], width, heads, d)
                    b_new[row:row + nb[i]] = flat_new.reshape(nb[i], width, d)
                    b_valid[row:row + nb[i]] = (np.arange(span) >= span - n).reshape(nb[i], width)
                    b_table[row:row + nb[i], :len(tab)] = tab
                    b_cached[row:row + nb[i]] = c
                    b_first[row:row + nb[i]] = row
                    row += nb[i]
                args_b = [jnp.asarray(x) for x in (b_q, b_new, b_valid)] + [cache] + [
                    jnp.asarray(x) for x in (b_table, b_cached, b_first)]
                kw_b = dict(kw, chunk_pages=CHUNK_TOKENS // PAGE, blocks_per_step=max(1, CHUNK_TOKENS // width))
                out = np.asarray(blocks_fn(*args_b, **kw_b)[0])
                row = 0
                for i, (_, n) in enumerate(chunks):
                    got = out[row:row + nb[i]].reshape(nb[i] * width, heads, latent)[nb[i] * width - n:]
                    np.testing.assert_allclose(got, ref[i], rtol=2e-4, atol=2e-4)
                    row += nb[i]
                ms = median_seconds(lambda *a: blocks_fn(*a, **kw_b)[0], args_b) * 1e3
                line += f" | Q={width} [{blocks}, {width}]: {ms:8.2f} ms"
            print(line, flush=True)


if __name__ == "__main__":
    main()
