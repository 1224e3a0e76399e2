"""Device meshes and what is split over them (docs/architecture.md "Mesh semantics"): the mesh (mesh.py), the
layout plan (plan.py), expert-parallel dispatch and its accounting (dispatch.py, comm.py), expert slot placements
and DeepSeek's EPLB over them (placement.py, eplb.py), multi-process runs (multihost.py). Below the model in
docs/architecture.md "Layers": nothing here imports jaxinfer.models; applying a placement to a loaded model's
experts is ``jaxinfer.rebalance``."""

from jaxinfer.parallel.mesh import MeshSpec, make_mesh

__all__ = ["MeshSpec", "make_mesh"]
