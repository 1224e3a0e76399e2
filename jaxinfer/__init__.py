"""jaxinfer: DeepSeek-V3/R1-family inference in JAX."""

from jaxinfer.config import ModelConfig
from jaxinfer.model import Model, load_model

__all__ = ["ModelConfig", "Model", "load_model"]
__version__ = "0.1.0"
