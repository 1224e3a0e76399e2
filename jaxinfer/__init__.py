"""jaxinfer: DeepSeek-V3/R1-family inference in JAX.

The public names below are imported on first use (PEP 562 ``__getattr__``), so that the pure-Python parts
(``jaxinfer.plan``, ``jaxinfer.config``) import without JAX: planning a deployment needs no accelerator stack.
"""

import importlib

from jaxinfer import host_memory

host_memory.tune_malloc()  # before XLA:CPU's threads first allocate: host_memory.py says why

_EXPORTS = {
    "LLM": "jaxinfer.engine.llm",
    "CompletionOutput": "jaxinfer.engine.outputs",
    "EngineConfig": "jaxinfer.engine.config",
    "EngineStats": "jaxinfer.engine.outputs",
    "LLMEngine": "jaxinfer.engine.engine",
    "Model": "jaxinfer.model",
    "ModelConfig": "jaxinfer.config",
    "RequestOutput": "jaxinfer.engine.outputs",
    "RequestOutputKind": "jaxinfer.engine.outputs",
    "SamplingParams": "jaxinfer.engine.sampling_params",
    "StructuredOutputsParams": "jaxinfer.engine.structured_output",
    "load_model": "jaxinfer.model",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jaxinfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
