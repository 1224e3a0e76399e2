"""One process of a multi-process test run (spawned by tests/parallel/test_multihost.py, one per process id).

    python tests/parallel/multihost_worker.py COORDINATOR NUM_PROCESSES PROCESS_ID LOCAL_DEVICES OUT.npz

Joins the run, then computes on the global 2x4 mesh and saves to OUT.npz:
- ``devices``: [process_index, id] of the mesh's devices in DP-rank order, [8, 2];
- ``partial_mesh_error``: make_mesh's message for a mesh that leaves out process 1's devices;
- ``batch``: ``to_host(jit(batch_fn)(global_array(host_batch())))``, a batch split over all devices (the
  plumbing alone, independent of the model); ``batch_sharded``: whether that result was still split;
- ``logits``: ``Model.random(model_config()).logits(token_ids())``, [B, T, V].
The test imports the same inputs from here (importing this module does not start JAX).
"""

import sys

import numpy as np

MESH = "2x4"


def host_batch() -> np.ndarray:
    """[16, 3] float32: two rows per DP rank of the 2x4 mesh."""
    return np.arange(48, dtype=np.float32).reshape(16, 3)


def batch_fn(x):
    """Row-local work plus a global reduction: [B, F] -> [B, F]."""
    return x * 2.0 + x.sum()


def model_config():
    import jaxinfer

    return jaxinfer.ModelConfig.tiny(num_hidden_layers=2)


def token_ids() -> np.ndarray:
    """[3, 5] int32: B = 3 is padded to the 8 DP ranks inside Model.logits."""
    return np.random.default_rng(0).integers(0, 257, size=(3, 5), dtype=np.int32)


def main(coordinator: str, num_processes: int, process_id: int, local_devices: int, out: str) -> None:
    from jaxinfer.parallel import multihost

    multihost.initialize(coordinator, num_processes, process_id, local_devices, timeout_s=120)

    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxinfer
    from jaxinfer.parallel.mesh import make_mesh

    mesh = make_mesh(MESH)
    saved = dict(devices=np.array([[d.process_index, d.id] for d in mesh.devices.flat]))
    try:
        make_mesh("1x4")
    except ValueError as e:
        saved["partial_mesh_error"] = np.array(str(e))
    x = multihost.global_array(host_batch(), NamedSharding(mesh, P(("data", "expert"))))  # [16, 3]
    y = jax.jit(batch_fn)(x)
    saved["batch_sharded"] = np.array(not y.is_fully_replicated)  # so to_host gathered across processes
    saved["batch"] = multihost.to_host(y)
    np.savez(out, **saved)  # saved before the model runs, so a model failure keeps these
    model = jaxinfer.Model.random(model_config(), mesh=MESH, dtype="float32", seed=0)
    saved["logits"] = model.logits(token_ids())  # [3, 5, 257]
    np.savez(out, **saved)


if __name__ == "__main__":
    coordinator, num_processes, process_id, local_devices, out = sys.argv[1:]
    main(coordinator, int(num_processes), int(process_id), int(local_devices), out)
