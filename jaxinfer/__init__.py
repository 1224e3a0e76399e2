"""jaxinfer: DeepSeek-V3/R1-family inference in JAX.

The public names below are imported on first use (lazy_exports.py), so that the pure-Python parts
(``jaxinfer.plan``, ``jaxinfer.config``, the command line's parser) import without JAX: planning a deployment needs
no accelerator stack.
"""

from jaxinfer import engine, host_memory
from jaxinfer.lazy_exports import lazy_exports

host_memory.tune_malloc()  # before XLA:CPU's threads first allocate: host_memory.py says why

# The engine's public names (jaxinfer.engine, itself lazy), the model and its config.
_EXPORTS = {**dict.fromkeys(engine.__all__, "jaxinfer.engine"), "Model": "jaxinfer.model",
            "ModelConfig": "jaxinfer.config", "load_model": "jaxinfer.model"}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"
__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
