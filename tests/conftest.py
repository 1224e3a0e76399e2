"""Test session setup: 8 simulated CPU devices and a persistent compilation cache.

Both must be in place before JAX starts its backend, so this runs at import time of the test session.
Tests that are not about meshes pass ``mesh="1x1"``.
"""

import importlib.util
import os
import pathlib

import pytest

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Shared with subprocesses the tests start (CLI tests), so each program compiles once per machine.
_CACHE = pathlib.Path(os.environ.get("JAXINFER_TEST_CACHE", pathlib.Path(__file__).parent.parent / ".jax_cache"))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@pytest.fixture
def benchmark_script():
    """load(name) -> the module of benchmarks/<name>.py (scripts, not a package), for tests of their helpers."""
    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, pathlib.Path(__file__).parent.parent / "benchmarks"
                                                      / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return load


@pytest.fixture(scope="session")
def v3_case(tmp_path_factory):
    """The tiny random DeepSeek-V3 checkpoint (q_lora, YaRN) that the engine tests run against transformers:
    hf_oracle's Case (path, cfg, the transformers model), built once per session."""
    import hf_oracle

    return hf_oracle.build_case("v3_qlora_yarn", tmp_path_factory)
