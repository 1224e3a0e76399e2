"""jaxinfer: DeepSeek-V3/R1-family inference in JAX."""

from jaxinfer.config import ModelConfig
from jaxinfer.engine.llm import LLM, CompletionOutput, RequestOutput
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.model import Model, load_model

__all__ = ["LLM", "CompletionOutput", "Model", "ModelConfig", "RequestOutput", "SamplingParams", "load_model"]
__version__ = "0.1.0"
