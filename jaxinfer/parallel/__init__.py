"""Device meshes and sharding rules (DESIGN.md "Mesh semantics")."""

from jaxinfer.parallel.mesh import MeshSpec, make_mesh

__all__ = ["MeshSpec", "make_mesh"]
