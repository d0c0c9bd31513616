"""The batched sampler: each parameter has a test that fails if it were ignored, seeds are
reproducible across batch compositions and preemption, and sampling follows the distribution."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tokenloom.messages import LogprobsLists
from tokenloom.sample import Sampler
from tokenloom.sample import ops
from tokenloom.sampling_params import SamplingParams

V = 64


def sp(**kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 10_000)
    return SamplingParams(**kwargs)


def fixed_logits(vocab: int = V, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * scale


def sampler_with(params: list[SamplingParams], vocab: int = V, rows: list[int] | None = None, **kw) -> Sampler:
    rows = rows if rows is not None else list(range(len(params)))
    s = Sampler(max(rows) + 1, vocab, **kw)
    for row, p in zip(rows, params):
        s.add_request(row, p, [1, 2, 3], [])
    return s


def draw(s: Sampler, logits_row: torch.Tensor, rows: list[int], steps: int) -> np.ndarray:
    """`steps` sampling steps with the same logits row for every row: [steps, len(rows)]."""
    batch = logits_row.expand(len(rows), -1).contiguous()
    return np.stack([s.sample(batch, rows).sampled_token_ids.numpy() for _ in range(steps)])


def nucleus(logits: torch.Tensor, top_p: float) -> set[int]:
    """Reference top-p set, in float64: the most likely tokens while the mass before them < p."""
    probs = torch.softmax(logits.double(), -1)
    order = torch.argsort(probs, descending=True)
    before = torch.cumsum(probs[order], 0) - probs[order]
    return set(order[before < top_p].tolist())


# ---- one parameter at a time ------------------------------------------------------------------


def test_top_k_1_is_greedy():
    logits = torch.randn(16, V)
    s = sampler_with([sp(temperature=1.5, top_k=1)] * 16)
    for _ in range(5):
        assert torch.equal(s.sample(logits, list(range(16))).sampled_token_ids, logits.argmax(-1))


@pytest.mark.parametrize("k", [2, 5, 17])
def test_top_k_draws_stay_in_top_k(k):
    logits = fixed_logits(scale=1.0)
    s = sampler_with([sp(temperature=2.0, top_k=k)] * 64)
    got = set(draw(s, logits, list(range(64)), 20).ravel().tolist())
    assert got == set(torch.topk(logits, k).indices.tolist())  # inside, and every one reached


@pytest.mark.parametrize(
    ("top_k", "seeded"),
    [(0, False), (40, False), (0, True)],
    ids=["top_p-alone", "with-top_k", "seeded"],
)
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9])
def test_top_p_draws_stay_in_nucleus(top_p, top_k, seeded):
    logits = fixed_logits(scale=1.0)
    rows = list(range(64))
    s = sampler_with([sp(top_p=top_p, top_k=top_k, seed=r if seeded else None) for r in rows])
    got = set(draw(s, logits, rows, 20).ravel().tolist())
    want = nucleus(logits, top_p)
    assert got <= want and len(got) >= min(len(want), 3)


def test_min_p_draws_stay_above_threshold():
    logits = fixed_logits(scale=0.5)
    temperature, min_p = 0.8, 0.3  # 6 of 64 tokens pass
    probs = torch.softmax(logits / temperature, -1)
    allowed = set(torch.nonzero(probs >= min_p * probs.max()).flatten().tolist())
    s = sampler_with([sp(temperature=temperature, min_p=min_p)] * 64)
    got = set(draw(s, logits, list(range(64)), 20).ravel().tolist())
    assert got == allowed and len(allowed) > 1


def test_temperature_zero_is_greedy_in_a_mixed_batch():
    logits = torch.randn(8, V)
    params = [sp(temperature=0.0) if r % 2 == 0 else sp(temperature=1.5) for r in range(8)]
    s = sampler_with(params)
    random_tokens = []
    for _ in range(10):
        out = s.sample(logits, list(range(8))).sampled_token_ids
        assert torch.equal(out[0::2], logits[0::2].argmax(-1))
        random_tokens.append(out[1::2])
    assert not torch.equal(torch.stack(random_tokens), logits[1::2].argmax(-1).expand(10, -1))


def test_greedy_rows_consume_no_randomness():
    logits = torch.randn(8, V)
    alone = sampler_with([sp(temperature=1.0)] * 4)
    mixed = sampler_with([sp(temperature=1.0), sp(temperature=0.0)] * 4)
    for _ in range(5):
        a = alone.sample(logits[0::2], [0, 1, 2, 3]).sampled_token_ids
        b = mixed.sample(logits, list(range(8))).sampled_token_ids
        assert torch.equal(a, b[0::2])


def test_penalties_match_reference():
    transformers = pytest.importorskip("transformers")
    vocab = 50
    prompt = [1, 2, 3, 3, 7]
    configs = [
        dict(repetition_penalty=1.5),
        dict(repetition_penalty=0.7),
        dict(frequency_penalty=0.8),
        dict(presence_penalty=-1.2),
        dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.5),
        dict(),
    ]
    s = Sampler(len(configs), vocab)
    for row, kw in enumerate(configs):
        s.add_request(row, sp(temperature=1.0, **kw), prompt, [])
    rows = list(range(len(configs)))
    history: list[list[int]] = [[] for _ in rows]
    g = torch.Generator().manual_seed(1)
    for _ in range(12):  # peaked logits, so tokens repeat and the counts go above 1
        step_logits = torch.randn(len(rows), vocab, generator=g) * 3
        for r, t in enumerate(s.sample(step_logits, rows).sampled_token_ids.tolist()):
            history[r].append(t)
    assert any(len(set(h)) < len(h) for h in history)

    logits = torch.randn(len(rows), vocab, generator=g) * 3
    got = s.process_logits(logits, rows)
    for r, kw in enumerate(configs):
        want = logits[r : r + 1].clone()
        processor = transformers.RepetitionPenaltyLogitsProcessor(penalty=kw.get("repetition_penalty", 1.0))
        want = processor(torch.tensor([prompt + history[r]]), want)[0]
        counts = torch.bincount(torch.tensor(history[r]), minlength=vocab).float()
        want = want - kw.get("frequency_penalty", 0.0) * counts - kw.get("presence_penalty", 0.0) * (counts > 0)
        torch.testing.assert_close(got[r], want, msg=f"row {r}: {kw}")

    # A resumed request (preempted, re-added with its history) sees the same penalties.
    resumed = Sampler(len(configs) + 3, vocab)
    for row, kw in enumerate(configs):
        resumed.add_request(row + 3, sp(temperature=1.0, **kw), prompt, history[row])
    torch.testing.assert_close(resumed.process_logits(logits, [r + 3 for r in rows]), got)


def test_logit_bias_forces_tokens():
    logits = torch.randn(4, V)
    top = logits.argmax(-1)
    s = sampler_with(
        [
            sp(temperature=1.0, logit_bias={7: 100}),
            sp(temperature=0.0, logit_bias={11: 100}),
            sp(temperature=0.0, logit_bias={int(top[2]): -100}),
            sp(temperature=1.0, seed=4, logit_bias={"13": 100}),
        ]
    )
    for _ in range(10):
        out = s.sample(logits, [0, 1, 2, 3]).sampled_token_ids.tolist()
        assert out[0] == 7 and out[1] == 11 and out[2] != int(top[2]) and out[3] == 13


def test_allowed_token_ids_restrict_draws():
    logits = fixed_logits(scale=0.5)
    allowed = [3, 9, 20, 41]
    s = sampler_with([sp(temperature=1.0, allowed_token_ids=allowed)] * 32 + [sp(temperature=0.0, allowed_token_ids=allowed)])
    got = draw(s, logits, list(range(33)), 20)
    assert set(got[:, :32].ravel().tolist()) == set(allowed)
    assert set(got[:, 32].tolist()) == {max(allowed, key=lambda t: logits[t].item())}


def test_bad_words_single_and_multi_token():
    a, b, c = 5, 6, 7
    params = sp(temperature=0.0, bad_words=["x", "y z"], _bad_words_token_ids=[[c], [a, b]])
    s = sampler_with([params])

    def favour(*tokens: int) -> torch.Tensor:
        logits = torch.zeros(1, V)
        for rank, t in enumerate(tokens):
            logits[0, t] = 10.0 - rank
        return logits

    assert s.sample(favour(c, 9), [0]).sampled_token_ids.item() == 9  # single-token word: never
    assert s.sample(favour(b, 9), [0]).sampled_token_ids.item() == b  # b alone is fine
    assert s.sample(favour(a, 9), [0]).sampled_token_ids.item() == a
    assert s.sample(favour(b, c, 9), [0]).sampled_token_ids.item() == 9  # "a b" would complete
    assert s.sample(favour(b, 9), [0]).sampled_token_ids.item() == b  # output no longer ends in a

    # Resumed after preemption with a history that ends in `a`: b is still forbidden.
    s.add_request(0, params, [1], [3, a])
    assert s.sample(favour(b, 9), [0]).sampled_token_ids.item() == 9

    # Random rows never produce `c`, nor `b` right after `a`.
    s = sampler_with([sp(temperature=1.0, bad_words=["x"], _bad_words_token_ids=[[c], [a, b]])] * 16)
    flat = torch.zeros(V)
    flat[[a, b, c]] = 3.0
    tokens = draw(s, flat, list(range(16)), 40)
    assert c not in tokens
    assert not np.any((tokens[:-1] == a) & (tokens[1:] == b))
    assert np.any(tokens == b) and np.any(tokens == a)


def test_min_tokens_suppresses_stop_tokens_until_reached():
    eos, stop = 5, 9
    logits = torch.zeros(1, V)
    logits[0, eos], logits[0, stop], logits[0, 20] = 10.0, 9.0, 1.0
    params = sp(temperature=0.0, min_tokens=3, stop_token_ids=[stop], _all_stop_token_ids=[eos])
    s = sampler_with([params])
    assert [s.sample(logits, [0]).sampled_token_ids.item() for _ in range(4)] == [20, 20, 20, eos]
    # Resumed with 3 tokens already generated: nothing left to suppress.
    s.add_request(0, params, [1], [20, 20, 20])
    assert s.sample(logits, [0]).sampled_token_ids.item() == eos
    # Resumed with 2: one more suppressed step.
    s.add_request(0, params, [1], [20, 20])
    assert [s.sample(logits, [0]).sampled_token_ids.item() for _ in range(2)] == [20, eos]


def test_contradictory_constraints_do_not_crash():
    """Every token forbidden (allowed only EOS, EOS suppressed by min_tokens): some token comes
    out rather than an exception in the engine core."""
    kinds = [dict(temperature=0.0), dict(temperature=0.3), dict(temperature=1.0, top_p=0.5), dict(top_k=3)]
    s = sampler_with([sp(allowed_token_ids=[5], min_tokens=2, _all_stop_token_ids=[5], **kw) for kw in kinds])
    out = s.sample(torch.randn(4, V), [0, 1, 2, 3]).sampled_token_ids
    assert out.shape == (4,) and bool(((out >= 0) & (out < V)).all())


# ---- seeds ------------------------------------------------------------------------------------


def _seeded_run(sampler: Sampler, row: int, others: list[int], steps: int, logits_seq: torch.Tensor) -> list[int]:
    """`steps` steps for `row` among `others` (random logits for them); returns row's tokens."""
    rows = sorted([row] + others)
    g = torch.Generator().manual_seed(99)
    tokens = []
    for t in range(steps):
        batch = torch.randn(len(rows), logits_seq.shape[1], generator=g)
        batch[rows.index(row)] = logits_seq[t]
        tokens.append(int(sampler.sample(batch, rows).sampled_token_ids[rows.index(row)]))
    return tokens


