"""Prefill/decode disaggregation in one process (DeepSeek's deployment units; docs/architecture.md "Prefill/decode
disaggregation"): two LLMEngines on disjoint devices, each its own ('data', 'expert') mesh.

The prefill engine (role "prefill") runs prefill steps only; once a request's prompt is computed and its first
token known, it hands the request over (engine/handover.py) with its prompt's latents, gathered on its devices by
a program dispatched right after the step. ``step()`` passes the request to the decode engine (role "decode"),
whose scheduler picks its rank; the latents stay on the prefill device until the decode step that admits the
request copies them to that rank's device alone and writes them into its pages (engine/page_io.py
``put_on_rank``), and the decode engine continues the request. Each engine keeps one step
in flight and the host drives both from one loop: the prefill engine's step and the decode engine's step run on
their devices at the same time, and the decode engine never waits for a host round trip per step (a hand-over
happens when the host applies a prefill step, which it does anyway to see the first token).

Both engines take the same EngineConfig but the mesh (and the KV storage tier, the prefill engine's only), so they
share the engine seed; the sequence ids (hence the sampling keys) are the prefill engine's, so seeded and unseeded
samples equal a co-located engine's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np
from jax.sharding import Mesh

from jaxinfer.engine.config import EngineConfig
from jaxinfer.engine.engine import LLMEngine
from jaxinfer.engine.outputs import EngineStats, RequestOutput
from jaxinfer.parallel.mesh import make_mesh, mesh_shape, ordered_devices


def split_meshes(mesh, prefill_mesh, decode_mesh) -> tuple[Mesh, Mesh]:
    """The two engines' meshes: "DxE" strings and mesh files take devices in order, the prefill mesh's first;
    Mesh objects are used as they are and must not share a device.

    Raises ValueError naming the meshes: one given without the other, ``mesh`` given too, more devices than this
    run has, or meshes that overlap."""
    if (prefill_mesh is None) != (decode_mesh is None):
        raise ValueError(f"prefill_mesh and decode_mesh go together: got prefill_mesh={prefill_mesh!r}, "
                         f"decode_mesh={decode_mesh!r}")
    if mesh is not None:
        raise ValueError(f"mesh={mesh!r} with prefill_mesh / decode_mesh: each engine has its own mesh, pass mesh=None")
    devices = ordered_devices()
    sizes = [int(np.prod(m.devices.shape)) if isinstance(m, Mesh) else int(np.prod(mesh_shape(m, len(devices))))
             for m in (prefill_mesh, decode_mesh)]
    if sum(sizes) > len(devices):
        raise ValueError(f"prefill_mesh {prefill_mesh!r} ({sizes[0]} devices) and decode_mesh {decode_mesh!r} "
                         f"({sizes[1]}) need {sum(sizes)} devices, this run has {len(devices)} (CPU: --cpu-devices "
                         "/ XLA_FLAGS=--xla_force_host_platform_device_count)")
    prefill = make_mesh(prefill_mesh, None if isinstance(prefill_mesh, Mesh) else devices)
    rest = [d for d in devices if d not in set(prefill.devices.flat)]
    decode = make_mesh(decode_mesh, None if isinstance(decode_mesh, Mesh) else rest)
    shared = set(prefill.devices.flat) & set(decode.devices.flat)
    if shared:
        raise ValueError(f"prefill_mesh and decode_mesh share devices {sorted(d.id for d in shared)}: they must be "
                         "disjoint")
    return prefill, decode


class DisaggregatedEngine:
    """LLMEngine's interface (add_request, step, abort_request, has_unfinished_requests, stats) over a prefill
    engine (``.prefill``) and a decode engine (``.decode``) on ``split_meshes``' meshes."""

    def __init__(self, config: EngineConfig, prefill_mesh, decode_mesh):
        prefill, decode = split_meshes(config.mesh, prefill_mesh, decode_mesh)
        self.prefill = LLMEngine.from_config(dataclasses.replace(config, mesh=prefill), role="prefill")
        try:
            self.decode = LLMEngine.from_config(
                dataclasses.replace(config, mesh=decode, kv_cache_dir=None, kv_cache_max_bytes=None), role="decode")
        except ValueError as e:
            raise ValueError(f"decode_mesh {decode_mesh!r}: {e}") from None

    # What LLM shows of its engine: the decode engine's (the prefill engine's through .prefill).
    model = property(lambda self: self.decode.model)
    model_path = property(lambda self: self.decode.model_path)
    tokenizer = property(lambda self: self.decode.tokenizer)
    scheduler = property(lambda self: self.decode.scheduler)
    runner = property(lambda self: self.decode.runner)
    config = property(lambda self: self.decode.config)

    @property
    def stats(self) -> EngineStats:
        """Both engines' counters summed; the step log merged in dispatch order."""
        return EngineStats.combine(self.prefill.stats, self.decode.stats)

    def clear_step_log(self) -> None:
        self.prefill.clear_step_log()
        self.decode.clear_step_log()

    def add_request(self, request_id: str, prompt, sampling_params=None, *, output_kind="cumulative") -> None:
        """LLMEngine.add_request on the prefill engine (a request id unfinished on either engine: ValueError)."""
        if request_id in self.decode._requests:
            raise ValueError(f"request_id {request_id!r} is the id of an unfinished request")
        self.prefill.add_request(request_id, prompt, sampling_params, output_kind=output_kind)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.prefill.abort_request(ids)
        self.decode.abort_request(ids)

    def has_unfinished_requests(self) -> bool:
        return self.prefill.has_unfinished_requests() or self.decode.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """A step of each engine: the prefill engine's (its finished hand-overs move to the decode engine), then the
        decode engine's. Returns both engines' outputs."""
        outputs = self.prefill.step()
        for h in self.prefill.take_handovers():
            self.decode.add_prefilled(h)
        return outputs + self.decode.step()

    def wait_for_compilations(self) -> None:
        self.prefill.wait_for_compilations()
        self.decode.wait_for_compilations()

    def cache_stats(self) -> dict:
        """The prefill engine's (it holds the KV storage tier and computes the prompts)."""
        return self.prefill.cache_stats()

    def expert_load(self) -> np.ndarray:
        """Both engines' routed-expert loads summed ([num_moe_layers, n_routed_experts])."""
        return self.prefill.expert_load() + self.decode.expert_load()

    def rebalance_experts(self, num_nodes: int = 1):
        """Re-places each engine's experts by its own load (each has its own expert axis); returns the decode
        engine's placement."""
        self.prefill.rebalance_experts(num_nodes)
        return self.decode.rebalance_experts(num_nodes)
