"""Pallas kernels (Mosaic GPU for Hopper) with pure-jnp references: MLA decode, FP8 GEMMs, FP8 quantization.

Each kernel comes in four parts (DESIGN.md "Kernels"): kernel body, pallas wrapper, jitted entry with
``implementation=`` and tuning knobs, and a ``*_reference``. The kernels land with their own issue.
"""