@pytest.mark.parametrize("vocab", [V, 1000])  # one block, several blocks (ops.draw)
def test_same_seed_same_tokens_alone_in_a_crowd_and_after_preemption(vocab):
    steps = 12
    logits_seq = torch.randn(steps, vocab) * 0.5  # flat: many plausible tokens per step
    params = sp(temperature=1.0, top_p=0.95, seed=1234)

    alone = Sampler(4, vocab)
    alone.add_request(0, params, [1, 2], [])
    reference = _seeded_run(alone, 0, [], steps, logits_seq)
    assert len(set(reference)) > 3

    # Row 17 of 33, among greedy, unseeded and other-seeded requests with other features.
    crowd = Sampler(40, vocab)
    others = [r for r in range(33) if r != 17]
    kinds = [
        sp(temperature=0.0),
        sp(temperature=0.9),
        sp(temperature=1.1, seed=7, top_k=5),
        sp(temperature=0.5, top_p=0.5, presence_penalty=1.0),
    ]
    for i, r in enumerate(others):
        crowd.add_request(r, kinds[i % len(kinds)], [4, 5], [])
    crowd.add_request(17, params, [1, 2], [])
    assert _seeded_run(crowd, 17, others, steps, logits_seq) == reference

    # Preempted after 5 tokens, re-added at another row with its history: it resumes the stream.
    pre = Sampler(8, vocab)
    for r in (0, 1):
        pre.add_request(r, sp(temperature=1.0), [3], [])
    pre.add_request(2, params, [1, 2], [])
    first = _seeded_run(pre, 2, [0, 1], 5, logits_seq[:5])
    pre.remove_request(2)
    pre.add_request(6, params, [1, 2], first)
    rest = _seeded_run(pre, 6, [0, 1], steps - 5, logits_seq[5:])
    assert first + rest == reference


