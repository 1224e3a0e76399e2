"""Draft verification (engine/rejection_sampler.py ``verify``) on fixed tensors, in the style of vLLM's
tests/v1/sample/test_rejection_sampler.py, against numpy references of its documented semantics.

Layout: a row's real columns are its last n of T (first = T - n); column ``first`` holds its last known token and
columns first + 1 .. T - 1 its drafts; column c's logits judge the draft at column c + 1. Greedy rows accept while
the draft is the argmax of the penalised logits (penalties at column c count the row's outputs and its drafts at
columns first + 1 .. c); random rows accept a draft x with probability p_c(x) (a point-mass draft distribution),
recover from p_c without x, and take a bonus token from p at the last column. Output tokens of a row:
token_ids[row, first : first + num_accepted + 1].

Oracles: hand-built cases (expected tokens written out), a numpy greedy reference (penalty formulas of vLLM, as in
test_sampler.py), the documented key derivation (fold_in(fold_in(key(s), o), ACCEPT / RECOVER), o = steps +
c - first) recomputed with jax.random, and a statistical test: R = 4000 seeded rows of one fixed row, Pearson's
chi-square (cells merged to expected counts >= 5, scipy's p-value) at significance 1e-3 of (a) the first output,
(b) the second output given the first draft accepted, (c) the bonus given both accepted, against the exact
processed distributions in float64; the same samples must reject wrong references (a sampler that recovers from
p instead of p without the draft, or ignores the temperature) with p < 1e-6.

Two programs: R = 8 rows, T = 4, V = 8 with penalties on and logprobs width 2 (the unit tests; only values
change), and R = 4000, T = 3 without penalties or logprobs (the statistical test).
"""

from __future__ import annotations


import jax
import numpy as np
import pytest
import scipy.stats

from jaxinfer.engine.rejection_sampler import ACCEPT, RECOVER, verify
from jaxinfer.engine.sampler import SamplingTensors
from jaxinfer.engine.sampling_params import SamplingParams

from chi_square import chi_square_pvalue

R, T, V, K = 8, 4, 8, 2
_verify = jax.jit(verify)


def test_chi_square_pvalue_pools_small_cells():
    """Impossible outcomes give p = 0; cells of expected count < 5 are pooled before scipy's chi-square tail."""
    p, _, df = chi_square_pvalue([50, 50, 0, 0], [0.5, 0.5, 0.0, 0.0])
    assert p == 1.0 and df == 1
    assert chi_square_pvalue([50, 49, 1], [0.5, 0.5, 0.0])[0] == 0.0  # an impossible outcome
    p, stat, df = chi_square_pvalue([57, 38, 4, 1], [0.5, 0.44, 0.03, 0.03])  # the two small cells pooled
    assert df == 2 and stat == pytest.approx(7 ** 2 / 50 + 6 ** 2 / 44 + 1 ** 2 / 6)
    assert p == pytest.approx(scipy.stats.chi2.sf(stat, 2))


# --- helpers -----------------------------------------------------------------------------------------------------

def run(rows):
    """verify on the shared program: rows (at most R) of dicts logits [T, V], ids [T], first, params, and optional
    counts [V], prompt [V] bool, steps; padded with padding rows (first = T, as the runner passes them). Returns
    the VerifyOutput of the given rows as numpy."""
    n = len(rows)
    logits = np.zeros((R, T, V), np.float32)
    ids = np.zeros((R, T), np.int32)
    first = np.full((R,), T, np.int32)
    counts = np.zeros((R, V), np.int32)
    prompt = np.zeros((R, V), bool)
    steps = np.zeros((R,), np.int32)
    for i, row in enumerate(rows):
        logits[i], ids[i], first[i] = row["logits"], row["ids"], row["first"]
        counts[i] = row.get("counts", 0)
        prompt[i] = row.get("prompt", False)
        steps[i] = row.get("steps", 0)
    tensors = SamplingTensors.build([row["params"] for row in rows], V, num_rows=R, output_token_counts=counts,
                                    prompt_token_mask=prompt, steps=steps, max_logprobs=K)
    out = _verify(logits, ids, first, tensors)
    return jax.tree.map(lambda x: np.asarray(x)[:n], out)


def outputs(out, i, first):
    """The output tokens of row i."""
    return out.token_ids[i, first:first + out.num_accepted[i] + 1].tolist()


