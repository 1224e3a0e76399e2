"""Runner: turns a scheduler StepPlan into padded, bucketed device arrays and runs one jitted model step over
the paged latent cache (DeepseekForCausalLM.forward_paged -> kernels_pallas.mla_decode).

Layout of a step (every device is a DP rank; rank r owns rows [r * rows, (r + 1) * rows)): a chunk of n tokens
sits at the END of its row of T columns, so that mla_decode's causal rule (query i sees keys < seqlen - T + i + 1)
holds for every real token; padding columns write nothing (slot -1) and padding rows see no keys. Shapes are
bucketed to powers of two (rows per rank, T, pages per row) so the number of compilations stays bounded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxinfer.engine.scheduler import StepPlan
from jaxinfer.kv.paged_cache import init_paged_cache
from jaxinfer.parallel.dispatch import BATCH_AXES
from jaxinfer.parallel.multihost import global_array, to_host


def bucket(n: int, minimum: int = 1) -> int:
    """The next power of two >= max(n, minimum)."""
    return 1 << (max(n, minimum) - 1).bit_length()


class Runner:
    """Holds the model's paged latent cache (per layer [R * pages_per_rank, 64, 1, C+R]) and runs steps."""

    def __init__(self, model, num_pages_per_rank: int, page_size: int = 64):
        self.model = model
        self.page_size = page_size
        self.ranks = model.dp_size
        self.layers = init_paged_cache(model.config, num_pages_per_rank, model.dtype, mesh=model.mesh,
                                       page_size=page_size).layers
        self._batch = NamedSharding(model.mesh, P(BATCH_AXES))

    @functools.cached_property
    def _step(self):
        graphdef = self.model.graphdef

        @functools.partial(jax.jit, donate_argnums=1)
        def step(state, layers, ids, positions, block_table, seqlens, slots):
            logits, layers = nnx.merge(graphdef, state).forward_paged(ids, positions, layers, block_table, seqlens,
                                                                      slots)
            return logits[:, -1], layers  # the last column holds each row's last real token

        return step

    def arrays(self, plan: StepPlan) -> tuple[list[np.ndarray], list[tuple[int, object]]]:
        """Host arrays of one step and the (row, chunk) of every chunk that samples."""
        rows = bucket(max(len(c) for c in plan.chunks))
        t = bucket(max((ch.num_tokens for c in plan.chunks for ch in c), default=1))
        pages = bucket(max((len(ch.seq.pages) for c in plan.chunks for ch in c), default=1))
        n_rows = self.ranks * rows
        ids = np.zeros((n_rows, t), np.int32)
        positions = np.zeros((n_rows, t), np.int32)
        slots = np.full((n_rows, t), -1, np.int32)
        block_table = np.zeros((n_rows, pages), np.int32)  # page 0: each rank's null page
        seqlens = np.zeros((n_rows,), np.int32)
        sampled = []
        for rank, chunks in enumerate(plan.chunks):
            for i, ch in enumerate(chunks):
                row, n = rank * rows + i, ch.num_tokens
                pos = np.arange(ch.start, ch.start + n, dtype=np.int32)
                ids[row, t - n:] = ch.seq.token_ids(ch.start, ch.start + n)
                positions[row, t - n:] = pos
                seq_pages = np.asarray(ch.seq.pages, np.int32)
                slots[row, t - n:] = seq_pages[pos // self.page_size] * self.page_size + pos % self.page_size
                block_table[row, : len(seq_pages)] = seq_pages
                seqlens[row] = ch.start + n
                if ch.sample:
                    sampled.append((row, ch))
        return [ids, positions, block_table, seqlens, slots], sampled

    def run(self, plan: StepPlan) -> tuple[np.ndarray, list]:
        """Runs one step; returns (float32 logits [num sampled chunks, V], the sampled chunks in that order)."""
        host, sampled = self.arrays(plan)
        args = [global_array(a, self._batch) for a in host]
        logits, self.layers = self._step(self.model.state, self.layers, *args)
        rows = np.asarray([row for row, _ in sampled], np.int64)
        return to_host(logits)[rows], [ch for _, ch in sampled]