def test_different_seeds_different_tokens():
    logits_seq = torch.randn(10, V) * 0.5
    runs = []
    for seed in range(6):
        s = Sampler(1, V)
        s.add_request(0, sp(temperature=1.0, seed=seed), [1], [])
        runs.append(tuple(_seeded_run(s, 0, [], 10, logits_seq)))
    assert len(set(runs)) == len(runs)


def test_unseeded_rows_follow_the_engine_seed():
    logits = torch.randn(8, V)
    a, b, c = (sampler_with([sp(temperature=1.0)] * 8, seed=s) for s in (1, 1, 2))
    ta, tb, tc = (torch.stack([x.sample(logits, list(range(8))).sampled_token_ids for _ in range(5)]) for x in (a, b, c))
    assert torch.equal(ta, tb) and not torch.equal(ta, tc)


# ---- the distribution -------------------------------------------------------------------------


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile; z = 3.719 is alpha = 1e-4."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _reference_distribution(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float):
    """The target distribution in float64, written from the definitions (vLLM's order)."""
    x = logits.double() / temperature
    probs = torch.softmax(x, -1)
    keep = probs >= min_p * probs.max()
    if top_k:
        keep &= torch.zeros_like(keep).scatter_(0, torch.topk(x, top_k).indices, True)
    p = torch.where(keep, probs, 0.0)
    p = p / p.sum()
    if top_p < 1.0:
        order = torch.argsort(p, descending=True)
        before = torch.cumsum(p[order], 0) - p[order]
        drop = order[before >= top_p]
        p[drop] = 0.0
        p = p / p.sum()
    return p


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "min_p", "top_p_draws"),
    [
        (0.7, 0, 1.0, 0.0, None),
        (1.6, 0, 1.0, 0.0, None),
        (1.0, 6, 1.0, 0.0, None),
        (1.0, 0, 0.8, 0.0, None),  # top-p by rejection
        (2.0, 0, 0.5, 0.0, 0),  # top-p by the sorted fallback alone
        (1.2, 7, 0.7, 0.0, None),  # top-p inside the top-k window
        (0.9, 0, 1.0, 0.1, None),
        (1.5, 0, 0.9, 0.1, None),
        (1.0, 6, 0.8, 0.15, None),  # min_p, top-k and top-p together
    ],
)
@pytest.mark.parametrize("seeded", [False, True])
def test_chi_square_goodness_of_fit(temperature, top_k, top_p, min_p, top_p_draws, seeded, monkeypatch):
    if top_p_draws is not None:
        monkeypatch.setattr("tokenloom.sample.sampler.TOP_P_DRAWS", top_p_draws)
    vocab, num_rows, steps = 12, 2000, 8  # 16000 draws
    logits = torch.tensor([2.0, 1.5, 1.2, 1.0, 0.7, 0.5, 0.2, 0.0, -0.3, -0.8, -1.5, -3.0])
    params = [
        sp(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=(r if seeded else None))
        for r in range(num_rows)
    ]
    s = sampler_with(params, vocab=vocab, seed=5)
    tokens = draw(s, logits, list(range(num_rows)), steps).ravel()
    observed = np.bincount(tokens, minlength=vocab).astype(np.float64)
    expected = _reference_distribution(logits, temperature, top_k, top_p, min_p).numpy() * tokens.size
    support = expected > 0
    assert observed[~support].sum() == 0, "a token outside the support was sampled"
    chi2 = float((((observed - expected) ** 2)[support] / expected[support]).sum())
    df = int(support.sum()) - 1
    assert df >= 1
    assert chi2 < _chi2_critical(df), (chi2, df, observed, expected)


