"""Serving engine: sampling parameters, the on-device sampler, the tokenizer (scheduler, runner and LLM facade to
come)."""

from jaxinfer.engine.sampler import SampleOutput, SamplingTensors, advance, sample, token_counts
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.tokenizer import IncrementalDecoder, Tokenizer

__all__ = ["IncrementalDecoder", "SampleOutput", "SamplingParams", "SamplingTensors", "Tokenizer", "advance", "sample",
           "token_counts"]
