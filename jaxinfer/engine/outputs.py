"""What the engine returns: ``RequestOutput`` / ``CompletionOutput`` (vLLM's shape), ``EngineStats``, and the engine's
per-request output state (``RequestState``: detokenization, stop strings, logprobs, metrics).

Outputs follow the request's ``RequestOutputKind`` (``LLMEngine.add_request``): CUMULATIVE (everything so far, each
time the request progresses), DELTA (what is new since its last output) or FINAL_ONLY. A completion's text never
shows what a stop string may still cut: while unfinished, the last (longest stop string - 1) characters are held back
(vLLM's rule).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.sequence import PLACEHOLDER, Sequence
from jaxinfer.engine.tokenizer import IncrementalDecoder, Tokenizer


class RequestOutputKind(str, enum.Enum):
    """What ``LLMEngine.step`` returns of a request (vLLM's ``RequestOutputKind``): its whole output so far each
    time it progresses (CUMULATIVE, the default), only what is new since its last output (DELTA), or only its
    finished output (FINAL_ONLY: what ``LLM.generate`` asks for)."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclasses.dataclass
class CompletionOutput:
    """One of a request's n samples. token_ids: its generated tokens; text: their detokenized text (cut before a
    stop string); finish_reason: None while running, then "stop" | "length" | "error" | "abort"; error: the
    message of an "error"; logprobs: per token {token: logprob} (the sampled one included), or None.
    From ``LLM.chat`` (engine/chat_output.py): tool_calls, the calls the model made in OpenAI's shape ({"id",
    "type": "function", "function": {"name", "arguments": JSON text}}) or None; reasoning_content, the text inside
    the model's reasoning markers or None; text is then the rest."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    tool_calls: list[dict] | None = None
    reasoning_content: str | None = None


@dataclasses.dataclass
class RequestOutput:
    """A request's output: all n completions. metrics: ttft_s (first token after add_request), tpot_s (time per
    output token after the first), both None until known; num_prompt_tokens, num_cached_prompt_tokens (served by
    the prefix cache, its storage tier included), num_storage_cached_prompt_tokens (those read from the KV storage
    tier: kv/page_store.py), num_output_tokens (all completions); num_draft_tokens, num_accepted_tokens (speculative
    decoding: drafts verified and accepted, summed over the completions; 0 without)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: dict[str, Any]
    finished: bool = False


# Step records an engine keeps (EngineStats.log_step): a long-running engine's log stays bounded.
STEP_LOG_MAX = 1 << 16


