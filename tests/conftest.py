"""Test session setup: 8 simulated CPU devices and a persistent compilation cache.

Both must be in place before JAX starts its backend, so this runs at import time of the test session.
Tests that are not about meshes pass ``mesh="1x1"``.
"""

import importlib.util
import os
import pathlib
import warnings

import pytest

# Compile with XLA:CPU's cheap pipeline: the tests run small shapes, so compiling dominates them (an engine's step
# program: ~1,000 fusions, 3-6 s to compile on the CI machines). The first two flags cut a test suite's compile time by
# about a quarter; XLA:CPU's older elemental emitters for loop fusions and one LLVM module per program (two test
# workers already use both cores) about halve what is left (docs/benchmarks.md "Test suite and compile times").
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Engines compile no prefill block counts ahead unless a test asks (EngineConfig.compile_ahead): most of the suite's
# engines run once, and the background compilations took ~4 minutes of a clean-clone run.
os.environ.setdefault("JAXINFER_COMPILE_AHEAD", "0")
# Shared with subprocesses the tests start (CLI tests), so each program compiles once per machine.
_CACHE = pathlib.Path(os.environ.get("JAXINFER_TEST_CACHE", pathlib.Path(__file__).parent.parent / ".jax_cache"))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(_CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


# The slowest files, slowest first (worker seconds of a clean-clone run: docs/benchmarks.md "Test suite and compile
# times"). `pytest -n 2 --dist loadfile` hands whole files to the workers in collection order (pyproject's addopts
# turn off xdist's reordering by test count), so a long file started last cannot leave one worker idle at the end.
SLOWEST_FILES = ("engine/test_engine.py", "kernels/mla/test_mla_decode.py", "kernels/fp8/test_fp8_gemm.py",
                 "engine/test_speculative.py", "engine/test_structured_output.py", "test_notebooks.py",
                 "test_rebalance.py", "models/test_screened_head.py", "cli/test_sweep.py", "engine/test_llm.py",
                 "models/test_paged_forward.py", "parallel/test_multihost.py", "engine/test_llm_engine.py",
                 "engine/test_kv_storage.py", "engine/test_chat_protocol.py", "engine/test_disaggregated.py",
                 "engine/test_pd_processes.py",
                 "cli/test_cli_generate.py", "cli/test_cli_speculative.py", "parallel/test_expert_parallel.py",
                 "test_default_model.py", "engine/test_speculative_sampling.py", "test_orbax_model.py")


def pytest_collection_modifyitems(items):
    """Runs the slowest files first (SLOWEST_FILES), each file's tests in their own order."""
    tests = pathlib.Path(__file__).parent
    order = {name: i for i, name in enumerate(SLOWEST_FILES)}

    def rank(item):
        try:
            name = pathlib.Path(item.fspath).relative_to(tests).as_posix()
        except ValueError:
            return len(order)
        return order.get(name, len(order))

    items.sort(key=rank)


@pytest.fixture(scope="module", autouse=True)
def _mappings_headroom():
    """After each test module: a worker process that holds more than half the memory mappings Linux allows it
    drops JAX's compiled programs (jaxinfer/jit_mappings.py: XLA:CPU maps each program's kernels, and past the limit
    LLVM aborts the process; a worker's peak: docs/benchmarks.md "Compiled programs and memory mappings (CPU)"). The
    next modules compile again or load from the cache."""
    yield
    from jaxinfer import jit_mappings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        jit_mappings.relieve(0.5)


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
