"""The embedded default model: a tiny DeepSeek-V3 (with MTP) trained on Python's documentation, in DeepSeek's FP8
checkpoint format, shipped as package data so that ``jaxinfer.LLM()`` works without a download.

Built by ``scripts/train_tiny.py`` (jaxinfer/train); figures in TRAINING.md, expert loads in expert_load.json.
"""

from __future__ import annotations

import pathlib


def path() -> pathlib.Path:
    """The checkpoint directory (config.json, model.safetensors, tokenizer files)."""
    return pathlib.Path(__file__).resolve().parent
