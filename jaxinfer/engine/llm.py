"""``jaxinfer.LLM``: vLLM-style offline generation (DESIGN.md "Public contract").

One request's path: prompt -> Tokenizer -> Scheduler (DP rank, prefill / decode steps, pages) -> Runner (one
jitted step over the paged latent cache, sampler included) -> Scheduler.commit / resolve (append, stop checks,
pages) -> IncrementalDecoder (text, stop strings) -> RequestOutput.

The loop overlaps host and device (vLLM v1's async scheduling): step n+1 is scheduled and dispatched while step n
runs; its sequences' newest tokens are read on device from step n's outputs (runner.py), and step n's tokens are
brought to the host afterwards. A step whose rows use penalties waits for the previous tokens first.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import pathlib
import time
from typing import Any, Sequence as _Seq

import jax
import numpy as np
from tqdm.auto import tqdm

from jaxinfer import default_model
from jaxinfer.compile_cache import enable_compilation_cache
from jaxinfer.engine.runner import Runner
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.scheduler import Scheduler
from jaxinfer.engine.sequence import PLACEHOLDER, Sequence, SequenceStatus
from jaxinfer.engine.tokenizer import IncrementalDecoder, Tokenizer
from jaxinfer.kv.page_allocator import PAGE_SIZE
from jaxinfer.kv.paged_cache import default_num_pages
from jaxinfer.model import load_model
from jaxinfer.rebalance import rebalance_model


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


# Decode iterations per decode step on CPU. A batch-1 decode step of the benchmark model costs about 1 ms of host
# CPU time (arrays, transfer, dispatch, bookkeeping), which on 2 cores comes out of the device's threads: 3.2-3.5
# ms per float32 token with 1 iteration per step, 2.6-2.9 ms with 4 or 8 (docs/benchmarks.md,
# benchmarks/generate_vs_transformers.py --num-scheduler-steps K); 8 leaves the host about 5% of a token.
DEFAULT_SCHEDULER_STEPS = 8


def default_greedy_screening(model) -> bool:
    """greedy_screening's default: on for a float32 model on CPU, where the int8 screen reads a quarter of the
    head's bytes (the benchmark model's float32 batch-1 token: 2.20 -> 1.91 ms, medians of 21 alternating
    replays of the captured decode step; docs/benchmarks.md). Off for bf16, where the screen's int8
    matrix-vector product costs about what the bf16 head's does on this CPU (1.40 without, 1.43 ms with it), and
    on GPU (not measured)."""
    return jax.default_backend() == "cpu" and np.dtype(model.dtype) == np.float32


class LLM:
    """Offline generation on a mesh. Engine options are per DP rank where they count pages or sequences.

    num_kv_pages: KV pages of 64 tokens per DP rank; None = what fits in 90% of a device's free memory (a
    quarter of the available host memory shared by the local devices on CPU), at most enough for max_num_seqs
    sequences of max_model_len tokens. max_logprobs: the largest ``SamplingParams.logprobs`` accepted (vLLM's
    default 20).

    Expert load balancing (DeepSeek's EPLB): num_redundant_experts extra expert slots per MoE layer (None: the
    checkpoint's; the slots must split evenly over the mesh's `expert` axis); ``expert_load()`` counts the tokens
    each logical expert received over the last expert_load_window engine steps (a multi-step decode step, see
    num_scheduler_steps, is one); ``rebalance_experts()``
    re-places the experts from those counts, and rebalance_every_n_steps (None = never) does so automatically,
    between steps, every that many steps.

    num_scheduler_steps: decode iterations per decode step (vLLM's multi-step scheduling): the device computes up
    to that many tokens of every decoding sequence in one program, so the host's work per step (scheduling,
    building and transferring the step's arrays, the dispatch, applying the tokens) is paid once per that many
    tokens. Outputs do not change. A step ends early once every row has reached max_tokens or sampled a stop
    token (EOS, stop_token_ids); a sequence that stops while others go on wastes the rest of its iterations. None:
    DEFAULT_SCHEDULER_STEPS on CPU (the XLA path), 1 on GPU (the Pallas path; not measured there yet).

    greedy_screening: greedy decode steps of one sequence per DP rank (no penalties, no logprobs) find each
    token's largest logit through an int8 copy of the LM head and recompute only the few rows that could win in
    float32 (models/screened_head.py): the same tokens, a quarter of a float32 head's bytes read per token
    (memory-bound on CPU), at the cost of that copy (V x D bytes). None: ``default_greedy_screening``.

    compilation_cache: JAX's persistent compilation cache, so that a later process skips compiling the engine's
    programs (vLLM keeps its compiled graphs by default too): None keeps the cache directory JAX already has and
    otherwise uses $JAX_COMPILATION_CACHE_DIR or ~/.cache/jaxinfer/jax; a path uses that; "off" leaves JAX's
    configuration alone. JAX's cache is process-wide: it then caches the caller's own programs too."""

    def __init__(self, model: str | pathlib.Path | None = None, mesh=None, dtype: str | None = None, *,
                 num_kv_pages: int | None = None, max_num_seqs: int = 64, max_num_batched_tokens: int = 1024,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 fp8_compute: bool | None = None, seed: int = 0, max_logprobs: int = 20,
                 num_redundant_experts: int | None = None, expert_load_window: int = 1000,
                 rebalance_every_n_steps: int | None = None, num_scheduler_steps: int | None = None,
                 greedy_screening: bool | None = None, compilation_cache: str | None = None):
        enable_compilation_cache(compilation_cache)  # before anything compiles
        if model is None:
            model = default_model.path()
        positive = [("num_kv_pages", 2 if num_kv_pages is None else num_kv_pages),
                    ("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                    ("max_logprobs", max_logprobs + 1), ("expert_load_window", expert_load_window),
                    ("num_scheduler_steps", 1 if num_scheduler_steps is None else num_scheduler_steps),
                    ("rebalance_every_n_steps", 1 if rebalance_every_n_steps is None else rebalance_every_n_steps)]
        for name, value in positive:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if greedy_screening is not None and not isinstance(greedy_screening, bool):
            raise ValueError(f"greedy_screening must be True, False or None, got {greedy_screening!r}")
        if num_redundant_experts is not None and (not isinstance(num_redundant_experts, int)
                                                  or num_redundant_experts < 0):
            raise ValueError(f"num_redundant_experts must be an integer >= 0, got {num_redundant_experts!r}")
        if num_scheduler_steps is None:
            num_scheduler_steps = 1 if jax.default_backend() == "gpu" else DEFAULT_SCHEDULER_STEPS
        self.model_path = str(pathlib.Path(model))
        self.model = load_model(model, mesh=mesh, dtype=dtype or "bfloat16", fp8_compute=fp8_compute,
                                num_redundant_experts=num_redundant_experts)
        config = self.model.config
        self.max_model_len = min(max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        if num_kv_pages is None:
            num_kv_pages = default_kv_pages(self.model, max_num_seqs, self.max_model_len)
        self.tokenizer = Tokenizer.from_dir(model)
        eos = self.tokenizer.eos_token_id if self.tokenizer else (config.eos_token_ids or (None,))[0]
        self.scheduler = Scheduler(self.model.dp_size, num_kv_pages, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens, max_model_len=self.max_model_len,
                                   enable_prefix_caching=enable_prefix_caching, eos_token_id=eos,
                                   num_scheduler_steps=num_scheduler_steps)
        self.runner = Runner(self.model, num_kv_pages, max_num_seqs=max_num_seqs,
                             prefill_capacity=self.scheduler.prefill_capacity,
                             min_prefill_t=self.scheduler.min_prefill_t, engine_seed=seed,
                             max_logprobs=max_logprobs, expert_load_window=expert_load_window,
                             num_scheduler_steps=num_scheduler_steps, eos_token_id=eos,
                             greedy_screening=(default_greedy_screening(self.model) if greedy_screening is None
                                               else greedy_screening))
        self.max_logprobs = max_logprobs
        self.rebalance_every_n_steps = rebalance_every_n_steps
        self._steps_since_rebalance = 0
        self.seed = seed
        self._ids = itertools.count()

    # ---- requests ----------------------------------------------------------------------------------
    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need tokenizer.json beside the checkpoint; pass token ids")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def _request_error(self, ids: list[int], p: SamplingParams) -> str | None:
        """Why a request can never run (checked before the scheduler's own checks), or None."""
        bad = [t for t in ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            return f"token id {bad[0]} is outside the vocabulary [0, {self.model.config.vocab_size})"
        if p.logprobs is not None and p.logprobs > self.max_logprobs:
            return f"logprobs={p.logprobs} exceeds max_logprobs={self.max_logprobs}"
        return None

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
            error = self._request_error(ids, p)
            for child in range(p.n):
                seq = Sequence(next(self._ids), ids, p, child_index=child)
                seqs_of.setdefault(request.request_id, []).append(seq)
                if error:
                    request.outputs.append(CompletionOutput(child, [], "", "error", error))
                    continue
                self.scheduler.add(seq)
                out = CompletionOutput(child, seq.output_token_ids, "", None,
                                       logprobs=None if p.logprobs is None else [])
                request.outputs.append(out)
                if seq.is_finished:  # rejected at admission (empty, too long, can never fit)
                    out.finish_reason, out.error = seq.finish_reason, seq.error
                    continue
                decoder = IncrementalDecoder(self.tokenizer, ids) if self.tokenizer else None
                live[seq.seq_id] = _Live(seq, out, request, decoder)
        self.stats = EngineStats()
        bar = tqdm(total=len(live), disable=not use_tqdm, desc="generate", unit="seq")
        in_flight = None  # the last dispatched step, committed, tokens not yet resolved
        while live:
            t0 = time.perf_counter()
            plan = self.scheduler.schedule()
            for seq in plan.finished if plan else ():
                self._close(live, seq, bar)
            self.stats.preemptions += len(plan.preempted) if plan else 0
            chunks = [c for c in plan.all_chunks() if c.seq.status is SequenceStatus.RUNNING] if plan else []
            if in_flight is not None and any(c.seq.params.uses_penalties and c.sample for c in chunks):
                self._resolve(in_flight, live, bar)  # penalties count the real tokens: no overlap this step
                in_flight = None
                chunks = [c for c in chunks if c.seq.status is SequenceStatus.RUNNING]
            step = None
            if chunks:
                if self.rebalance_every_n_steps and self._steps_since_rebalance >= self.rebalance_every_n_steps:
                    self.rebalance_experts()  # between steps: the dispatched one keeps the weights it was given
                step = self.runner.dispatch(plan)
                self._steps_since_rebalance += 1
                self.scheduler.commit(plan)
                self.stats.steps += 1
                self.stats.scheduled_tokens += sum(c.num_tokens for c in chunks)
                self.stats.prefill_tokens += sum(c.num_tokens for c in chunks) if plan.kind == "prefill" else 0
            self.stats.host_s += time.perf_counter() - t0
            if in_flight is not None:
                self._resolve(in_flight, live, bar)
            elif step is None and plan is None:
                raise RuntimeError(f"scheduler stalled with {len(live)} unfinished sequences")  # a bug, not input
            in_flight = step
        bar.close()
        end = time.perf_counter()
        for request in requests:
            n_out = sum(len(o.token_ids) for o in request.outputs)
            first = request.metrics.pop("first_token", end)
            finished = request.metrics.pop("finished", end)  # when its last sequence completed
            request.metrics = dict(ttft_s=first - start, tpot_s=(finished - first) / max(n_out - 1, 1),
                                   num_prompt_tokens=len(request.prompt_token_ids),
                                   num_cached_prompt_tokens=max(
                                       (q.num_cached_tokens for q in seqs_of.get(request.request_id, [])), default=0),
                                   num_output_tokens=n_out)
        return requests

    def _resolve(self, step, live: dict, bar) -> None:
        """Brings a dispatched step's tokens to the host and applies them: scheduler.resolve, logprobs, stop
        strings, completed sequences."""
        t0 = time.perf_counter()
        result = self.runner.fetch(step)
        t1 = time.perf_counter()
        self.stats.wait_s += t1 - t0
        done = self.scheduler.resolve(step.plan, result.tokens)
        for seq, index, j in step.plan.placeholders():  # j: the j-th token this step sampled for seq
            entry = live.get(seq.seq_id)
            if entry is None or index >= len(seq.output_token_ids):
                continue
            entry.request.metrics.setdefault("first_token", t1)
            if entry.out.logprobs is not None:
                entry.out.logprobs.append(result.logprobs[seq.seq_id][j])
            if not seq.is_finished and seq.params.stop:
                self._check_stop(entry)
        for seq in done:
            if seq.seq_id in live:
                self._close(live, seq, bar)
        for seq, _ in step.plan.pending:  # stopped by a stop string above
            if seq.seq_id in live and seq.is_finished and PLACEHOLDER not in seq.output_token_ids:
                self._close(live, seq, bar)
        self.stats.host_s += time.perf_counter() - t1

    # ---- expert load balancing ---------------------------------------------------------------------------
    def expert_load(self) -> np.ndarray:
        """np.int64 [num_moe_layers, n_routed_experts]: (token, expert) choices routed to each logical expert of
        each MoE layer over the last expert_load_window engine steps (prompt and generated tokens the steps
        computed; padding excluded). Waits for the dispatched steps."""
        return self.runner.expert_load()

    def rebalance_experts(self, num_nodes: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Re-places the routed experts from ``expert_load()`` with EPLB (jaxinfer.rebalance): slots =
        n_routed_experts + num_redundant_experts, GPUs = the mesh's `expert` axis, groups = n_group, num_nodes
        hosts. Outputs do not change (every copy of an expert is equal); only which expert rank computes what.
        Returns EPLB's (phy2log [L, S], log2phy [L, E, max_replicas], logcnt [L, E])."""
        placement = rebalance_model(self.model, self.expert_load(), num_nodes)
        self.runner.refresh_state()
        self._steps_since_rebalance = 0
        return placement

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them, through the tokenizer's chat
        template (user text never becomes special tokens)."""
        if self.tokenizer is None:
            raise ValueError("chat needs tokenizer.json and a chat template beside the checkpoint")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _close(self, live: dict, seq: Sequence, bar) -> None:
        entry = live.pop(seq.seq_id)
        entry.request.metrics["finished"] = time.perf_counter()  # the last of its n sequences wins
        entry.out.finish_reason, entry.out.error = seq.finish_reason, seq.error
        if entry.out.logprobs is not None:
            del entry.out.logprobs[len(seq.output_token_ids):]  # tokens dropped after a stop
        if entry.decoder is not None:
            self._decode(entry)
            entry.decoder.finish()
            if entry.stop_at is None:
                entry.out.text = entry.decoder.text
        bar.update(1)
        # vLLM's live estimate: prompt and output tokens of the finished sequences over the elapsed time.
        self.stats.finished_input_tokens += seq.num_prompt_tokens
        self.stats.finished_output_tokens += seq.num_output_tokens
        elapsed = max(bar.format_dict["elapsed"], 1e-9)
        bar.set_postfix_str(f"input {self.stats.finished_input_tokens / elapsed:.1f} tok/s, "
                            f"output {self.stats.finished_output_tokens / elapsed:.1f} tok/s", refresh=False)

    @staticmethod
    def _decode(entry: "_Live") -> None:
        outputs, decoder = entry.seq.output_token_ids, entry.decoder
        for tok in outputs[len(decoder.output_ids):]:
            if tok == PLACEHOLDER:
                break
            decoder.add(tok)

    def _check_stop(self, entry: "_Live") -> None:
        if entry.decoder is None:
            return
        self._decode(entry)
        for stop in entry.seq.params.stop:
            cut = entry.decoder.text.find(stop)
            if cut >= 0:
                self.scheduler.finish(entry.seq, "stop")
                entry.stop_at = cut
                entry.out.text = entry.decoder.text[:cut]
                return


@dataclasses.dataclass
class _Live:
    """An unfinished sequence of a generate call and where its results go."""

    seq: Sequence
    out: CompletionOutput
    request: RequestOutput
    decoder: IncrementalDecoder | None
    stop_at: int | None = None  # text cut by a stop string


@dataclasses.dataclass
class EngineStats:
    """Counters of the last generate call: steps dispatched, tokens computed (all / in prefill steps),
    preemptions, host time (scheduling, array building, dispatch, result handling) and time spent waiting for the
    device's results."""

    steps: int = 0
    scheduled_tokens: int = 0
    prefill_tokens: int = 0
    preemptions: int = 0
    finished_input_tokens: int = 0
    finished_output_tokens: int = 0
    host_s: float = 0.0
    wait_s: float = 0.0


def default_kv_pages(model, max_num_seqs: int, max_model_len: int) -> int:
    """num_kv_pages=None: pages fitting in 90% of one device's free memory (GPU: bytes_limit - bytes_in_use;
    CPU: a quarter of the available host memory over the local devices), capped at what max_num_seqs sequences of
    max_model_len tokens can use (plus the null page)."""
    device = model.mesh.devices.flat[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and "bytes_limit" in stats:
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4 // max(len(jax.local_devices()), 1)
    cap = max_num_seqs * -(-max_model_len // PAGE_SIZE) + 1
    return min(default_num_pages(model.config, model.dtype, free), cap)
