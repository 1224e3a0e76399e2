"""The stage-by-stage dual-microbatch timeline (jaxinfer/plan/overlap.py) against timelines worked by hand, and its
bounds: never faster than either stream alone, never slower than the two in series."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxinfer.plan import Hardware, predict
from jaxinfer.plan.overlap import DECODE, OPS, PREFILL, stages, timeline

LAYER = dict(prepare=1.0, core=2.0, shared=1.0, experts=3.0, dispatch=4.0, combine=5.0)


def test_decode_stages_are_sglangs_five():
    own = stages(DECODE, 2)
    assert len(own) == 11  # 5 yields a layer, and the stage after the last one (the next layer's prepare)
    assert [[op for _, op, _ in s] for s in own[:5]] == [
        ["prepare"], ["core"], ["dispatch", "shared"], ["dispatch", "experts", "combine"], ["combine"]]
    assert [(kind, layer) for kind, _, layer in own[5]] == [("compute", 1)]


def test_decode_timeline_by_hand():
    """One layer, microbatch b two stages behind a (order a0 a1 a2 b0 a3 b1 a4 b2 a5 b3 b4 b5):
    a: prepare 0-1, core 1-3, dispatch issued at 3 (arrives 7), shared 3-4; b: prepare 4-5; a waits for its
    dispatch (7), experts 7-10, combine issued at 10 (arrives 15); b: core 10-12; a waits for its combine (15);
    b: dispatch issued at 15 (arrives 19), shared 15-16, waits (19), experts 19-22, combine 22-27, waits: 27.
    In series: 2 x (1 + 2 + 1 + 3) + 2 x (4 + 5) = 32; the larger stream alone: 18."""
    assert timeline(DECODE, [LAYER]) == 27.0


def test_prefill_timeline_by_hand():
    """One layer, no delay (order a0 b0 a1 b1 a2 b2): a: prepare + core 0-3, dispatch issued (arrives 7); b:
    prepare + core 3-6, dispatch issued at 6 but the link is busy until 7 (arrives 11); a waits (7), experts 7-10,
    combine issued at 10, link busy until 11 (arrives 16); b waits (11), experts 11-14, combine issued at 14, link
    busy until 16 (arrives 21); a: shared 14-15, waits (16); b: shared 16-17, waits (21)."""
    assert timeline(PREFILL, [LAYER]) == 21.0


def test_a_hidden_transfer_costs_nothing_but_the_drain():
    """Decode: a microbatch's dispatch hides behind its shared experts and the other's prepare, its combine behind
    the other's core; only microbatch b's last layer has no a beside it (the pipeline's drain): its dispatch waits
    2 - 1 (its shared experts) and its combine 2."""
    layer = dict(LAYER, dispatch=2.0, combine=2.0)
    assert timeline(DECODE, [layer] * 3) == 2 * 3 * (1 + 2 + 1 + 3) + (2 - 1) + 2


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([DECODE, PREFILL]), st.integers(1, 6),
       st.lists(st.floats(0.0, 10.0), min_size=len(OPS), max_size=len(OPS)))
def test_the_timeline_lies_between_overlap_and_series(program, num_layers, seconds):
    layer = dict(zip(OPS, seconds))
    compute = 2 * num_layers * sum(layer[op] for op in ("prepare", "core", "shared", "experts"))
    comm = 2 * num_layers * (layer["dispatch"] + layer["combine"])
    t = timeline(program, [layer] * num_layers)
    assert max(compute, comm) * (1 - 1e-12) <= t <= (compute + comm) * (1 + 1e-12)
    if not comm:
        assert t == pytest.approx(compute)


def test_without_transfers_overlap_is_two_microbatches_in_turn():
    """One GPU (nothing to send): a step of two microbatches computes each half of the requests, reading every
    weight twice, with nothing to hide."""
    big = Hardware("big", bf16_tflops=989.4, fp8_tflops=1978.9, hbm_gb=2000, hbm_gb_s=3350, nvlink_gb_s=200,
                   net_gb_s=50, sms=132)
    kw = dict(hardware=big, phase="decode", ep=1, context_len=1024, expert_imbalance=1.0)
    half = predict(requests_per_gpu=16, dbo=False, **kw)
    whole = predict(requests_per_gpu=32, dbo=True, **kw)
    assert whole["step_s"] == pytest.approx(2 * half["step_s"], rel=1e-12)
    assert whole["bound"] == half["bound"] and whole["communication_s"] == 0