# ---- logprobs ---------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_with_top_k_and_rank():
    # Seeded: with unseeded logits token 3 was the raw argmax once in V runs (rank 1, below).
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0)) * 2
    s = sampler_with(
        [
            sp(temperature=0.5, logprobs=5, repetition_penalty=1.5, presence_penalty=1.0),
            sp(temperature=1.0),
            sp(temperature=0.0, logprobs=0, logit_bias={3: 50.0}),
            sp(temperature=1.3, top_k=3, logprobs=20),
        ]
    )
    out = s.sample(logits, [0, 1, 2, 3])
    assert out.logprobs is not None and len(out.logprobs) == 4 and out.logprobs[1] is None
    want = torch.log_softmax(logits, -1)
    for i, k in ((0, 5), (2, 0), (3, 20)):
        lp = out.logprobs[i]
        assert isinstance(lp, LogprobsLists) and len(lp.token_ids) == 1 and len(lp.ranks) == 1
        ids, values = lp.token_ids[0], lp.logprobs[0]
        tok = int(out.sampled_token_ids[i])
        assert len(ids) == 1 + k and ids[0] == tok
        torch.testing.assert_close(torch.tensor(values), want[i, ids])
        assert ids[1:] == torch.topk(want[i], k).indices.tolist()
        assert values[1:] == sorted(values[1:], reverse=True)
        assert lp.ranks[0] == int((want[i] > want[i, tok]).sum()) + 1
    assert out.logprobs[2].token_ids[0] == [3] and out.logprobs[2].ranks[0] > 1  # biased, raw rank
    assert sampler_with([sp()]).sample(torch.randn(1, V), [0]).logprobs is None


