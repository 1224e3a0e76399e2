"""The serving engine (docs/architecture.md "One request's path"): LLM (offline facade) -> LLMEngine (add_request /
step / abort_request) -> Scheduler (a SchedulerOutput per step) -> ModelRunner (one jitted step, sampler included)
-> Scheduler.update_from_output."""

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import LLMEngine
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.outputs import CompletionOutput, EngineStats, RequestOutput, RequestOutputKind
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.structured_output import StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine", "RequestOutput",
           "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
