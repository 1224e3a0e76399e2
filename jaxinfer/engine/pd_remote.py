"""Prefill/decode disaggregation across processes (docs/architecture.md "Prefill/decode disaggregation"): a prefill
process and a decode process, on one machine or two.

- Control: a ZeroMQ DEALER pair (pyzmq), the decode process binding ``--pd-address HOST:PORT`` and the prefill
  process connecting to it. Each side's socket lives in its own thread (``Channel``), which sends a heartbeat
  every ``HEARTBEAT_S`` whatever the engine is doing (a first step compiling for a minute included), so a peer
  that dies or is stopped is noticed within ``timeout`` seconds. Messages are pickled Python objects: the two
  processes trust each other, as vLLM's and SGLang's disaggregation channels do; bind the address on a private
  network only.
- KV: the prefill process offers each hand-over's latents with ``jax.experimental.transfer`` (``await_pull`` under
  a fresh id) and the decode process pulls them onto its mesh; a pull is single-use and the decode process
  acknowledges it, after which the prefill process drops its copy. A pull that does not complete within
  ``timeout`` fails its request (on jax 0.10.2, a pull of an id that was never offered, or was already pulled,
  hangs rather than failing: docs/architecture.md "Platform facts").
- Requests (engine/handover.py's Handover, the latents replaced by their transfer ids) go to the decode process,
  its outputs (RequestOutput, as its LLMEngine returns them) come back and the prefill side returns them as its
  own. Perf-counter times are moved into the receiving process's clock on arrival.

A peer that dies or stalls gives every request it holds an "error" with a message within ``timeout`` seconds; the
other side's requests go on. A peer not heard from yet is given ``connect_timeout`` (default 300 s) to start: the
two processes start in either order, each importing JAX and loading the model first, and hand-overs wait for the
decode process meanwhile. ``PrefillEngine`` is the prefill side (LLMEngine's interface; ``LLM(...,
pd_address=...)`` uses it), ``DecodeServer`` the decode side (``jaxinfer generate --role decode``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import pickle
import queue
import secrets
import sys
import threading
import time
from collections.abc import Iterable

import jax
from jax.experimental import transfer
from jax.sharding import SingleDeviceSharding

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import LLMEngine
from jaxinfer.engine.handover import Handover
from jaxinfer.engine.outputs import CompletionOutput, RequestOutput

HEARTBEAT_S = 0.5   # a heartbeat this often, from each side's channel thread
DEFAULT_TIMEOUT_S = 30.0
# For the first contact: SGLang's disaggregation waits 300 s by default for its peer's bootstrap
# (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT); a process starting on a loaded machine takes seconds to import JAX alone.
DEFAULT_CONNECT_TIMEOUT_S = 300.0


def _seconds(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
    return float(value)


def _one_process() -> None:
    """A side of the pair is one process: its engine's channel, transfers and hand-overs are this process's alone
    (a unit spanning processes would need every process of it to take the same messages in the same order)."""
    if jax.process_count() > 1:
        raise ValueError(f"prefill/decode disaggregation across processes runs one process per side; this process "
                         f"is one of {jax.process_count()} (jax.distributed): a unit spanning processes is not "
                         f"supported")


def _host_port(address: str) -> tuple[str, int]:
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"pd_address must be HOST:PORT, got {address!r}")
    return host, int(port)


class Channel:
    """One ZeroMQ DEALER socket, owned by a thread: ``send`` queues a message, ``receive`` returns those that arrived
    (heartbeats only refresh ``last_heard``). bind: the decode side binds the address, the prefill side connects."""

    def __init__(self, address: str, bind: bool):
        import zmq

        host, port = _host_port(address)
        self.address = f"{host}:{port}"
        self._zmq = zmq
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._in: queue.SimpleQueue = queue.SimpleQueue()
        self.started = time.monotonic()
        self.last_heard: float | None = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(f"tcp://{host}:{port}", bind), daemon=True,
                                        name="jaxinfer-pd-channel")
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise ValueError(f"pd_address {self.address}: {self._error}") from None

    def _run(self, endpoint: str, bind: bool) -> None:
        zmq = self._zmq
        context = zmq.Context()
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(endpoint) if bind else sock.connect(endpoint)
        except zmq.ZMQError as e:
            self._error = e
            self._ready.set()
            sock.close()
            context.term()
            return
        self._ready.set()
        next_beat = 0.0
        pending: collections.deque[bytes] = collections.deque()  # not sent yet: no peer, or its queue is full
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_beat:
                    with contextlib.suppress(zmq.Again):  # no peer to hear it: nothing to tell
                        sock.send(pickle.dumps(("heartbeat", None)), zmq.NOBLOCK)
                    next_beat = now + HEARTBEAT_S
                while True:
                    try:
                        pending.append(self._out.get_nowait())
                    except queue.Empty:
                        break
                while pending:  # never blocks: a DEALER without a peer would block a send until one connects
                    try:
                        sock.send(pending[0], zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    pending.popleft()
                if sock.poll(20, zmq.POLLIN):
                    while sock.poll(0, zmq.POLLIN):
                        kind, payload = pickle.loads(sock.recv())
                        self.last_heard = time.monotonic()
                        if kind != "heartbeat":
                            self._in.put((kind, payload))
        finally:
            sock.close()
            context.term()

    def send(self, kind: str, payload=None) -> None:
        self._out.put(pickle.dumps((kind, payload)))

    def receive(self, wait: float = 0.0) -> list[tuple[str, object]]:
        messages = []
        try:
            messages.append(self._in.get(timeout=wait) if wait else self._in.get_nowait())
            while True:
                messages.append(self._in.get_nowait())
        except queue.Empty:
            pass
        return messages

    def peer_lost(self, peer: str, timeout: float, connect_timeout: float) -> str | None:
        """Why the peer (named ``peer`` in the message) counts as gone, or None: heard from once, then silent for
        ``timeout`` seconds; or never heard from in ``connect_timeout`` seconds since this channel started."""
        now = time.monotonic()
        if self.last_heard is None:
            if now - self.started <= connect_timeout:
                return None
            return (f"no {peer} answered at {self.address} within {connect_timeout:g} s (is it running, with this "
                    "--pd-address?)")
        if now - self.last_heard <= timeout:
            return None
        return f"the {peer} at {self.address} sent nothing for {timeout:g} s (dead or stalled)"

    def close(self, drain_s: float = 0.5) -> None:
        """Sends what is queued (for up to ``drain_s``), then stops the thread."""
        deadline = time.monotonic() + drain_s
        while not self._out.empty() and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stop.set()
        self._thread.join(timeout=5)


def _transfer_server(mesh, peer_host: str):
    """A transfer server of this process's JAX client on the local address that reaches ``peer_host`` (the
    interface the operating system routes to it: 127.0.0.1 for a peer on this machine)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(peer_host), 9))  # no packet is sent: it only picks the route
        host = probe.getsockname()[0]
    client = mesh.devices.flat[0].client
    return transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])


