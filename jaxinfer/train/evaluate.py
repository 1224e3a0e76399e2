"""Held-out evaluation: cross-entropy and top-1 accuracy of the main model and the MTP module, expert loads, a
unigram baseline, greedy samples.

Held-out windows: the held-out token stream cut into windows of T + 2 tokens every T tokens (data.tiled_windows);
each window scores its T next-token predictions (main) and T second-next-token predictions (MTP), so every
held-out token past the first is a main target exactly once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.models.deepseek import DeepseekForCausalLM
from jaxinfer.train import data
from jaxinfer.train.step import cross_entropy, expert_loads, forward


@dataclasses.dataclass(frozen=True)
class HeldoutMetrics:
    tokens: int  # main-model targets scored
    loss: float  # nats / token, main model
    accuracy: float  # top-1, next token
    mtp_loss: float  # nats / token, MTP module (token after next)
    mtp_accuracy: float  # top-1, token after next
    expert_load: dict[tuple, np.ndarray]  # MoE module path -> int64 [E] tokens routed to each logical expert


def heldout_metrics(model: DeepseekForCausalLM, stream: np.ndarray, seq_len: int, batch: int = 8) -> HeldoutMetrics:
    """Evaluates a single-device (plan None) float32 model on the held-out stream."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, x):
        m = nnx.merge(graphdef, state)
        (logits, mtp_logits, nxt, nxt2), captured = nnx.capture(forward, nnx.Intermediate)(m, x)
        sums = jnp.stack([cross_entropy(logits, nxt).sum(), (logits.argmax(-1) == nxt).sum(),
                          cross_entropy(mtp_logits, nxt2).sum(), (mtp_logits.argmax(-1) == nxt2).sum()])
        return sums, expert_loads(captured)

    windows = data.tiled_windows(stream, seq_len + 2, seq_len)
    totals = np.zeros(4, np.float64)
    loads: dict[tuple, np.ndarray] = {}
    for i in range(0, len(windows), batch):  # the last, partial batch compiles once more
        sums, layer_loads = run(state, jnp.asarray(windows[i: i + batch]))
        totals += np.asarray(sums, np.float64)
        for k, v in layer_loads.items():
            loads[k] = loads.get(k, 0) + np.asarray(v, np.int64)
    n = len(windows) * seq_len
    return HeldoutMetrics(tokens=n, loss=totals[0] / n, accuracy=totals[1] / n, mtp_loss=totals[2] / n,
                          mtp_accuracy=totals[3] / n, expert_load=loads)


def unigram_loss(train_stream: np.ndarray, heldout_stream: np.ndarray, vocab_size: int, seq_len: int) -> float:
    """Cross-entropy (nats / token) of an add-one-smoothed unigram model of the training stream, on the same
    held-out targets as ``heldout_metrics`` (positions 1..T of each held-out window)."""
    counts = np.bincount(train_stream, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    targets = data.tiled_windows(heldout_stream, seq_len + 2, seq_len)[:, 1:-1]
    return float(-logp[targets].mean())


def greedy(logits_fn, prompts: list[list[int]], new_tokens: int, length: int | None = None) -> list[list[int]]:
    """Greedy continuations: logits_fn(int [B, L]) -> [B, L, V] is called on right-padded ids of a fixed length L
    (one compilation; causal, so padding after a row's last token does not change its logits)."""
    length = length or max(len(p) for p in prompts) + new_tokens
    ids = np.zeros((len(prompts), length), np.int32)
    ends = np.array([len(p) for p in prompts])
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    for _ in range(new_tokens):
        logits = np.asarray(logits_fn(ids))
        nxt = logits[np.arange(len(prompts)), ends - 1].argmax(-1)
        ids[np.arange(len(prompts)), ends] = nxt
        ends += 1
    return [ids[b, len(p): ends[b]].tolist() for b, p in enumerate(prompts)]
