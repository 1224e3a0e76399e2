"""jaxinfer/jit_mappings.py: JAX's compiled programs dropped before XLA:CPU's mappings reach Linux's limit.

Oracles: the kernel's own /proc files, jax's cache sizes, and an engine's greedy tokens from a run without any
relief (a relief mid-run must change nothing but compile times)."""

import sys
import warnings

import jax
import jax.numpy as jnp
import pytest

from jaxinfer import LLM, SamplingParams, jit_mappings

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps and vm.max_map_count")


@linux
def test_mappings_and_their_limit_are_read_from_proc():
    count, limit = jit_mappings.mapping_count(), jit_mappings.mapping_limit()
    with open("/proc/self/maps") as f:
        lines = len(f.readlines())
    assert count == pytest.approx(lines, abs=50)  # the process maps and unmaps between the two reads
    assert limit == int(open("/proc/sys/vm/max_map_count").read())


def test_programs_loaded_counts_compilations():
    before = jit_mappings.programs_loaded()
    jax.jit(lambda x: jnp.sin(x) * 3)(jnp.ones((3, 7, 11))).block_until_ready()
    assert jit_mappings.programs_loaded() > before


@linux
def test_relieve_drops_the_caches_only_near_the_limit(monkeypatch):
    f = jax.jit(lambda x: x * 2 + 1)
    f(jnp.ones(5))
    assert f._cache_size() == 1
    monkeypatch.setattr(jit_mappings, "mapping_limit", lambda: 10**9)
    assert not jit_mappings.relieve() and f._cache_size() == 1
    # a limit the process is always above 0.75 of (its mappings fall once the caches are dropped)
    monkeypatch.setattr(jit_mappings, "mapping_limit", lambda: int(jit_mappings.mapping_count() / 0.8))
    monkeypatch.setitem(jit_mappings._state, "warned", False)
    with pytest.warns(RuntimeWarning, match=r"vm\.max_map_count"):
        assert jit_mappings.relieve()
    assert f._cache_size() == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per process
        assert jit_mappings.relieve()


def test_an_engine_relieved_mid_run_gives_the_same_tokens(monkeypatch):
    """The engine checks after steps that loaded programs (here: every step); at the third check, a step in
    flight, the process is near the limit: JAX's caches are dropped, and the run goes on (its programs compiled or
    loaded again) to the greedy tokens of a run without relief."""
    prompts = ["The with statement is used to", "def fib(n):", "Return a list of"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(dtype="float32", mesh="1x1", num_kv_pages=16)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    loads = iter(range(10**6))
    monkeypatch.setattr(jit_mappings, "programs_loaded", lambda: next(loads))
    checks, in_flight = [], []

    def relieve(*a):
        checks.append(1)
        if len(checks) != 3:
            return False
        in_flight.append(llm.engine._in_flight is not None)
        jax.clear_caches()
        return True

    monkeypatch.setattr(jit_mappings, "relieve", relieve)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert in_flight == [True] and len(checks) > 3
    assert got == ref
