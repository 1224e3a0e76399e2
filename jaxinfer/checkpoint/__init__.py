"""Checkpoint formats: HF safetensors (incl. DeepSeek FP8) and jaxinfer's orbax form."""

from jaxinfer.checkpoint.errors import CheckpointError

__all__ = ["CheckpointError"]