@dataclasses.dataclass(frozen=True)
class _Remote:
    """Latents offered for a pull: their transfer id, shape and dtype."""

    uuid: int
    shape: tuple[int, ...]
    dtype: str


def _failed(request_id: str, n: int, error: str) -> RequestOutput:
    return RequestOutput(request_id, None, [], [CompletionOutput(i, [], "", "error", error) for i in range(n)],
                         dict(ttft_s=None, tpot_s=None, num_prompt_tokens=0, num_cached_prompt_tokens=0,
                              num_storage_cached_prompt_tokens=0, num_output_tokens=0, num_draft_tokens=0,
                              num_accepted_tokens=0), finished=True)


class PrefillEngine:
    """The prefill process's side: LLMEngine's interface (add_request, step, abort_request,
    has_unfinished_requests, stats) over a prefill engine here and a decode engine in the process serving
    ``address`` (``DecodeServer``). Requests that reach the decode process come back from it; if it stays silent
    for ``timeout`` seconds every request it holds finishes with "error". ``stats`` are the prefill engine's, plus
    the finished requests' tokens and the latent bytes the decode process pulled (its steps are logged there)."""

    def __init__(self, config: EngineConfig, address: str, timeout: float = DEFAULT_TIMEOUT_S,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S):
        self.timeout = _seconds(timeout, "pd_timeout")
        self.connect_timeout = _seconds(connect_timeout, "pd_connect_timeout")
        _one_process()
        self.channel = Channel(address, bind=False)
        self.prefill = LLMEngine.from_config(config, role="prefill")
        self._transfer = _transfer_server(self.prefill.model.mesh, self.channel.address.rpartition(":")[0])
        self._offered: dict[int, tuple[str, jax.Array]] = {}   # uuid -> (request id, latents until acknowledged)
        self._remote: dict[str, tuple[int, float]] = {}       # request id -> (samples, time sent), at the decode
        self.stats = self.prefill.stats

    model = property(lambda self: self.prefill.model)
    model_path = property(lambda self: self.prefill.model_path)
    tokenizer = property(lambda self: self.prefill.tokenizer)
    scheduler = property(lambda self: self.prefill.scheduler)
    runner = property(lambda self: self.prefill.runner)
    config = property(lambda self: self.prefill.config)

    def clear_step_log(self) -> None:
        self.prefill.clear_step_log()

    def add_request(self, request_id: str, prompt, sampling_params=None, *, output_kind="cumulative") -> None:
        if request_id in self._remote:
            raise ValueError(f"request_id {request_id!r} is the id of an unfinished request")
        self.prefill.add_request(request_id, prompt, sampling_params, output_kind=output_kind)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.prefill.abort_request(ids)
        remote = [rid for rid in ids if self._remote.pop(rid, None) is not None]
        if remote:
            self.channel.send("abort", remote)
            self._offered = {u: o for u, o in self._offered.items() if o[0] not in remote}

    def has_unfinished_requests(self) -> bool:
        return self.prefill.has_unfinished_requests() or bool(self._remote)

    def step(self) -> list[RequestOutput]:
        """A prefill step here (its hand-overs offered and sent), then what the decode process returned."""
        outputs = self.prefill.step() if self.prefill.has_unfinished_requests() else []
        for h in self.prefill.take_handovers():
            self._send(h)
        wait = 0.0 if self.prefill.has_unfinished_requests() else 0.05  # nothing to compute here: wait for news
        for kind, payload in self.channel.receive(wait):
            if kind == "outputs":
                sent_at, outs = payload
                for out in outs:
                    if out.request_id not in self._remote:
                        continue  # aborted, or failed here already
                    if out.finished:
                        del self._remote[out.request_id]
                        self.stats.finished_output_tokens += out.metrics["num_output_tokens"]
                        self.stats.finished_input_tokens += out.metrics["num_prompt_tokens"] * len(out.outputs)
                    outputs.append(out)
            elif kind == "ack":
                for uuid in payload:
                    self._offered.pop(uuid, None)
            elif kind == "transfer_bytes":
                self.stats.kv_transfer_bytes += payload
        lost = self._remote and self.channel.peer_lost("decode process", self.timeout, self.connect_timeout)
        if lost:
            error = f"{lost}: its requests are lost"
            outputs += [_failed(rid, n, error) for rid, (n, _) in self._remote.items()]
            self._remote.clear()
            self._offered.clear()
        return outputs

    def _send(self, h: Handover) -> None:
        children = []
        for c in h.children:
            if c.latents is not None:
                uuid = secrets.randbits(63)
                # One buffer (on the prefill rank's device), as the decode process pulls it: a pull names the
                # offer's buffers by index.
                self._transfer.await_pull(uuid, [c.latents])
                self._offered[uuid] = (h.request_id, c.latents)
                c = dataclasses.replace(c, latents=_Remote(uuid, tuple(c.latents.shape), str(c.latents.dtype)))
            children.append(c)
        self._remote[h.request_id] = (len(h.children), time.perf_counter())
        self.channel.send("handover", (time.perf_counter(), self._transfer.address(),
                                       dataclasses.replace(h, children=tuple(children))))

    def wait_for_compilations(self) -> None:
        self.prefill.wait_for_compilations()

    def cache_stats(self) -> dict:
        return self.prefill.cache_stats()

    def close(self) -> None:
        """Tells the decode process to finish and exit once its requests are done."""
        self.channel.send("shutdown")
        self.channel.close()