def ref_penalties(logits, counts, prompt, p: SamplingParams):
    """vLLM's apply_penalties for one row, float64 (repetition on prompt | output tokens, then frequency, presence)."""
    logits = logits.astype(np.float64)
    r = np.where(prompt | (counts > 0), p.repetition_penalty, 1.0)
    logits = np.where(logits > 0, logits / r, logits * r)
    return logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0)


def ref_greedy(logits, ids, first, params, counts=None, prompt=None):
    """Greedy verification of one row in numpy: (output tokens, accepted). Column c's penalties count the outputs
    and the drafts at columns first + 1 .. c."""
    counts = np.zeros(V, np.int64) if counts is None else np.array(counts, np.int64)
    prompt = np.zeros(V, bool) if prompt is None else prompt
    tokens = []
    for c in range(first, T):
        best = int(np.argmax(ref_penalties(logits[c], counts, prompt, params)))
        tokens.append(best)
        if c == T - 1 or ids[c + 1] != best:
            return tokens, len(tokens) - 1
        counts[ids[c + 1]] += 1
    raise AssertionError("unreachable")


def log_softmax(x):
    x = np.asarray(x, np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def processed_probs(logits, temperature=1.0, top_k=0):
    """The sampler's distribution of float32 logits [..., V] without penalties: / temperature (float32), top-k
    keeps the values >= the k-th largest (0: off); float64."""
    scaled = (np.asarray(logits, np.float32) / np.float32(temperature)).astype(np.float64)
    if top_k:
        kth = np.sort(scaled, axis=-1)[..., -top_k][..., None]
        scaled = np.where(scaled >= kth, scaled, -np.inf)
    p = np.exp(scaled - scaled.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


GREEDY = SamplingParams(temperature=0.0)
RNG_LOGITS = np.random.default_rng(0).normal(scale=2.0, size=(T, V)).astype(np.float32)
ARGMAX = RNG_LOGITS.argmax(-1)  # [T]
OTHER = (ARGMAX + 1) % V  # a wrong draft per column


# --- greedy ------------------------------------------------------------------------------------------------------

def test_greedy_accepts_the_longest_matching_prefix():
    """vLLM's test_perfect_match / test_early_mismatch: 3 drafts judged by the argmax of the previous column."""
    a, b = ARGMAX, OTHER
    cases = {  # ids (column 0: the last known token) -> (output tokens, accepted)
        "all accepted, bonus": ([5, a[0], a[1], a[2]], [a[0], a[1], a[2], a[3]], 3),
        "first rejected": ([5, b[0], a[1], a[2]], [a[0]], 0),
        "middle rejected": ([5, a[0], b[1], a[2]], [a[0], a[1]], 1),
        "last rejected": ([5, a[0], a[1], b[2]], [a[0], a[1], a[2]], 2),
    }
    rows = [dict(logits=RNG_LOGITS, ids=ids, first=0, params=GREEDY) for ids, _, _ in cases.values()]
    out = run(rows)
    for i, (name, (ids, want, accepted)) in enumerate(cases.items()):
        assert outputs(out, i, 0) == [int(x) for x in want], name
        assert out.num_accepted[i] == accepted, name
        assert (outputs(out, i, 0), accepted) == ref_greedy(RNG_LOGITS, ids, 0, GREEDY), name


def test_greedy_ties_take_the_lowest_id():
    logits = np.zeros((T, V), np.float32)
    logits[:, [2, 5]] = 1.0  # every column: 2 and 5 tie
    out = run([dict(logits=logits, ids=[0, 2, 5, 2], first=0, params=GREEDY),
               dict(logits=logits, ids=[0, 2, 2, 2], first=0, params=GREEDY)])
    assert outputs(out, 0, 0) == [2, 2] and outputs(out, 1, 0) == [2, 2, 2, 2]


def test_no_drafts_gives_the_argmax_or_a_sample_of_the_last_column():
    """first = T - 1 (vLLM's empty draft lists): one token, no acceptance, from the last column only (its
    distribution is the bonus token's, checked statistically below)."""
    last = T - 1
    garbage = np.full((T, V), 50.0, np.float32)  # columns before ``first`` are padding: never read
    garbage[last] = RNG_LOGITS[last]
    top2 = set(np.argsort(RNG_LOGITS[last])[-2:].tolist())
    rows = [dict(logits=garbage, ids=[7, 7, 7, 1], first=last, params=GREEDY),
            dict(logits=garbage, ids=[7, 7, 7, 1], first=last, params=SamplingParams(top_k=1, seed=3))]
    rows += [dict(logits=garbage, ids=[7, 7, 7, 1], first=last, params=SamplingParams(top_k=2, seed=s))
             for s in range(6)]
    out = run(rows)
    np.testing.assert_array_equal(out.num_accepted, 0)
    assert out.token_ids[0, last] == ARGMAX[last] and out.token_ids[1, last] == ARGMAX[last]
    assert set(out.token_ids[2:, last].tolist()) <= top2


def test_padding_rows_and_columns_are_ignored():
    """Rows without a real column (first = T, as the runner passes its padding rows), whatever their logits, ids
    and settings, accept nothing and do not change the real rows; a real row's columns before ``first`` (ids and
    logits) are never read."""
    rng = np.random.default_rng(1)
    a = ARGMAX
    rows = [dict(logits=RNG_LOGITS, ids=[3, 3, a[1], OTHER[2]], first=1, params=GREEDY),
            dict(logits=RNG_LOGITS, ids=[3, a[0], a[1], a[2]], first=0,
                 params=SamplingParams(temperature=0.8, seed=11))]
    out = run(rows)
    full = run(rows + [dict(logits=rng.normal(size=(T, V)) * 9, ids=rng.integers(0, V, T), first=T,
                            params=SamplingParams(temperature=0.0, frequency_penalty=1.0)) for _ in range(R - 2)])
    for field in ("token_ids", "num_accepted", "logprobs", "ranks", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(getattr(full, field)[:2], getattr(out, field), err_msg=field)
    np.testing.assert_array_equal(full.num_accepted[2:], 0)
    # padding columns of row 0 replaced by other values: same result
    moved = dict(rows[0], ids=[0, 3, a[1], OTHER[2]], logits=np.concatenate([rng.normal(size=(1, V)) * 9,
                                                                       RNG_LOGITS[1:]]).astype(np.float32))
    again = run([moved, rows[1]])
    np.testing.assert_array_equal(again.token_ids[0, 1:], out.token_ids[0, 1:])
    assert again.num_accepted[0] == out.num_accepted[0] == 1 and outputs(out, 0, 1) == [a[1], a[2]]


def test_mixed_rows_with_different_numbers_of_drafts():
    """One batch: greedy and random rows with 0 to 3 drafts, all judged by the numpy reference (random rows with
    top_k = 1 are deterministic: they accept exactly the argmax drafts)."""
    rng = np.random.default_rng(2)
    rows, want = [], []
    for i in range(R):
        first = i % T
        logits = rng.normal(scale=2.0, size=(T, V)).astype(np.float32)
        ids = rng.integers(0, V, T)
        accept_until = rng.integers(first, T)  # drafts right up to this column, then random ones
        for c in range(first, accept_until):
            ids[c + 1] = logits[c].argmax()
        params = GREEDY if i % 2 else SamplingParams(temperature=1.3, top_k=1, seed=i)
        rows.append(dict(logits=logits, ids=ids, first=first, params=params))
        want.append(ref_greedy(logits, ids, first, GREEDY))
    out = run(rows)
    for i, (tokens, accepted) in enumerate(want):
        assert (outputs(out, i, rows[i]["first"]), int(out.num_accepted[i])) == (tokens, accepted), i
    assert {int(x) for x in out.num_accepted} >= {0, 1}, "the case should mix rejections and acceptances"


# --- penalties ----------------------------------------------------------------------------------------------------

def _penalty_case():
    """frequency_penalty 1, one earlier output of token 5, drafts 1, 2, 3 after token 7. Column c counts the output
    and the drafts at columns 1 .. c; each column's argmax is a different token if the count is off by one:
      col 0 {1: 3.0, 2: 2.5, 5: 3.5}: 5 -> 2.5 (earlier output), 1 stays 3.0 -> draft 1 accepted
        (not counting the output: 5; counting draft 1 already: 1 -> 2.0 < 2.5: 2);
      col 1 {1: 3.0, 2: 2.5}: 1 -> 2.0 (draft 1) -> 2 accepted (not counting draft 1: 1; counting draft 2: 1);
      col 2 {1: 3.3, 2: 3.4, 3: 2.6}: 1 -> 2.3, 2 -> 2.4 -> 3 accepted (not counting draft 2: 2; counting 3: 2);
      col 3 {3: 3.0, 4: 2.5, 5: 3.2}: 3 -> 2.0, 5 -> 2.2 -> bonus 4 (not counting draft 3: 3).
    """
    logits = np.zeros((T, V), np.float32)
    for c, values in enumerate([{1: 3.0, 2: 2.5, 5: 3.5}, {1: 3.0, 2: 2.5}, {1: 3.3, 2: 3.4, 3: 2.6},
                                {3: 3.0, 4: 2.5, 5: 3.2}]):
        for token, value in values.items():
            logits[c, token] = value
    counts = np.zeros(V, np.int32)
    counts[5] = 1
    return logits, [7, 1, 2, 3], counts


def test_penalties_count_the_drafts_before_each_column():
    logits, ids, counts = _penalty_case()
    freq = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    rows = [dict(logits=logits, ids=ids, first=0, params=freq, counts=counts),
            # the random path: top_k = 1 keeps only the penalised argmax, so it must accept the same drafts
            dict(logits=logits, ids=ids, first=0, params=SamplingParams(frequency_penalty=1.0, top_k=1, seed=5),
                 counts=counts),
            # right-aligned with one draft less: the counts follow the columns
            dict(logits=np.concatenate([np.zeros((1, V)), logits[:3]]), ids=[0, 7, 1, 2], first=1, params=freq,
                 counts=counts)]
    # presence and repetition penalties (token 6 in the prompt), checked against the numpy reference
    rng = np.random.default_rng(3)
    for i in range(R - len(rows)):
        params = SamplingParams(temperature=0.0, repetition_penalty=[1.8, 0.6][i % 2], presence_penalty=1.2,
                                frequency_penalty=0.5)
        lg = rng.normal(scale=1.5, size=(T, V)).astype(np.float32)
        prompt = np.arange(V) == 6
        c = rng.integers(0, 2, V).astype(np.int32)
        dr = [int(rng.integers(0, V))]
        for col in range(T - 1):  # drafts = the reference's own choices, so long runs are accepted
            cnt = c + np.bincount(dr[1:], minlength=V)
            dr.append(int(np.argmax(ref_penalties(lg[col], cnt, prompt, params))) if rng.random() < 0.8
                      else int(rng.integers(0, V)))
        rows.append(dict(logits=lg, ids=dr, first=0, params=params, counts=c, prompt=prompt))
    out = run(rows)
    assert outputs(out, 0, 0) == [1, 2, 3, 4] and out.num_accepted[0] == 3
    assert outputs(out, 1, 0) == [1, 2, 3, 4] and out.num_accepted[1] == 3
    assert outputs(out, 2, 1) == [1, 2, 3] and out.num_accepted[2] == 2
    assert ref_greedy(logits, ids, 0, rows[0]["params"], counts) == ([1, 2, 3, 4], 3)  # the reference agrees
    for i in range(3, R):
        r = rows[i]
        want = ref_greedy(r["logits"], r["ids"], 0, r["params"], r["counts"], r["prompt"])
        assert (outputs(out, i, 0), int(out.num_accepted[i])) == want, i


# --- logprobs ------------------------------------------------------------------------------------------------------

def test_logprobs_are_the_raw_target_logprobs_of_each_output():
    """Each output column's logprob, rank and top-2 are those of the raw log-softmax of that column's logits (not
    the penalised, tempered or filtered distribution: vLLM's raw_logprobs)."""
    rng = np.random.default_rng(4)
    rows = []
    for i in range(R):
        logits = rng.normal(scale=2.0, size=(T, V)).astype(np.float32)
        ids = np.concatenate([[0], logits[:-1].argmax(-1)])  # argmax drafts: mostly accepted
        if i % 3 == 0:
            ids[2] = (ids[2] + 1) % V
        params = SamplingParams(temperature=[0.0, 0.7, 1.5, 1.0][i % 4], top_k=[0, 3][i % 2], logprobs=i % (K + 1),
                                repetition_penalty=1.3, presence_penalty=0.4, seed=i)
        rows.append(dict(logits=logits, ids=ids, first=i % 2, params=params, counts=rng.integers(0, 2, V),
                         prompt=rng.random(V) < 0.3))
    out = run(rows)
    for i, r in enumerate(rows):
        raw = log_softmax(r["logits"])  # [T, V]
        for c in range(r["first"], r["first"] + out.num_accepted[i] + 1):
            token = out.token_ids[i, c]
            assert out.logprobs[i, c] == pytest.approx(raw[c, token], abs=1e-5)
            assert out.ranks[i, c] == (raw[c] >= raw[c, token] - 1e-6).sum()
            order = np.argsort(-raw[c], kind="stable")[:K]
            np.testing.assert_array_equal(out.top_ids[i, c], order)
            np.testing.assert_allclose(out.top_logprobs[i, c], raw[c, order], atol=1e-5)  # max abs error
    assert out.top_ids.shape == (R, T, K) and out.logprobs.shape == (R, T)


# --- seeds and keys ---------------------------------------------------------------------------------------------------

def _random_row(seed, steps=0, first=0):
    logits = RNG_LOGITS / 2
    ids = [4, *ARGMAX[:3]]
    return dict(logits=logits, ids=ids, first=first, params=SamplingParams(temperature=1.0, seed=seed), steps=steps)


def test_seeded_rows_are_reproducible_and_independent_of_their_batch():
    """A seeded row gives the same tokens whatever its position and neighbours (other logits, params, penalties);
    other seeds or steps draw other tokens."""
    rng = np.random.default_rng(5)
    target = _random_row(42, steps=3)
    others = [dict(logits=rng.normal(size=(T, V)).astype(np.float32) * 3, ids=rng.integers(0, V, T),
                   first=int(rng.integers(0, T)), params=SamplingParams(temperature=2.0, top_p=0.8, seed=i,
                                                                        frequency_penalty=0.5),
                   counts=rng.integers(0, 3, V)) for i in range(R)]
    a = run([target] + others[:R - 1])
    b = run(others[3:6] + [target])
    c = run([target] + others[:R - 1])
    for field in ("token_ids", "num_accepted", "logprobs"):
        np.testing.assert_array_equal(getattr(a, field)[0], getattr(b, field)[3], err_msg=field)
        np.testing.assert_array_equal(getattr(a, field), getattr(c, field), err_msg=field)
    many = run([_random_row(s, steps=3) for s in range(R)])
    later = run([_random_row(42, steps=s) for s in range(R)])
    for batch in (many, later):
        results = {(tuple(outputs(batch, i, 0))) for i in range(R)}
        assert len(results) > 1, "other seeds / steps should draw other tokens"


def test_keys_follow_the_documented_derivation():
    """The acceptance uniform of column c is uniform(fold_in(fold_in(key(s), o), ACCEPT)) and the recovered / bonus
    token argmax(log p (without the rejected draft) + gumbel(fold_in(fold_in(key(s), o), RECOVER), V)), with
    o = steps + c - first: recomputed here with jax.random for rows of various seeds, steps and ``first``."""
    rows = [_random_row(seed=1000 + i, steps=[0, 5, 17][i % 3], first=i % 3) for i in range(R)]
    out = run(rows)

    @jax.jit
    def draws(seed, index):
        key = jax.random.key(seed, impl="threefry2x32")
        key = jax.random.fold_in(key, index)
        return (jax.random.uniform(jax.random.fold_in(key, ACCEPT), (), np.float32),
                jax.random.gumbel(jax.random.fold_in(key, RECOVER), (V,), np.float32))

    for i, r in enumerate(rows):
        logp = log_softmax(r["logits"])  # temperature 1, no filter
        first, tokens = r["first"], []
        for c in range(first, T):
            u, g = (np.asarray(x, np.float64) for x in draws(r["params"].seed, r["steps"] + c - first))
            if c < T - 1:
                x = r["ids"][c + 1]
                if u < np.exp(logp[c, x]):
                    tokens.append(x)
                    continue
                tokens.append(int(np.argmax(np.where(np.arange(V) == x, -np.inf, logp[c]) + g)))
            else:
                tokens.append(int(np.argmax(logp[c] + g)))
            break
        assert outputs(out, i, first) == tokens, i
    assert len({int(x) for x in out.num_accepted}) > 1, "the case should mix rejections and acceptances"


# --- the distribution -------------------------------------------------------------------------------------------------

S = 4000  # rows of the statistical test
STAT_LOGITS = np.array([[2.0, 1.1, 0.3, 0.0, -0.5, -1.0, 0.8, -0.2],
                        [0.4, -0.3, 1.9, 1.7, 0.1, -0.8, 0.2, -1.5],
                        [0.0, 0.8, -0.4, 0.3, 1.1, -0.6, 0.5, -0.1]], np.float32)
STAT_IDS = np.array([6, 0, 3], np.int32)  # draft 1 = the argmax of column 0, draft 2 = the second of column 1
ALPHA, POWER_ALPHA = 1e-3, 1e-6


@pytest.mark.parametrize("temperature, top_k, seed_base", [(1.0, 0, 0), (0.7, 3, 10**6)], ids=["t1.0", "t0.7_topk3"])
def test_output_distribution_matches_the_exact_target(temperature, top_k, seed_base):
    """R = 4000 seeded rows of one row with two drafts: (a) the first output ~ p_0, (b) the second output given the
    first draft accepted ~ p_1, (c) the bonus given both accepted ~ p_2 (each output is distributed as the
    target's; Leviathan et al. Theorem 1), and the first draft is the first output exactly when it is accepted."""
    tensors = SamplingTensors.build([SamplingParams(temperature=temperature, top_k=top_k, seed=seed_base + i)
                                     for i in range(S)], V)
    out = _verify(np.broadcast_to(STAT_LOGITS, (S, 3, V)), np.broadcast_to(STAT_IDS, (S, 3)),
                  np.zeros(S, np.int32), tensors)
    assert out.logprobs is None and out.ranks is None and out.top_ids is None  # no row asked for logprobs
    tokens, accepted = np.asarray(out.token_ids), np.asarray(out.num_accepted)
    p = processed_probs(STAT_LOGITS, temperature, top_k)  # [3, V]
    d1, d2 = STAT_IDS[1], STAT_IDS[2]
    assert 0.3 < p[0, d1] < 0.75 and 0.25 < p[1, d2] < 0.7, "acceptance should be neither ~0 nor ~1"
    np.testing.assert_array_equal(accepted >= 1, tokens[:, 0] == d1)
    np.testing.assert_array_equal(accepted == 2, (tokens[:, 0] == d1) & (tokens[:, 1] == d2))
    samples = {"first": (tokens[:, 0], p[0]), "second | accepted": (tokens[accepted >= 1, 1], p[1]),
               "bonus | both accepted": (tokens[accepted == 2, 2], p[2])}
    for name, (x, probs) in samples.items():
        assert len(x) > 400, (name, len(x))
        pvalue, stat, df = chi_square_pvalue(np.bincount(x, minlength=V), probs)
        print(f"\n[{temperature=}, {top_k=}] {name} ({len(x)} samples): chi-square {stat:.1f}, df {df}, "
              f"p = {pvalue:.3f}", end="")
        assert pvalue > ALPHA, f"{name}: chi-square {stat:.1f} (df {df}), p = {pvalue:.2e}"

    # Power: references of plausible bugs are rejected by the same samples.
    def forgets_the_residual(q, x):  # recovering from p instead of p without x
        return q * (1 - q[x]) + q[x] * (np.arange(V) == x)

    wrong = {"first (recovery from p)": (tokens[:, 0], forgets_the_residual(p[0], d1)),
             "second (recovery from p)": (tokens[accepted >= 1, 1], forgets_the_residual(p[1], d2))}
    if temperature != 1.0:
        wrong["first (no temperature, no top-k)"] = (tokens[:, 0], processed_probs(STAT_LOGITS[0]))
        wrong["first (no top-k)"] = (tokens[:, 0], processed_probs(STAT_LOGITS[0], temperature))
    for name, (x, probs) in wrong.items():
        pvalue, stat, df = chi_square_pvalue(np.bincount(x, minlength=V), probs)
        print(f"\n[{temperature=}, {top_k=}] against {name}: p = {pvalue:.1e}", end="")
        assert pvalue < POWER_ALPHA, f"{name}: p = {pvalue:.2e}, the test cannot tell this wrong reference apart"