@dataclasses.dataclass
class EngineStats:
    """Counters: steps dispatched, tokens computed (all / in prefill steps), preemptions, prompt and output tokens
    of finished sequences, host time (scheduling, array building, dispatch, result handling) and time spent
    waiting for the device's results.

    Speculative decoding (vLLM's spec-decode metrics): num_drafts, verification rounds of a sequence with at
    least one draft; num_draft_tokens, drafts verified; num_accepted_tokens, drafts accepted (recovered and bonus
    tokens excluded); accepted_per_position[j], rounds whose draft j + 1 was accepted (a list of K counts;
    empty without speculation).

    Prefill/decode disaggregation and load balance: kv_transfer_bytes, latent bytes handed from the prefill engine
    to the decode engine (0 without); step_log, a dict per dispatched step (engine/step_log.py; an engine keeps the
    last STEP_LOG_MAX, LLM.generate's stats those of the call)."""

    steps: int = 0
    scheduled_tokens: int = 0
    prefill_tokens: int = 0
    preemptions: int = 0
    finished_input_tokens: int = 0
    finished_output_tokens: int = 0
    host_s: float = 0.0
    wait_s: float = 0.0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    kv_transfer_bytes: int = 0
    step_log: list[dict] = dataclasses.field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts (vLLM's definition: tokens per verification round); 1.0 without drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def count_round(self, num_drafts: int, num_accepted: int, num_positions: int) -> None:
        """Counts one sequence's verification of ``num_drafts`` drafts (of K = num_positions proposed)."""
        if not num_drafts:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per = list(self.accepted_per_position) or [0] * num_positions  # a new list: copies share none
        for j in range(num_accepted):
            per[j] += 1
        self.accepted_per_position = per

    def log_step(self, record: dict) -> None:
        """Appends a step record, dropping the older half of the log once it holds STEP_LOG_MAX."""
        if len(self.step_log) >= STEP_LOG_MAX:
            del self.step_log[:STEP_LOG_MAX // 2]
        self.step_log.append(record)

    def snapshot(self) -> EngineStats:
        """A copy that later counting leaves as it is (for ``since``)."""
        return dataclasses.replace(self, accepted_per_position=list(self.accepted_per_position),
                                   step_log=list(self.step_log))

    @classmethod
    def combine(cls, *stats: EngineStats) -> EngineStats:
        """The counts of several engines summed (per-position lists elementwise); their step logs merged by
        t_dispatch."""
        def total(name, values):
            if name == "step_log":
                return sorted((r for v in values for r in v), key=lambda r: r["t_dispatch"])
            if isinstance(values[0], list):
                return [sum(v[i] for v in values if i < len(v)) for i in range(max(map(len, values)))]
            return sum(values)

        return cls(**{f.name: total(f.name, [getattr(s, f.name) for s in stats]) for f in dataclasses.fields(cls)})

    def since(self, before: EngineStats) -> EngineStats:
        """The counts accumulated after ``before`` (a ``snapshot`` of an earlier state); the step records logged
        after it."""
        def diff(name, now, then):
            if name == "step_log":
                return now[len(then):] if len(now) >= len(then) else list(now)  # (halved since: all it holds)
            if isinstance(now, list):
                then = then or [0] * len(now)
                return [a - b for a, b in zip(now, then)]
            return now - then

        return EngineStats(**{f.name: diff(f.name, getattr(self, f.name), getattr(before, f.name))
                              for f in dataclasses.fields(self)})


@dataclasses.dataclass
class _Completion:
    seq: Sequence
    decoder: IncrementalDecoder | None
    logprobs: list[dict[int, float]] | None
    stop_at: int | None = None  # text cut by a stop string
    text_ends: list[int] = dataclasses.field(default_factory=list)  # the text's length after each decoded output
    stop_checked: int = 0       # outputs searched for a stop string
    done: bool = False
    text: str = ""              # the final text, once done
    sent_tokens: int = 0        # DELTA: what earlier outputs returned
    sent_text: int = 0


class RequestState:
    """The engine's record of one request: its sequences (one per sample), decoders and timing."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 seqs: list[Sequence], tokenizer: Tokenizer | None, arrival: float,
                 output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE):
        self.request_id = request_id
        self.output_kind = output_kind
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.arrival = arrival
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.completions = [
            _Completion(seq, IncrementalDecoder(tokenizer, prompt_token_ids) if tokenizer else None,
                        None if params.logprobs is None else []) for seq in seqs]
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self.returned_final = False

    @property
    def finished(self) -> bool:
        return all(c.done for c in self.completions)

    def fail(self, error: str) -> None:
        """The request can never run: every completion finishes with "error"."""
        for c in self.completions:
            c.seq.finish_reason, c.seq.error, c.done = "error", error, True

    def tokens_arrived(self, child: int, t: float, logprobs: list[dict[int, float]] | None) -> None:
        """New tokens of completion ``child`` reached the host at time t (their logprobs, if it asked)."""
        c = self.completions[child]
        self.first_token = self.first_token or t
        self.last_token = t
        if c.logprobs is not None and logprobs:
            c.logprobs.extend(logprobs)
        if self.output_kind is not RequestOutputKind.FINAL_ONLY or self.params.stop:
            self._decode(c)

    def find_stop_string(self, child: int) -> int | None:
        """Looks for a stop string in completion ``child``'s text, output by output as if the outputs had arrived
        one at a time; on a hit cuts the text there and returns how many outputs to keep: those up to the one
        that completed the stop string (the caller finishes the sequence with "stop" and drops the rest, which a
        multi-token update (multi-step decode, speculative rounds) brought in the same step). At each output the
        stop strings are tried in order, each over the whole text."""
        c = self.completions[child]
        if c.decoder is None or c.stop_at is not None:
            return None
        self._decode(c)
        text = c.decoder.text
        for i in range(c.stop_checked, len(c.text_ends)):
            before, end = (c.text_ends[i - 1] if i else 0), c.text_ends[i]
            if end == before:  # no new text (a character still incomplete)
                continue
            for stop in self.params.stop:  # none was in the text before this output: a hit ends in its text
                cut = text.find(stop, max(before - len(stop) + 1, 0), end)
                if cut >= 0:
                    c.stop_at = cut
                    return i + 1
        c.stop_checked = len(c.text_ends)
        return None

    def close(self, child: int) -> None:
        """Completion ``child``'s sequence is finished and holds no placeholder: its text is final."""
        c = self.completions[child]
        if c.logprobs is not None:
            del c.logprobs[len(c.seq.output_token_ids):]  # tokens dropped after a stop
        if c.decoder is not None:
            self._decode(c)
            c.decoder.finish()
            c.text = c.decoder.text if c.stop_at is None else c.decoder.text[:c.stop_at]
        c.done = True

    @staticmethod
    def _decode(c: _Completion) -> None:
        outputs, decoder = c.seq.output_token_ids, c.decoder
        if decoder is None:
            return
        for tok in outputs[len(decoder.output_ids):]:
            if tok == PLACEHOLDER:
                break
            decoder.add(tok)
            c.text_ends.append(len(decoder.text))

    # ---- outputs ------------------------------------------------------------------------------------------
    def output(self, now: float) -> RequestOutput | None:
        """The RequestOutput to return now under the request's output_kind (None: nothing to return)."""
        finished = self.finished
        kind = self.output_kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished or self.returned_final:
            return None
        self.returned_final = finished
        outputs = [self._completion(i, c, kind is RequestOutputKind.DELTA) for i, c in enumerate(self.completions)]
        n_out = sum(len(c.seq.output_token_ids) if c.done else _known(c.seq) for c in self.completions)
        first, last = self.first_token, (now if finished else self.last_token)
        if first is None:
            tpot = None
        elif finished:
            tpot = (last - first) / max(n_out - 1, 1)
        else:
            tpot = (last - first) / (n_out - 1) if n_out > 1 else None
        metrics = dict(ttft_s=None if first is None else first - self.arrival, tpot_s=tpot,
                       num_prompt_tokens=len(self.prompt_token_ids),
                       num_cached_prompt_tokens=max(c.seq.num_cached_tokens for c in self.completions),
                       num_storage_cached_prompt_tokens=max(c.seq.num_storage_cached_tokens
                                                            for c in self.completions),
                       num_output_tokens=n_out,
                       num_draft_tokens=sum(c.seq.num_draft_tokens for c in self.completions),
                       num_accepted_tokens=sum(c.seq.num_accepted_tokens for c in self.completions))
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outputs, metrics, finished)

    def _completion(self, index: int, c: _Completion, delta: bool) -> CompletionOutput:
        if c.done:
            tokens, text = list(c.seq.output_token_ids), c.text
        else:
            tokens = c.seq.output_token_ids[:_known(c.seq)]
            text = c.decoder.text if c.decoder is not None else ""
            if self.params.stop:
                text = text[:max(len(text) - self._holdback, 0)]
        logprobs = None if c.logprobs is None else c.logprobs[:len(tokens)]
        if delta:
            tokens, text = tokens[c.sent_tokens:], text[c.sent_text:]
            logprobs = None if logprobs is None else logprobs[c.sent_tokens:]
            c.sent_tokens, c.sent_text = c.sent_tokens + len(tokens), c.sent_text + len(text)
        return CompletionOutput(index, tokens, text, c.seq.finish_reason if c.done else None,
                                c.seq.error if c.done else None, logprobs)


def _known(seq: Sequence) -> int:
    """The outputs of a sequence whose values are known (placeholders are trailing)."""
    return seq.num_output_tokens - seq.num_placeholders