def test_prompt_logprobs():
    s = Sampler(2, V)
    logits = torch.randn(7, V)
    targets = torch.randint(0, V, (7,))
    lp = s.compute_prompt_logprobs(logits, targets, 3)
    want = torch.log_softmax(logits, -1)
    assert len(lp.token_ids) == len(lp.logprobs) == len(lp.ranks) == 7
    for i in range(7):
        assert len(lp.token_ids[i]) == 4 and lp.token_ids[i][0] == int(targets[i])
        assert lp.token_ids[i][1:] == torch.topk(want[i], 3).indices.tolist()
        torch.testing.assert_close(torch.tensor(lp.logprobs[i]), want[i, lp.token_ids[i]])
        assert lp.ranks[i] == int((want[i] > want[i, targets[i]]).sum()) + 1
    assert [len(x) for x in s.compute_prompt_logprobs(logits, targets, 0).token_ids] == [1] * 7


# ---- the contract with the model runner -------------------------------------------------------


def test_sample_leaves_logits_alone_and_checks_rows():
    logits = torch.randn(3, V)
    before = logits.clone()
    s = sampler_with([sp(repetition_penalty=1.2, logit_bias={1: 5}), sp(temperature=0.0), sp(top_p=0.5)])
    s.sample(logits, torch.tensor([0, 1, 2]))
    assert torch.equal(logits, before)
    s.remove_request(1)
    with pytest.raises(ValueError, match="no request"):
        s.sample(logits, [0, 1, 2])
    with pytest.raises(ValueError, match="shape"):
        s.sample(logits, [0, 2])
    assert s.sample(torch.empty(0, V), []).sampled_token_ids.shape == (0,)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        s.add_request(1, sp(allowed_token_ids=[V]), [1], [])


def test_output_counts_are_kept_per_row():
    """The history is kept for the rows that use a penalty (the others pay nothing)."""
    pen = dict(temperature=0.0, presence_penalty=0.1)
    s = sampler_with([sp(**pen), sp(temperature=0.0), sp(**pen)], rows=[3, 4, 5])
    logits = torch.zeros(3, V)
    logits[0, 4] = logits[1, 6] = logits[2, 8] = 1.0
    for _ in range(3):
        s.sample(logits, [3, 4, 5])
    assert s.output_token_counts[3, 4] == 3 and s.output_token_counts[5, 8] == 3
    assert int(s.output_token_counts[[3, 5]].sum()) == 6
    s.add_request(3, sp(frequency_penalty=0.5), [1], [9, 9])  # re-adding resets the row's history
    assert s.output_token_counts[3].tolist() == [0] * 9 + [2] + [0] * (V - 10)


def test_inverse_cdf_never_returns_zero_weight():
    weights = torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.0, 0.0]] * 5)
    cdf = ops.cumulative(weights)
    u = torch.tensor([0.0, 1 / 3 - 1e-12, 1 / 3, 0.999999999, 1.0 - 2**-53], dtype=torch.float64)
    assert ops.inverse_cdf(cdf, u).tolist() == [1, 1, 4, 4, 4]


def test_two_level_draw_matches_a_whole_row_inverse_cdf():
    g = torch.Generator().manual_seed(3)
    vocab = 600  # blocks of 256, 256 and a short one of 88
    weights = torch.rand(64, vocab, generator=g) ** 4
    weights[:, 256:512] = 0.0  # a whole empty block
    weights[:, ::7] = 0.0
    weights[:, -1] = 5.0  # the very last token, in the short block
    u = torch.rand(64, 50, generator=g, dtype=torch.float64)
    blocks = ops.block_cdf(weights)
    full = ops.cumulative(weights)
    for j in range(u.shape[1]):
        got = ops.draw(weights, blocks, u[:, j])
        assert torch.equal(got, ops.inverse_cdf(full, u[:, j]))
        assert bool((weights.gather(1, got.unsqueeze(1)) > 0).all())
