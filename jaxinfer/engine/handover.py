"""What a prefill engine hands a decode engine (prefill/decode disaggregation; docs/architecture.md "Prefill/decode
disaggregation"): a request whose prompt is computed and whose first token is sampled, with the latents of its
prompt. Pure data but the latents (a device array): everything the decode engine needs to continue the request as
if it had computed the prompt itself (sequence ids, hence sampling keys, outputs, logprobs, timing, what streaming
outputs already returned).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxinfer.engine.outputs import RequestOutputKind, RequestState
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.sequence import Sequence, SequenceStatus


@dataclasses.dataclass(frozen=True)
class ChildHandover:
    """One sample of the request. finish_reason: set when it ended on the prefill engine (its first token was a
    stop, ...); then latents is None. latents: [pages, layers, page_size, width] of positions [0, num_kv_tokens)
    (ModelRunner.gather_pages), on the prefill rank's device until the decode engine admits the request.
    draft_token_ids, draft_probs: the MTP drafts the prefill step proposed after the first token (speculative
    decoding), which the decode engine's first round verifies, as a co-located engine's would."""

    seq_id: int
    output_token_ids: tuple[int, ...]
    logprobs: tuple[dict[int, float], ...] | None
    finish_reason: str | None
    error: str | None
    num_cached_tokens: int
    num_storage_cached_tokens: int
    num_kv_tokens: int
    latents: Any
    sent_tokens: int
    sent_text: int
    draft_token_ids: tuple[int, ...]
    draft_probs: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class Handover:
    """A request moving from the prefill engine to the decode engine."""

    request_id: str
    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    output_kind: RequestOutputKind
    arrival: float
    first_token: float | None
    last_token: float | None
    children: tuple[ChildHandover, ...]

    @property
    def num_latent_bytes(self) -> int:
        return sum(c.latents.nbytes for c in self.children if c.latents is not None)


def handover(request: RequestState, latents: dict[int, Any]) -> Handover:
    """The hand-over of ``request`` (every sample finished or decoding); latents by seq_id of the decoding ones."""
    children = []
    for c in request.completions:
        seq = c.seq
        ends = seq.is_finished
        children.append(ChildHandover(
            seq.seq_id, tuple(seq.output_token_ids), None if c.logprobs is None else tuple(c.logprobs),
            seq.finish_reason if ends else None, seq.error if ends else None, seq.num_cached_tokens,
            seq.num_storage_cached_tokens, 0 if ends else seq.num_computed_tokens, latents.get(seq.seq_id),
            c.sent_tokens, c.sent_text, () if ends else seq.draft_token_ids, () if ends else seq.draft_probs))
    return Handover(request.request_id, request.prompt, tuple(request.prompt_token_ids), request.params,
                    request.output_kind, request.arrival, request.first_token, request.last_token, tuple(children))


def restore(h: Handover, tokenizer) -> RequestState:
    """The decode engine's RequestState of a hand-over: fresh Sequences (not added to a scheduler; the finished
    samples FINISHED and closed) carrying the prefill engine's ids, outputs and counts."""
    seqs = []
    for child, ch in enumerate(h.children):
        seq = Sequence(ch.seq_id, h.prompt_token_ids, h.params, child_index=child)
        seq.output_token_ids = list(ch.output_token_ids)
        seq.num_cached_tokens, seq.num_storage_cached_tokens = ch.num_cached_tokens, ch.num_storage_cached_tokens
        seq.draft_token_ids, seq.draft_probs = ch.draft_token_ids, ch.draft_probs
        seqs.append(seq)
    request = RequestState(h.request_id, h.prompt, list(h.prompt_token_ids), h.params, seqs, tokenizer, h.arrival,
                           h.output_kind)
    request.first_token, request.last_token = h.first_token, h.last_token
    for child, (c, ch) in enumerate(zip(request.completions, h.children)):
        if c.logprobs is not None:
            c.logprobs.extend(ch.logprobs or ())
        c.sent_tokens, c.sent_text = ch.sent_tokens, ch.sent_text
        request.find_stop_string(child)  # decodes the text so far; the prefill engine already acted on a hit
        if ch.finish_reason is not None:
            c.seq.status, c.seq.finish_reason, c.seq.error = SequenceStatus.FINISHED, ch.finish_reason, ch.error
            request.close(child)
    return request
