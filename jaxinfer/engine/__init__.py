"""Serving engine: sampling parameters and the on-device sampler (scheduler, runner and LLM facade to come)."""

from jaxinfer.engine.sampler import SampleOutput, SamplingTensors, advance, sample, token_counts
from jaxinfer.engine.sampling_params import SamplingParams

__all__ = ["SampleOutput", "SamplingParams", "SamplingTensors", "advance", "sample", "token_counts"]
