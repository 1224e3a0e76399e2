"""SamplingParams: the defaults and ranges of the public contract (docs/architecture.md "Public contract"; vLLM's
ranges), normalisation, frozen."""

import dataclasses
import re

import pytest

from jaxinfer.engine import SamplingParams

CONTRACT_DEFAULTS = dict(temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0, max_tokens=16, seed=None, stop=(),
                         stop_token_ids=(), ignore_eos=False, n=1, logprobs=None, presence_penalty=0.0,
                         frequency_penalty=0.0, repetition_penalty=1.0, structured_outputs=None)


def test_defaults_are_the_contract():
    p = SamplingParams()
    assert {f.name: getattr(p, f.name) for f in dataclasses.fields(p)} == CONTRACT_DEFAULTS
    assert not p.greedy and not p.uses_penalties


BAD = [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "1"),
    ("top_p", 0.0), ("top_p", 1.0001), ("top_p", -0.5), ("top_p", float("nan")),
    ("top_k", -2), ("top_k", 2.5), ("top_k", True),
    ("min_p", -0.01), ("min_p", 1.01),
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", 16.0),
    ("n", 0), ("n", 1.5),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", float("inf")),
    ("presence_penalty", 2.01), ("presence_penalty", -2.5),
    ("frequency_penalty", 2.5), ("frequency_penalty", -2.01),
    ("logprobs", -1), ("logprobs", 1.0),
    ("seed", 1.5), ("seed", "7"), ("seed", True),
    ("ignore_eos", 1),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", [3]), ("stop", 5),
    ("structured_outputs", "json"), ("structured_outputs", {"regex": "a", "choice": ["a"]}),
    ("stop_token_ids", [1, -1]), ("stop_token_ids", [1.0]), ("stop_token_ids", "12"), ("stop_token_ids", 7),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_field_raises_value_error_naming_it(field, value):
    with pytest.raises(ValueError, match=re.escape(field)) as err:
        SamplingParams(**{field: value})
    assert repr(value) in str(err.value) or str(value) in str(err.value)


GOOD = [
    ("temperature", 0), ("temperature", 0.0), ("temperature", 5.0), ("top_p", 1e-6), ("top_p", 1),
    ("top_k", 0), ("top_k", -1), ("top_k", 1), ("top_k", 10**6), ("min_p", 0.0), ("min_p", 1.0),
    ("max_tokens", 1), ("n", 4), ("repetition_penalty", 1e-3), ("repetition_penalty", 2.5),
    ("presence_penalty", -2), ("presence_penalty", 2.0), ("frequency_penalty", -2.0), ("frequency_penalty", 2),
    ("logprobs", 0), ("logprobs", 20), ("seed", 0), ("seed", -5), ("seed", 2**70), ("ignore_eos", True),
]


@pytest.mark.parametrize("field,value", GOOD, ids=[f"{f}={v!r}" for f, v in GOOD])
def test_edges_of_the_ranges_are_accepted(field, value):
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_numbers_are_normalised_to_float_and_int():
    p = SamplingParams(temperature=1, top_p=1, min_p=0, presence_penalty=1, repetition_penalty=2)
    assert all(type(getattr(p, f)) is float for f in ("temperature", "top_p", "min_p", "presence_penalty",
                                                      "repetition_penalty"))


def test_stop_and_stop_token_ids_are_normalised_to_tuples():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=("a",)).stop == ("a",)
    assert SamplingParams(stop_token_ids=[5, 7]).stop_token_ids == (5, 7)
    assert SamplingParams(stop_token_ids=range(3)).stop_token_ids == (0, 1, 2)
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()


def test_frozen_hashable_and_replace_revalidates():
    p = SamplingParams(temperature=0.5, stop=["x"], stop_token_ids=[2])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0
    assert hash(p) == hash(SamplingParams(temperature=0.5, stop="x", stop_token_ids=(2,)))
    assert p == SamplingParams(temperature=0.5, stop="x", stop_token_ids=(2,))
    assert len({p, SamplingParams(temperature=0.5, stop="x", stop_token_ids=[2]), SamplingParams()}) == 2
    with pytest.raises(ValueError, match="top_p"):
        dataclasses.replace(p, top_p=0.0)


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy  # below vLLM's _SAMPLING_EPS = 1e-5
    assert not SamplingParams(temperature=1e-4).greedy
    assert SamplingParams(presence_penalty=0.1).uses_penalties
    assert SamplingParams(frequency_penalty=-0.1).uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
