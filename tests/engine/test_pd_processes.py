"""Prefill/decode disaggregation across processes on 127.0.0.1 (engine/pd_remote.py): the test process prefills,
a `jaxinfer generate --role decode` process decodes. Greedy tokens equal transformers' generate and seeded samples
a co-located engine's; the bytes handed over are the prompts' latents rounded up to pages. The decode process
starts after the prefill side has waited longer than pd_timeout (a peer not heard from yet gets pd_connect_timeout).
Faults: the decode process killed mid-run gives the requests it held an "error" within the timeout and the prefill
side goes on; a killed prefill process makes the decode side abort its requests and exit within the timeout; a
peer that never answers fails within pd_connect_timeout."""

import io
import os
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import hf_oracle
import pytest
from jax.sharding import Mesh

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.llm import LLM
from jaxinfer.engine.pd_remote import DecodeServer
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.parallel.mesh import AXES

TIMEOUT_S = 5.0      # pd_timeout of these tests: a dead peer's requests fail within it
OPTIONS = dict(dtype="float32", num_kv_pages=16, max_num_batched_tokens=96)  # test_disaggregated.py's


def _free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _cli(*args: str, stderr) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxinfer.cli", "generate", *args], stdout=subprocess.PIPE,
                            stderr=stderr, text=True, env=os.environ.copy())


@pytest.fixture(scope="module")
def pair(v3_case, tmp_path_factory):
    """(a decode process serving an address, the prefill LLM of this process connected to it). The decode process
    starts once the prefill side has waited for it longer than pd_timeout: only a peer heard from can time out."""
    address = _free_address()
    log = open(tmp_path_factory.mktemp("pd") / "decode.log", "w+")
    llm = LLM(v3_case.path, mesh="1x1", pd_address=address, pd_timeout=TIMEOUT_S, **OPTIONS)
    time.sleep(max(0.0, llm.engine.channel.started + TIMEOUT_S + 0.5 - time.monotonic()))
    decode = _cli("--role", "decode", "--pd-address", address, "--pd-timeout", str(TIMEOUT_S), "--model",
                  str(v3_case.path), "--mesh", "1x2", "--dtype", "float32", stderr=log)
    yield decode, llm
    if decode.poll() is None:
        decode.kill()
    decode.wait()


def test_tokens_across_processes_equal_transformers_and_a_colocated_engine(v3_case, pair):
    _, llm = pair
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, v3_case.cfg["vocab_size"], n).tolist() for n in (3, 64, 100)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    refs = [hf_oracle.greedy_tokens(v3_case.model, p, 8) for p in prompts]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == refs
    cfg = v3_case.cfg  # a page: layers x 64 tokens x (kv_lora_rank + qk_rope_head_dim) float32 values
    page_bytes = cfg["num_hidden_layers"] * 64 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4
    assert llm.stats.kv_transfer_bytes == (1 + 1 + 2) * page_bytes
    seeded = [SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=4, seed=9, n=2, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=1)]
    got = llm.generate(prompts, seeded, use_tqdm=False)
    want = LLM(v3_case.path, mesh="1x1", **OPTIONS).generate(prompts, seeded, use_tqdm=False)
    assert [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in got] == [
        [(c.token_ids, c.finish_reason) for c in o.outputs] for o in want]
    assert all(o.metrics["ttft_s"] > 0 and o.metrics["tpot_s"] is not None for o in got)


def test_a_killed_decode_process_fails_its_requests_within_the_timeout(v3_case, pair):
    decode, llm = pair
    engine = llm.engine
    rng = np.random.default_rng(2)
    for i in range(3):
        engine.add_request(f"k{i}", rng.integers(0, v3_case.cfg["vocab_size"], 20).tolist(),
                           SamplingParams(temperature=0, max_tokens=3000, ignore_eos=True), output_kind="final_only")
    deadline = time.monotonic() + 120
    while engine.prefill.has_unfinished_requests() and time.monotonic() < deadline:  # all handed over
        assert engine.step() == []
    decode.kill()
    decode.wait()
    killed = time.monotonic()
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        assert time.monotonic() - killed < TIMEOUT_S + 10, "the prefill side waited past its timeout"
    assert sorted(o.request_id for o in outs) == ["k0", "k1", "k2"]
    assert all(o.outputs[0].finish_reason == "error" and "decode process" in o.outputs[0].error for o in outs)
    # The prefill side goes on: a request that ends at its first token needs no decode process.
    (alone,) = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert alone.outputs[0].finish_reason == "length" and len(alone.outputs[0].token_ids) == 1


def test_a_killed_prefill_process_makes_the_decode_side_abort_and_exit(v3_case, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": [5, 6, 7, 8], "ignore_eos": true}\n')  # token ids: the model has no tokenizer
    address = _free_address()
    mesh = Mesh(np.array(jax.devices()[7:8]).reshape(1, 1), AXES)
    server = DecodeServer(EngineConfig(model=v3_case.path, mesh=mesh, **OPTIONS), address, timeout=TIMEOUT_S)
    log, status = io.StringIO(), []

    def serve():
        try:
            status.append(server.run(log))
        except BaseException as e:  # noqa: BLE001 (reported by the assertions below)
            status.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    prefill = _cli("--role", "prefill", "--pd-address", address, "--pd-timeout", str(TIMEOUT_S), "--model",
                   str(v3_case.path), "--mesh", "1x1", "--dtype", "float32", "--max-tokens", "3000",
                   "--temperature", "0", "--prompts", str(prompts), stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not server.engine.has_unfinished_requests():  # the request arrived and decodes
            assert time.monotonic() < deadline and prefill.poll() is None and thread.is_alive(), status
            time.sleep(0.05)
    finally:
        prefill.kill()
        prefill.wait()
    killed = time.monotonic()
    thread.join(timeout=TIMEOUT_S + 10)
    assert not thread.is_alive() and time.monotonic() - killed < TIMEOUT_S + 10
    assert status == [1] and "aborted 1 request(s) ['0']" in log.getvalue()
    assert not server.engine.has_unfinished_requests()


def test_a_peer_that_never_answers_fails_within_the_connect_timeout(v3_case, tmp_path):
    address = _free_address()  # nobody serves it
    llm = LLM(v3_case.path, mesh="1x1", pd_address=address, pd_timeout=TIMEOUT_S, pd_connect_timeout=1.0, **OPTIONS)
    try:
        (out,) = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    finally:
        llm.close()
    assert out.outputs[0].finish_reason == "error"
    assert f"no decode process answered at {address} within 1 s" in out.outputs[0].error
    mesh = Mesh(np.array(jax.devices()[7:8]).reshape(1, 1), AXES)
    server = DecodeServer(EngineConfig(model=v3_case.path, mesh=mesh, **OPTIONS), _free_address(),
                          timeout=TIMEOUT_S, connect_timeout=1.0)
    log, started = io.StringIO(), time.monotonic()
    assert server.run(log) == 1 and time.monotonic() - started < 1.0 + 10
    assert "no prefill process answered at" in log.getvalue() and "aborted 0 request(s)" in log.getvalue()


def test_a_side_spanning_processes_is_refused(v3_case, monkeypatch):
    """One process per side: in a multi-process JAX run (jax.distributed) both sides refuse before they open a
    socket or build an engine."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="one process per side; this process is one of 2"):
        LLM(v3_case.path, mesh="1x1", pd_address=_free_address(), **OPTIONS)
    with pytest.raises(ValueError, match="a unit spanning processes is not supported"):
        DecodeServer(EngineConfig(model=v3_case.path, mesh="1x1", **OPTIONS), _free_address())