class DecodeServer:
    """The decode process's side: a decode engine (``.engine``) serving ``address`` (bound here). ``run()`` takes
    the prefill process's hand-overs, pulls their latents, decodes and sends the outputs back."""

    def __init__(self, config: EngineConfig, address: str, timeout: float = DEFAULT_TIMEOUT_S,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S):
        self.timeout = _seconds(timeout, "pd_timeout")
        self.connect_timeout = _seconds(connect_timeout, "pd_connect_timeout")
        _one_process()
        self.channel = Channel(address, bind=True)
        self.engine = LLMEngine.from_config(config, role="decode")
        mesh = self.engine.model.mesh
        self._sharding = SingleDeviceSharding(mesh.devices.flat[0])  # pulled there; the runner places them
        self._server, self._connections = None, {}  # the transfer server, once the prefill side's host is known

    def run(self, log=sys.stderr) -> int:
        """Serves until the prefill process says "shutdown" and nothing is left (returns 0), or it is lost (silent
        for ``timeout`` seconds, or never heard from in ``connect_timeout``): its requests are aborted and listed on
        ``log`` (returns 1)."""
        engine, channel = self.engine, self.channel
        pulls: list = []
        shutdown = False
        try:
            while True:
                for kind, payload in channel.receive(0.0 if engine.has_unfinished_requests() or pulls else 0.05):
                    if kind == "handover":
                        pulls.append(self._pull(*payload))
                    elif kind == "abort":  # pulls under way are dropped (their threads end on their own)
                        engine.abort_request(payload)
                        pulls = [p for p in pulls if p[0].request_id not in payload]
                    elif kind == "shutdown":
                        shutdown = True
                pulls = _finish_pulls(pulls, engine, channel, self.timeout)
                if engine.has_unfinished_requests():
                    outs = engine.step()
                    if outs:
                        channel.send("outputs", (time.perf_counter(), outs))
                elif shutdown and not pulls:
                    return 0
                why = channel.peer_lost("prefill process", self.timeout, self.connect_timeout)
                if why:
                    lost = engine.unfinished_request_ids()
                    engine.abort_request(lost)
                    print(f"[jaxinfer] {why}: aborted {len(lost)} request(s) {lost}", file=log)
                    return 1
        finally:
            channel.close()

    def _pull(self, sent_at: float, peer: str, h: Handover):
        if self._server is None:
            self._server = _transfer_server(self.engine.model.mesh, peer.rpartition(":")[0])
        if peer not in self._connections:
            self._connections[peer] = self._server.connect(peer)
        return _start_pull(self._connections[peer], h, self._sharding, time.perf_counter() - sent_at)


