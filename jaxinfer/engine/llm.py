"""``jaxinfer.LLM``: vLLM-style offline generation (DESIGN.md "Public contract").

One request's path: prompt -> Tokenizer -> Scheduler (DP rank, prefill / decode steps, pages) -> Runner (one
jitted step over the paged latent cache) -> sampler on device -> Scheduler.update (append, stop checks, pages)
-> IncrementalDecoder (text, stop strings) -> RequestOutput.
"""

from __future__ import annotations

import dataclasses
import itertools
import pathlib
import time
from typing import Any, Sequence as _Seq

import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jaxinfer.engine.runner import Runner, bucket
from jaxinfer.engine.sampler import SamplingTensors, sample, token_counts
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import Sequence
from jaxinfer.engine.tokenizer import IncrementalDecoder, Tokenizer
from jaxinfer.model import load_model


@dataclasses.dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: dict[str, Any]


class LLM:
    """Offline generation on a mesh. Engine options are per DP rank where they count pages or sequences."""

    def __init__(self, model: str | pathlib.Path | None = None, mesh=None, dtype: str | None = None, *,
                 num_kv_pages: int = 512, max_num_seqs: int = 64, max_num_batched_tokens: int = 1024,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 fp8_compute: bool | None = None, seed: int = 0):
        if model is None:
            raise ValueError("the embedded default model is not shipped yet: pass model=<checkpoint directory>")
        for name, value in [("num_kv_pages", num_kv_pages), ("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens)]:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.model_path = str(pathlib.Path(model))
        self.model = load_model(model, mesh=mesh, dtype=dtype or "bfloat16", fp8_compute=fp8_compute)
        config = self.model.config
        self.max_model_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        self.tokenizer = Tokenizer.from_dir(model)
        eos = self.tokenizer.eos_token_id if self.tokenizer else (config.eos_token_ids or (None,))[0]
        self.scheduler = Scheduler(self.model.dp_size, num_kv_pages, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=self.max_model_len,
                                   enable_prefix_caching=enable_prefix_caching, eos_token_id=eos)
        self.runner = Runner(self.model, num_kv_pages)
        self.seed = seed
        self._ids = itertools.count()

    # ---- requests ----------------------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need tokenizer.json beside the checkpoint; pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def generate(self, prompts, sampling_params: SamplingParams | _Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: str | list[str] | list[list[int]]. A bad request (empty, too long, token id outside the
        vocabulary) comes back with finish_reason "error"; the others finish normally."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        params = [p or SamplingParams() for p in params]
        requests, live, seqs_of = [], {}, {}
        start = time.perf_counter()
        for prompt, p in zip(prompts, params):
            text, ids = self._prompt_ids(prompt)
            request = RequestOutput(next(self._ids), text, ids, [], {"arrival": start})
            requests.append(request)
            bad = [t for t in ids if not 0 <= t < self.model.config.vocab_size]
            for child in range(p.n):
                seq = Sequence(next(self._ids), ids, p, child_index=child)
                seqs_of.setdefault(request.request_id, []).append(seq)
                if bad:
                    request.outputs.append(CompletionOutput(child, [], "", "error", f"token id {bad[0]} is outside "
                                                            f"the vocabulary [0, {self.model.config.vocab_size})"))
                    continue
                self.scheduler.add(seq)
                out = CompletionOutput(child, seq.output_token_ids, "", None)
                request.outputs.append(out)
                if seq.is_finished:  # rejected at admission (empty, too long, can never fit)
                    out.finish_reason, out.error = seq.finish_reason, seq.error
                    continue
                decoder = IncrementalDecoder(self.tokenizer, ids) if self.tokenizer else None
                live[seq.seq_id] = (seq, out, request, decoder)
        bar = tqdm(total=len(live), disable=not use_tqdm, desc="generate", unit="seq")
        while self.scheduler.has_unfinished():
            plan = self.scheduler.schedule()
            if plan is None:
                break
            for seq in plan.finished:
                _, out, _, _ = live.pop(seq.seq_id)
                out.finish_reason, out.error = seq.finish_reason, seq.error
                bar.update(1)
            if not plan.num_scheduled_tokens:
                continue
            logits, chunks = self.runner.run(plan)
            tokens = self._sample(logits, [ch.seq for ch in chunks])
            now = time.perf_counter()
            for ch in chunks:
                entry = live[ch.seq.seq_id]
                entry[2].metrics.setdefault("first_token", now)
            for seq in self.scheduler.update(plan, dict(zip((c.seq.seq_id for c in chunks), tokens))):
                self._close(live.pop(seq.seq_id), seq)
                bar.update(1)
            for ch in chunks:  # stop strings (need text)
                if ch.seq.seq_id in live:
                    self._check_stop(live, ch.seq, bar)
        bar.close()
        end = time.perf_counter()
        for request in requests:
            n_out = sum(len(o.token_ids) for o in request.outputs)
            first = request.metrics.pop("first_token", end)
            request.metrics = dict(ttft_s=first - start, tpot_s=(end - first) / max(n_out - 1, 1),
                                   num_prompt_tokens=len(request.prompt_token_ids),
                                   num_cached_prompt_tokens=max(
                                       (q.num_cached_tokens for q in seqs_of.get(request.request_id, [])), default=0),
                                   num_output_tokens=n_out)
        return requests

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them, through the tokenizer's chat
        template (user text never becomes special tokens)."""
        if self.tokenizer is None:
            raise ValueError("chat needs tokenizer.json and a chat template beside the checkpoint")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _sample(self, logits: np.ndarray, seqs: list[Sequence]) -> list[int]:
        rows = bucket(len(seqs))
        params = [s.params for s in seqs]
        kwargs = {}
        if any(p.uses_penalties for p in params):
            kwargs = dict(output_token_counts=token_counts([s.output_token_ids for s in seqs], logits.shape[1], rows),
                          prompt_token_mask=token_counts([s.prompt_token_ids for s in seqs], logits.shape[1],
                                                         rows) > 0)
        pad = [0] * (rows - len(seqs))  # padding rows: greedy, never read
        tensors = SamplingTensors.build(params, logits.shape[1], num_rows=rows,
                                        steps=[s.num_output_tokens for s in seqs] + pad,
                                        request_ids=[s.seq_id for s in seqs] + pad,
                                        child_indices=[s.child_index for s in seqs] + pad,
                                        engine_seed=self.seed, **kwargs)
        padded = np.zeros((rows, logits.shape[1]), np.float32)
        padded[: len(seqs)] = logits
        return [int(t) for t in np.asarray(sample(jnp.asarray(padded), tensors).token_ids)[: len(seqs)]]

    def _close(self, entry, seq: Sequence) -> None:
        _, out, _, decoder = entry
        out.finish_reason, out.error = seq.finish_reason, seq.error
        if decoder is not None:
            self._decode(decoder, seq)
            decoder.finish()
            out.text = decoder.text

    def _decode(self, decoder: IncrementalDecoder, seq: Sequence) -> None:
        for tok in seq.output_token_ids[len(decoder.output_ids):]:
            decoder.add(tok)

    def _check_stop(self, live, seq: Sequence, bar) -> None:
        _, out, _, decoder = live[seq.seq_id]
        if decoder is None or not seq.params.stop:
            return
        self._decode(decoder, seq)
        for stop in seq.params.stop:
            cut = decoder.text.find(stop)
            if cut >= 0:
                self.scheduler.finish(seq, "stop")
                out.finish_reason, out.text = "stop", decoder.text[:cut]
                live.pop(seq.seq_id)
                bar.update(1)
                return
