"""Flax NNX DeepSeek model: layers, rope, mla, moe, deepseek (+ MTP)."""

from jaxinfer.models.deepseek import DeepseekForCausalLM

__all__ = ["DeepseekForCausalLM"]
