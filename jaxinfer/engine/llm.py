"""``jaxinfer.LLM``: vLLM-style offline generation, a loop over ``LLMEngine.step()`` (docs/architecture.md "One
request's path").

One request's path: prompt -> Tokenizer -> LLMEngine.add_request -> Scheduler (DP rank, prefill / decode steps,
pages; a SchedulerOutput per step) -> ModelRunner (one jitted step over the paged latent cache, sampler included) ->
Scheduler.update_from_output (tokens, stop checks, pages) -> RequestState (text, stop strings) -> RequestOutput.
"""

from __future__ import annotations

from typing import Sequence as _Seq

import numpy as np
from tqdm.auto import tqdm

from jaxinfer.engine.chat import chat_requests
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.disaggregated import DisaggregatedEngine
from jaxinfer.engine.engine import LLMEngine
from jaxinfer.engine.outputs import RequestOutput, RequestOutputKind
from jaxinfer.engine.pd_remote import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_TIMEOUT_S, PrefillEngine
from jaxinfer.engine.sampling_params import SamplingParams


class LLM:
    """Offline generation on a mesh: ``LLM(model=None, mesh=None, dtype=None, **engine_options)`` with
    ``EngineConfig``'s fields (engine/config.py documents each). ``llm.engine`` is its LLMEngine; ``llm.stats``
    the last generate call's counters (outputs.EngineStats; its step_log: engine/step_log.py).

    Prefill/decode disaggregation: ``LLM(..., prefill_mesh=SPEC, decode_mesh=SPEC)`` (both or neither; mesh must
    be None) runs a prefill engine and a decode engine on disjoint devices ("DxE" and mesh files take devices in
    order, prefill first; engine/disaggregated.py); ``llm.engine`` is then a DisaggregatedEngine. Across processes:
    ``LLM(..., pd_address="HOST:PORT", pd_timeout=30.0)`` is the prefill process of a pair whose decode process
    serves that address (engine/pd_remote.py ``DecodeServer``; ``jaxinfer generate --role decode``); requests
    the decode process holds when it goes silent for pd_timeout seconds, or does not answer within
    pd_connect_timeout (300 s) of the start, finish with "error". ``llm.close()`` tells it to exit once done."""

    def __init__(self, model=None, mesh=None, dtype: str | None = None, *, prefill_mesh=None, decode_mesh=None,
                 pd_address: str | None = None, pd_timeout: float = DEFAULT_TIMEOUT_S,
                 pd_connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S, **engine_options):
        config = EngineConfig.from_options("LLM()", dict(model=model, mesh=mesh, dtype=dtype, **engine_options),
                                           ("prefill_mesh", "decode_mesh", "pd_address", "pd_timeout",
                                            "pd_connect_timeout"))
        if pd_address is not None:  # the prefill process of a pair (engine/pd_remote.py)
            if prefill_mesh is not None or decode_mesh is not None:
                raise ValueError("pd_address (a decode process elsewhere) excludes prefill_mesh / decode_mesh")
            self.engine = PrefillEngine(config, pd_address, pd_timeout, pd_connect_timeout)
        elif prefill_mesh is None and decode_mesh is None:
            self.engine = LLMEngine.from_config(config)
        else:  # prefill/decode disaggregation (engine/disaggregated.py)
            self.engine = DisaggregatedEngine(config, prefill_mesh, decode_mesh)
        self.stats = self.engine.stats.since(self.engine.stats)  # zeros (with K per-position counts)

    # The engine's parts, for notebooks and benchmarks.
    model = property(lambda self: self.engine.model)
    model_path = property(lambda self: self.engine.model_path)
    tokenizer = property(lambda self: self.engine.tokenizer)
    scheduler = property(lambda self: self.engine.scheduler)
    runner = property(lambda self: self.engine.runner)
    config = property(lambda self: self.engine.config)
    max_model_len = property(lambda self: self.engine.config.max_model_len)

    def wait_for_compilations(self) -> None:
        """Blocks until the programs compiled ahead in the background are ready (LLMEngine.wait_for_compilations):
        call it after a warm-up before timing."""
        self.engine.wait_for_compilations()

    def generate(self, prompts, sampling_params: SamplingParams | _Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: str | list[str] | list[list[int]] -> one finished RequestOutput per prompt, in order (request
        ids "0", "1", ...). A bad request (empty, too long, token id outside the vocabulary) comes back with
        finish_reason "error"; the others finish normally."""
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        params = [p or SamplingParams() for p in params]
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        if texts and self.tokenizer is not None:  # one batch, encoded in parallel (Tokenizer.encode_batch)
            prompts = list(prompts)
            for i, ids in zip(texts, self.tokenizer.encode_batch([prompts[i] for i in texts])):
                prompts[i] = {"prompt": prompts[i], "prompt_token_ids": ids}
        engine = self.engine
        engine.clear_step_log()  # the records of this call (step_log.py)
        before = engine.stats.snapshot()
        ids = [str(i) for i in range(len(prompts))]
        results: dict[str, RequestOutput] = {}
        try:
            for rid, prompt, p in zip(ids, prompts, params):
                engine.add_request(rid, prompt, p, output_kind=RequestOutputKind.FINAL_ONLY)
            bar = tqdm(total=len(ids), disable=not use_tqdm, desc="generate", unit="req")
            while len(results) < len(ids):
                for out in engine.step():
                    results[out.request_id] = out
                    bar.update(1)
                    # vLLM's live estimate: prompt and output tokens of the finished sequences over the time.
                    stats, elapsed = engine.stats.since(before), max(bar.format_dict["elapsed"], 1e-9)
                    bar.set_postfix_str(f"input {stats.finished_input_tokens / elapsed:.1f} tok/s, "
                                        f"output {stats.finished_output_tokens / elapsed:.1f} tok/s", refresh=False)
            bar.close()
        except BaseException:
            engine.abort_request(ids)  # nothing of an interrupted call stays in the engine
            raise
        finally:
            self.stats = engine.stats.since(before)
        return [results[rid] for rid in ids]

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, *, tools=None, tool_choice="auto",
             chat_template_kwargs=None, response_format=None) -> list[RequestOutput]:
        """One conversation or a list of them in OpenAI's shapes (engine/chat_protocol.py: text or text-part
        content, assistant tool_calls, tool messages), through the tokenizer's chat template with ``tools`` (OpenAI
        function definitions) and ``chat_template_kwargs``; user text never becomes special tokens.

        Replies (engine/chat_output.py): ``reasoning_content`` and ``tool_calls`` parsed out of each completion in
        the model family's format (chosen from the tokenizer's tokens), ``text`` the rest. tool_choice: "auto";
        "none" (tools not rendered, nothing parsed as calls); "required" (one or more calls) or {"type":
        "function", "function": {"name": ...}} (one call of it): the output is constrained to calls whose
        arguments follow the function's schema. response_format: OpenAI's {"type": "json_schema", "json_schema":
        {"schema": ...}} or {"type": "json_object"}: the replies are constrained to it (engine/structured_output.py).
        ValueError naming the message or field for bad input, and for two constraints at once (response_format,
        a forced tool_choice, SamplingParams.structured_outputs)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        requests = chat_requests(self.tokenizer, conversations, tools, tool_choice, chat_template_kwargs,
                                 response_format)
        many = isinstance(sampling_params, (list, tuple))
        if many and len(sampling_params) != len(requests):
            raise ValueError(f"{len(sampling_params)} sampling_params for {len(requests)} conversations")
        params = [r.params(sampling_params[i] if many else sampling_params) for i, r in enumerate(requests)]
        outs = self.generate([r.prompt_token_ids for r in requests], params, use_tqdm)
        return [r.parse(out, self.tokenizer) for r, out in zip(requests, outs)]

    def close(self) -> None:
        """With pd_address: tells the decode process to exit once its requests are done (else nothing)."""
        if isinstance(self.engine, PrefillEngine):
            self.engine.close()

    def cache_stats(self) -> dict:
        """LLMEngine.cache_stats: prompt_tokens, device_hit_tokens, storage_hit_tokens, hit_rate,
        storage_bytes_read, storage_bytes_written, storage_rejected_files, storage_bytes (since the LLM was
        built; the KV storage tier's counts 0 without kv_cache_dir)."""
        return self.engine.cache_stats()

    # ---- expert load balancing ---------------------------------------------------------------------------
    def expert_load(self) -> np.ndarray:
        """LLMEngine.expert_load: np.int64 [num_moe_layers, n_routed_experts] over the last expert_load_window
        steps."""
        return self.engine.expert_load()

    def rebalance_experts(self, num_nodes: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """LLMEngine.rebalance_experts: re-places the routed experts with EPLB; returns (phy2log, log2phy,
        logcnt)."""
        return self.engine.rebalance_experts(num_nodes)
