"""Serving engine: sampling parameters, on-device sampler, tokenizer, scheduler (runner and LLM facade to come)."""

from jaxinfer.engine.sampler import SampleOutput, SamplingTensors, advance, sample, token_counts
from jaxinfer.engine.sampling_params import SamplingParams
from jaxinfer.engine.scheduler import ScheduledChunk, Scheduler, StepPlan
from jaxinfer.engine.sequence import Sequence, SequenceStatus
from jaxinfer.engine.tokenizer import IncrementalDecoder, Tokenizer

__all__ = ["IncrementalDecoder", "SampleOutput", "SamplingParams", "SamplingTensors", "ScheduledChunk", "Scheduler",
           "Sequence", "SequenceStatus", "StepPlan", "Tokenizer", "advance", "sample", "token_counts"]