def _start_pull(conn, h: Handover, sharding: SingleDeviceSharding, clock_shift: float):
    """Pulls a hand-over's latents in a thread onto ``sharding`` (one device, as offered; the decode step that
    admits the request copies them to its rank's device, engine/page_io.py ``put_on_rank``); a pull of an id the
    peer never offers would hang: the caller gives up after the timeout. Times move into this process's clock."""
    shift = lambda t: None if t is None else t + clock_shift  # noqa: E731
    h = dataclasses.replace(h, arrival=shift(h.arrival), first_token=shift(h.first_token),
                            last_token=shift(h.last_token))
    result: dict = {}

    def pull():
        try:
            for c in h.children:
                if c.latents is not None:
                    spec = jax.ShapeDtypeStruct(c.latents.shape, c.latents.dtype, sharding=sharding)
                    (array,) = conn.pull(c.latents.uuid, [spec])
                    result[c.latents.uuid] = jax.block_until_ready(array)
        except Exception as e:  # a dead peer: "Connection closed"
            result["error"] = e

    thread = threading.Thread(target=pull, daemon=True, name="jaxinfer-pd-pull")
    thread.start()
    return h, time.monotonic(), thread, result


def _finish_pulls(pulls: list, engine: LLMEngine, channel: Channel, timeout: float) -> list:
    """Hands the completed pulls to the engine (and acknowledges them); fails those that error or time out."""
    waiting = []
    for h, started, thread, result in pulls:
        if thread.is_alive() and time.monotonic() - started < timeout:
            waiting.append((h, started, thread, result))
            continue
        if thread.is_alive() or "error" in result:
            why = result.get("error") or f"no latents after {timeout:g} s"
            error = f"pulling the prompt's latents from the prefill process failed: {why}"
            channel.send("outputs", (time.perf_counter(), [_failed(h.request_id, len(h.children), error)]))
            continue
        uuids = [c.latents.uuid for c in h.children if c.latents is not None]
        children = tuple(c if c.latents is None else dataclasses.replace(c, latents=result[c.latents.uuid])
                         for c in h.children)
        h = dataclasses.replace(h, children=children)
        channel.send("ack", uuids)
        channel.send("transfer_bytes", h.num_latent_bytes)
        engine.add_prefilled(h)
    return waiting
