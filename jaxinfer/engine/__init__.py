"""The serving engine (docs/architecture.md "One request's path"): LLM (offline facade) -> LLMEngine (add_request /
step / abort_request) -> Scheduler (a SchedulerOutput per step) -> ModelRunner (one jitted step, sampler included)
-> Scheduler.update_from_output. The names below are imported on first use (jaxinfer/lazy_exports.py), so that the
engine's pure-Python modules (buckets, speculative, sampling_params) import without JAX."""

from jaxinfer.lazy_exports import lazy_exports

_EXPORTS = {
    "LLM": "jaxinfer.engine.llm",
    "CompletionOutput": "jaxinfer.engine.outputs",
    "EngineConfig": "jaxinfer.engine.config",
    "EngineStats": "jaxinfer.engine.outputs",
    "LLMEngine": "jaxinfer.engine.engine",
    "RequestOutput": "jaxinfer.engine.outputs",
    "RequestOutputKind": "jaxinfer.engine.outputs",
    "SamplingParams": "jaxinfer.engine.sampling_params",
    "StructuredOutputsParams": "jaxinfer.engine.structured_output",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
