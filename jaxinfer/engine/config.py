"""``EngineConfig``: every engine option in one frozen dataclass, validated once; ``resolve`` fills the defaults
that depend on the model and the platform (jaxinfer/platform.py).

The fields are exactly ``LLM``'s and ``LLMEngine``'s parameters, with the same names and defaults
(docs/architecture.md "Public contract").
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import pathlib
from typing import Any

import jax
import numpy as np

from jaxinfer import default_model, platform
from jaxinfer.kv.page_allocator import PAGE_SIZE
from jaxinfer.engine.speculative import SpeculativeConfig
from jaxinfer.kv.paged_cache import default_num_pages
from jaxinfer.models.attention import BACKENDS
from jaxinfer.parallel.plan import MOE_PATHS

DTYPES = ("float32", "bfloat16")
ATTENTION_BACKENDS = tuple(BACKENDS)
PREFILL_LAYOUTS = ("blocks", "grid")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine options. Options that count pages or sequences are per DP rank.

    model: a checkpoint directory (HF safetensors or jaxinfer's orbax form); None = the embedded default model.
    mesh: None (all devices as 1xN), "DxE", a meshes/*.toml file or a jax.sharding.Mesh (parallel/mesh.py).
    dtype: "float32" or "bfloat16" (None: bfloat16).
    num_kv_pages: KV pages of 64 tokens per DP rank, the null page included; None = what fits in 90% of a
      device's free memory (a quarter of the available host memory shared by the local devices on CPU), at most
      enough for max_num_seqs sequences of max_model_len tokens.
    max_num_seqs: running sequences per DP rank at most. max_num_batched_tokens: tokens computed per DP rank per
      prefill step at most (chunked prefill; 2048: 32 prompts of 64 tokens prefill 8-14% faster in one step than
      in two of 1024 on CPU, docs/benchmarks.md "Prefill steps (CPU)"). max_model_len: prompt + output tokens at
      most (None, or more than the model's max_position_embeddings: that).
    enable_prefix_caching: reuse the KV pages of shared prompt prefixes (kv/prefix_cache.py).
    fp8_compute: DeepSeek's FP8 GEMMs on per-token-quantized activations (None: on for bf16 on GPU; model.py).
    seed: the engine seed of unseeded requests (engine/sampler.py). max_logprobs: the largest
      ``SamplingParams.logprobs`` accepted (vLLM's default 20).
    num_redundant_experts: extra expert slots per MoE layer for EPLB (None: the checkpoint's; they must split
      evenly over the mesh's `expert` axis). expert_load_window: ``expert_load()`` counts the last this many
      steps. rebalance_every_n_steps: re-place the experts with EPLB every that many steps (None: never).
    num_scheduler_steps: decode iterations per decode step (vLLM's multi-step scheduling; outputs do not change);
      None: the platform's (8 on CPU, 1 elsewhere).
    greedy_screening: greedy decode steps of one sequence per DP rank find each token through an int8 copy of the
      LM head (models/screened_head.py; the same tokens); None: the platform's (on for float32 on CPU).
    compilation_cache: JAX's persistent compilation cache (None keeps a directory JAX already has, else
      $JAX_COMPILATION_CACHE_DIR or ~/.cache/jaxinfer/jax; a path; "off"). JAX's cache is process-wide.
    attention_backend: "pallas" (mla_decode over the cache written inside the step: the Mosaic GPU kernel on a
      GPU) or "xla" (the cache read-only inside the step, the step's latents written after it); None: the
      platform's (pallas on GPU).
    moe_path: the routed experts' compute path: None (the cheapest for each step's shape by a cost model of the
      shape, models/moe_cost.py) or one of "gather", "dense", "capacity", "grouped", "ragged" (forced: for tests
      and benchmarks; every path computes the same per-token results, to rounding).
    speculative_config: None, or MTP speculative decoding as vLLM's dict {"method": "mtp" | "deepseek_mtp",
      "num_speculative_tokens": K in [1, 16], "verify": "all" | "confidence"} (engine/speculative.py; stored as a
      SpeculativeConfig). A speculative decode step runs up to num_scheduler_steps draft-verify rounds on device
      (step_program.py ``verify_rounds``); the plain decode steps verify="confidence" falls back to when no draft
      is worth verifying are multi-step steps of as many iterations.
    prefill_layout: "blocks" (chunks over query blocks of buckets.PREFILL_BLOCK columns: a prefill step compiles
      once per block count; kernels_pallas/mla/query_blocks.py) or "grid" (a prefill step is [rows, T]: a chunk per
      row, T the power of two >= the longest). Speculative decoding's prefill steps are grids either way.
    compile_ahead: with prefill_layout "blocks", once the first block count compiles, compile the others in a
      background thread (engine/compile_ahead.py), so that no later prefill step compiles; a script that exits
      right after one generate call waits for at most the compilation under way. ``LLM.wait_for_compilations()``
      waits for them. None: on, unless the environment sets JAXINFER_COMPILE_AHEAD=0 (the test suite does: its
      hundred engines would compile programs they never run).
    kv_cache_dir: the KV storage tier (kv/page_store.py): full prompt pages written to this directory (created if
      missing; several processes may share it) and read back on a prefix hit in any later process; None: off.
      Needs enable_prefix_caching. An unwritable directory: a warning, and the engine runs without the tier.
    kv_cache_max_bytes: the tier's bound (LRU by file mtime; it may be exceeded by one page per writer); None:
      unbounded. Needs kv_cache_dir; below one page: ValueError when the engine is built.
    async_scheduling: schedule and dispatch step n + 1 before step n's tokens reach the host (vLLM v1's async
      scheduling; speculative verifications follow their step in flight on device); False: apply every step
      before the next is built (for measurements and debugging; the same outputs, but for seeded speculative
      samples where page pressure preempts differently: docs/architecture.md "Speculative decoding (MTP)").

    Raises ValueError naming the field for an invalid value.
    """

    model: str | os.PathLike | None = None
    mesh: Any = None
    dtype: str | None = None
    num_kv_pages: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    fp8_compute: bool | None = None
    seed: int = 0
    max_logprobs: int = 20
    num_redundant_experts: int | None = None
    expert_load_window: int = 1000
    rebalance_every_n_steps: int | None = None
    num_scheduler_steps: int | None = None
    greedy_screening: bool | None = None
    compilation_cache: str | os.PathLike | None = None
    attention_backend: str | None = None
    moe_path: str | None = None
    speculative_config: SpeculativeConfig | dict | None = None
    prefill_layout: str = "blocks"
    compile_ahead: bool | None = None
    kv_cache_dir: str | os.PathLike | None = None
    kv_cache_max_bytes: int | None = None
    async_scheduling: bool = True

    @classmethod
    def from_options(cls, caller: str, options: dict, other_names: tuple[str, ...] = ()) -> EngineConfig:
        """``EngineConfig(**options)`` for ``caller`` (e.g. "LLM()"), whose other keyword arguments are
        ``other_names``: an unknown option is a TypeError naming it and the closest known name (a misspelt option
        must not be dropped or reach the dataclass's bare message)."""
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(names))
        if unknown:
            close = difflib.get_close_matches(unknown[0], names + list(other_names), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(f"{caller} got an unknown option {unknown[0]!r}{hint}; the engine options are "
                            "EngineConfig's fields (engine/config.py)")
        return cls(**options)

    def __post_init__(self):
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.prefill_layout not in PREFILL_LAYOUTS:
            raise ValueError(f"prefill_layout must be one of {PREFILL_LAYOUTS}, got {self.prefill_layout!r}")
        for name, least, optional in [("num_kv_pages", 2, True), ("max_num_seqs", 1, False),
                                      ("max_num_batched_tokens", 1, False), ("max_model_len", 1, True),
                                      ("max_logprobs", 0, False), ("num_redundant_experts", 0, True),
                                      ("expert_load_window", 1, False), ("rebalance_every_n_steps", 1, True),
                                      ("num_scheduler_steps", 1, True), ("kv_cache_max_bytes", 1, True)]:
            value = getattr(self, name)
            if optional and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                kind = "a positive integer" if least == 1 else f"an integer >= {least}"
                raise ValueError(f"{name} must be {kind}{' or None' if optional else ''}, got {value!r}")
        required = ("enable_prefix_caching", "async_scheduling")
        for name in (*required, "fp8_compute", "greedy_screening", "compile_ahead"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (value is None and name not in required):
                raise ValueError(f"{name} must be True or False{'' if name in required else ' or None'}"
                                 f", got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be None or one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend is not None and self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be None or one of {ATTENTION_BACKENDS}, "
                             f"got {self.attention_backend!r}")
        if self.moe_path is not None and self.moe_path not in MOE_PATHS:
            raise ValueError(f"moe_path must be None or one of {MOE_PATHS}, got {self.moe_path!r}")
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ValueError(f"model must be None or a checkpoint directory, got {self.model!r}")
        if self.compilation_cache is not None and (not isinstance(self.compilation_cache, (str, os.PathLike))
                                                   or not os.fspath(self.compilation_cache)):
            raise ValueError(f"compilation_cache must be None, 'off' or a directory, got {self.compilation_cache!r}")
        if self.kv_cache_dir is not None and (not isinstance(self.kv_cache_dir, (str, os.PathLike))
                                              or not os.fspath(self.kv_cache_dir)):
            raise ValueError(f"kv_cache_dir must be None or a directory, got {self.kv_cache_dir!r}")
        if self.kv_cache_max_bytes is not None and self.kv_cache_dir is None:
            raise ValueError("kv_cache_max_bytes bounds the KV storage tier: it needs kv_cache_dir")
        if self.kv_cache_dir is not None and not self.enable_prefix_caching:
            raise ValueError("kv_cache_dir (the KV storage tier) needs enable_prefix_caching=True: stored pages are "
                             "found by the prefix cache's page hashes")

    def resolve(self, model) -> EngineConfig:
        """A copy with every default that depends on the loaded ``model`` (a jaxinfer Model) or the platform
        filled in: dtype, max_model_len, num_kv_pages, num_scheduler_steps, greedy_screening, attention_backend,
        compile_ahead."""
        here = platform.current()
        max_len = model.config.max_position_embeddings
        max_model_len = min(self.max_model_len or max_len, max_len)
        return dataclasses.replace(
            self,
            model=str(pathlib.Path(self.model or default_model.path())),
            dtype=self.dtype or "bfloat16",
            max_model_len=max_model_len,
            num_kv_pages=self.num_kv_pages or default_kv_pages(model, self.max_num_seqs, max_model_len),
            num_scheduler_steps=self.num_scheduler_steps or here.num_scheduler_steps,
            greedy_screening=(here.greedy_screening(model.dtype) if self.greedy_screening is None
                              else self.greedy_screening),
            attention_backend=self.attention_backend or here.attention_backend,
            compile_ahead=(os.environ.get("JAXINFER_COMPILE_AHEAD", "1") != "0" if self.compile_ahead is None
                           else self.compile_ahead))


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
    return min(default_num_pages(model.config, np.dtype(model.dtype), free), cap)
