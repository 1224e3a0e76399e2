"""Communication accounting for expert-parallel MoE: dispatch and combine bytes of one forward step.

Counted from the routing of an actual batch (the ``tokens_sent`` counts each MoE layer records), not from the
compiled HLO. Two figures per direction:

- payload: what DeepEP would move: each token once to each *other* expert rank that holds one of its experts,
  H e4m3 bytes + 4 * ceil(H/128) scale bytes (FP8 dispatch) or H * itemsize (BF16/F32), and H * itemsize back
  (combine in the model dtype). Per-token routing metadata (K ids + K weights) is counted separately.
- buffer: what jaxinfer's fixed-capacity ``all_to_all`` moves on CPU: [R, N, H] per device whatever the routing
  (docs/architecture.md "Mesh semantics": worst-case buffers, nothing dropped); the local peer's slice never
  leaves the device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.parallel.dispatch import QUANT_GROUP
from jaxinfer.parallel.multihost import to_host


@dataclasses.dataclass(frozen=True)
class CommStats:
    tokens: int  # token rows in the step (the batch padded to the DP size)
    moe_layers: int
    expert_ranks: int
    fp8_dispatch: bool
    remote_token_sends: int  # (token, other expert rank) pairs, summed over MoE layers
    dispatch_payload_bytes: int
    combine_payload_bytes: int
    metadata_bytes: int
    dispatch_buffer_bytes: int
    combine_buffer_bytes: int

    @property
    def dispatch_bytes_per_send(self) -> float:
        return self.dispatch_payload_bytes / max(self.remote_token_sends, 1)

    def summary(self) -> str:
        per_tok = lambda b: b / max(self.tokens * self.moe_layers, 1)  # noqa: E731
        return (f"{self.tokens} tokens x {self.moe_layers} MoE layers over {self.expert_ranks} expert ranks, "
                f"{'FP8' if self.fp8_dispatch else 'model-dtype'} dispatch: "
                f"{self.dispatch_bytes_per_send:.0f} B per remote token send; per token per layer: dispatch "
                f"{per_tok(self.dispatch_payload_bytes):.0f} B, combine {per_tok(self.combine_payload_bytes):.0f} B "
                f"(fixed-capacity buffers: {per_tok(self.dispatch_buffer_bytes):.0f} B / "
                f"{per_tok(self.combine_buffer_bytes):.0f} B)")


def tokens_sent(model, token_ids) -> list[np.ndarray]:
    """Per MoE layer, int [devices, R]: tokens each DP rank sent to each expert rank for this batch."""
    if model.plan is None:
        raise ValueError("communication accounting needs a mesh (the model has no ParallelPlan)")
    graphdef = model.graphdef

    @jax.jit
    def run(state, ids):
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        _, captured = nnx.capture(nnx.merge(graphdef, state), nnx.Intermediate)(ids, positions)
        flat = sorted(nnx.to_flat_state(captured), key=lambda kv: kv[0])  # layer order
        return [value for _, value in flat]

    ids = model.check_token_ids(token_ids)
    counts = run(model.state, model._shard_batch(ids)[0])
    shape = (model.mesh.size, model.mesh.shape["expert"])
    return [to_host(c[0]).reshape(shape) for c in counts]  # sow keeps a 1-tuple per layer


def comm_stats(model, token_ids) -> CommStats:
    """Dispatch / combine bytes of one forward over ``token_ids`` [B, T] on the model's mesh."""
    sent = tokens_sent(model, token_ids)
    mesh, c = model.mesh, model.config
    ranks, devices = mesh.shape["expert"], mesh.size
    h, k = c.hidden_size, c.num_experts_per_tok
    itemsize = np.dtype(model.dtype).itemsize
    own_rank = np.arange(devices) % ranks  # device (d, e) is DP rank d*E + e and expert rank e
    remote = sum(int(s.sum() - s[np.arange(devices), own_rank].sum()) for s in sent)
    tokens = int(np.ceil(np.asarray(token_ids).shape[0] / devices) * devices * np.asarray(token_ids).shape[1])
    per_send = (h + 4 * -(-h // QUANT_GROUP)) if model.plan.fp8_dispatch else h * itemsize
    local_rows = tokens // devices  # N per device
    off_device = devices * (ranks - 1) * local_rows * len(sent)  # buffer rows that leave their device
    return CommStats(
        tokens=tokens, moe_layers=len(sent), expert_ranks=ranks, fp8_dispatch=model.plan.fp8_dispatch,
        remote_token_sends=remote, dispatch_payload_bytes=remote * per_send,
        combine_payload_bytes=remote * h * itemsize, metadata_bytes=remote * k * 8,
        dispatch_buffer_bytes=off_device * per_send, combine_buffer_bytes=off_device * h * itemsize)
