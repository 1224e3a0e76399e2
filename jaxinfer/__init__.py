"""jaxinfer: DeepSeek-V3/R1-family inference in JAX."""

from jaxinfer import host_memory

host_memory.tune_malloc()  # before XLA:CPU's threads first allocate: host_memory.py says why

from jaxinfer.config import ModelConfig
from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import LLMEngine
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.outputs import CompletionOutput, EngineStats, RequestOutput, RequestOutputKind
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.structured_output import StructuredOutputsParams
from jaxinfer.model import Model, load_model

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine", "Model", "ModelConfig",
           "RequestOutput", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams", "load_model"]
__version__ = "0.1.0"
