"""Sampler: greedy equivalences, seeded determinism in any batch, distributions (chi-square), logits
processors against transformers' processors, logprobs, no waiting on the device midway (one copy in, one out),
and SamplingParams validation."""
from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from torch.utils._python_dispatch import TorchDispatchMode

from tokenmill.executor.sampler import (
    PendingSample,
    Sampler,
    SamplingInput,
    apply_logits_processors,
    apply_top_k_top_p_min_p,
    check_params_for_vocab,
    compute_prompt_logprobs,
    make_generator,
)
from tokenmill.sampling_params import SamplingParams

V = 12
EOS = 3


def inp(params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None,
        bad: list[list[int]] | None = None) -> SamplingInput:
    return SamplingInput(params, [0, 1] if prompt is None else list(prompt), list(output or []),
                         make_generator(params.seed), bad or [])


def rand_logits(rows: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2


# ----------------------------------------------------------------------------------------- sampling

def test_greedy_equals_temperature_zero_equals_top_k_one():
    logits = rand_logits(16, 100)
    sampler = Sampler(100, {EOS})
    expected = logits.argmax(-1).tolist()
    for p in (SamplingParams(temperature=0), SamplingParams(temperature=0.8, top_k=1),
              SamplingParams(temperature=0, top_p=0.5, seed=3)):
        assert sampler(logits, [inp(p) for _ in range(16)]).token_ids == expected
    # greedy rows mixed with random rows keep their argmax
    mixed = [inp(SamplingParams(temperature=0)) if r % 2 else inp(SamplingParams(temperature=1.5)) for r in range(16)]
    out = sampler(logits, mixed).token_ids
    assert out[1::2] == expected[1::2]


def _run_steps(logits: torch.Tensor, inputs: list[SamplingInput], row: int, steps: int) -> list[int]:
    sampler = Sampler(logits.shape[1], {EOS})
    got = []
    for _ in range(steps):
        out = sampler(logits, inputs).token_ids
        got.append(out[row])
        for i, t in zip(inputs, out):
            i.output_token_ids.append(t)
    return got


def test_seeded_row_independent_of_batch():
    vocab, steps = 50, 20
    target = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    alone = _run_steps(rand_logits(1, vocab), [inp(target)], 0, steps)

    torch.manual_seed(99)  # the unseeded rows draw from the global generator
    others = [SamplingParams(temperature=0.7, seed=s) for s in range(5)] + \
             [SamplingParams(temperature=1.3, top_k=5) for _ in range(5)] + [SamplingParams(temperature=0)]
    batch = [inp(p) for p in others[:6]] + [inp(target)] + [inp(p) for p in others[6:]]
    logits = torch.cat([rand_logits(6, vocab, seed=7), rand_logits(1, vocab), rand_logits(5, vocab, seed=8)])
    assert _run_steps(logits, batch, 6, steps) == alone
    # and a different seed gives a different sequence
    other = _run_steps(rand_logits(1, vocab), [inp(SamplingParams(temperature=1.0, top_p=0.9, seed=4321))], 0, steps)
    assert other != alone


@pytest.mark.parametrize("others", [
    [],
    [SamplingParams(temperature=1.0, top_k=3), SamplingParams(temperature=0.5, top_k=40, seed=1)],  # top-k fast path
    [SamplingParams(temperature=1.0), SamplingParams(top_p=0.5)],  # full sort path
])
def test_seeded_top_k_row_independent_of_filter_path(others):
    vocab, steps = 64, 15
    target = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, min_p=0.01, seed=77)
    alone = _run_steps(rand_logits(1, vocab, seed=5), [inp(target)], 0, steps)
    batch = [inp(target)] + [inp(p) for p in others]
    logits = torch.cat([rand_logits(1, vocab, seed=5), rand_logits(len(others), vocab, seed=6)])
    assert _run_steps(logits, batch, 0, steps) == alone


def _expected_probs(logits: torch.Tensor, t: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Independent reference in float64, one token at a time: softmax(logits / T) restricted by
    top-k (ties kept), then top-p (smallest most-likely set reaching p), then min-p."""
    x = logits.double() / t
    keep = torch.ones(len(x), dtype=torch.bool)
    if top_k:
        keep &= x >= x.sort(descending=True).values[top_k - 1]
    p = torch.where(keep, x, -math.inf).softmax(-1)
    if top_p < 1:
        mass = 0.0
        for i in p.argsort(descending=True).tolist():
            if mass >= top_p:
                keep[i] = False
            mass += float(p[i])
    p = torch.where(keep, x, -math.inf).softmax(-1)
    if min_p:
        keep &= p >= min_p * p.max()
    return torch.where(keep, x, -math.inf).softmax(-1)


def _chisquare_pvalue(counts: torch.Tensor, expected_p: torch.Tensor) -> float:
    n = counts.sum()
    support = expected_p > 0
    exp = expected_p[support] * n
    stat = float(((counts[support] - exp) ** 2 / exp).sum())
    df = int(support.sum()) - 1
    if df == 0:
        return 1.0
    # chi-square survival function = regularized upper incomplete gamma Q(df/2, stat/2)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("t,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 1.0, 0.0),
    (1.3, 5, 1.0, 0.0),
    (1.0, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.1),
    (0.9, 8, 0.9, 0.05),
])
def test_distribution_matches_filtered_softmax(t, top_k, top_p, min_p):
    n = 40_000
    logits = torch.tensor([[1.0, 0.5, 2.0, -1.0, 0.0, 1.5, -0.5, 0.3, 2.2, -2.0, 0.8, 1.1]])
    params = SamplingParams(temperature=t, top_k=top_k, top_p=top_p, min_p=min_p)
    torch.manual_seed(0)
    out = Sampler(V, {EOS})(logits.expand(n, V), [inp(params) for _ in range(n)]).token_ids
    counts = torch.bincount(torch.tensor(out), minlength=V).double()
    expected = _expected_probs(logits[0], t, top_k, top_p, min_p)
    assert counts[expected == 0].sum() == 0, "sampled a filtered-out token"
    assert _chisquare_pvalue(counts, expected) > 1e-3


def test_seeded_rows_distribution():
    # per-row generators (one seed per row) sample the same distribution as the global one
    n = 4000
    logits = torch.tensor([[1.0, 0.5, 2.0, -1.0, 0.0, 1.5, -0.5, 0.3, 2.2, -2.0, 0.8, 1.1]])
    inputs = [inp(SamplingParams(temperature=1.0, top_p=0.9, seed=s)) for s in range(n)]
    out = Sampler(V, {EOS})(logits.expand(n, V), inputs).token_ids
    counts = torch.bincount(torch.tensor(out), minlength=V).double()
    assert _chisquare_pvalue(counts, _expected_probs(logits[0], 1.0, 0, 0.9, 0.0)) > 1e-3


def test_filters_match_transformers_warpers():
    logits = rand_logits(4, 64, seed=3)
    for k, p, m in [(10, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.2), (20, 0.8, 0.1)]:
        ours = apply_top_k_top_p_min_p(logits, torch.full((4,), k or 64), torch.full((4,), p), torch.full((4,), m))
        ref = logits.clone()
        for w in ([TopKLogitsWarper(k)] if k else []) + ([TopPLogitsWarper(p)] if p < 1 else []) + \
                 ([MinPLogitsWarper(m)] if m else []):
            ref = w(None, ref)
        assert torch.equal(torch.isinf(ours), torch.isinf(ref)), (k, p, m)
        torch.testing.assert_close(ours[~torch.isinf(ours)], logits[~torch.isinf(ours)])


# ----------------------------------------------------------------------------------------- processors

def test_repetition_penalty_matches_transformers():
    logits = rand_logits(3, 40, seed=1)
    rows = [([1, 5, 7], [5, 9]), ([2, 2, 3], [30, 31, 2]), ([0], [])]
    pens = [1.3, 0.7, 2.0]
    inputs = [inp(SamplingParams(repetition_penalty=pen), pr, out) for pen, (pr, out) in zip(pens, rows)]
    ours = apply_logits_processors(logits, inputs)
    for r, (pen, (pr, out)) in enumerate(zip(pens, rows)):
        ref = RepetitionPenaltyLogitsProcessor(pen)(torch.tensor([pr + out]), logits[r:r + 1].clone())
        torch.testing.assert_close(ours[r:r + 1], ref)


def test_penalty_rows_without_history_are_untouched():
    logits = rand_logits(3, 20, seed=11)
    rows = [inp(SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=1.0), [], []),
            inp(SamplingParams(repetition_penalty=1.5, presence_penalty=0.5), [0, 3], [3, 3, 0]),
            inp(SamplingParams(), [0], [0])]
    ours = apply_logits_processors(logits, rows)
    torch.testing.assert_close(ours[0], logits[0])
    torch.testing.assert_close(ours[2], logits[2])
    assert torch.equal(ours[1] != logits[1], torch.isin(torch.arange(20), torch.tensor([0, 3])))
    # top_k larger than the vocabulary is no filter at all
    out = apply_top_k_top_p_min_p(logits, torch.tensor([50, 50, 50]), None, None)
    torch.testing.assert_close(out, logits)


def test_frequency_presence_penalties_formula():
    logits = rand_logits(2, 20, seed=2)
    outs = [[1, 1, 1, 4, 7, 7], [3]]
    params = [SamplingParams(frequency_penalty=0.5, presence_penalty=-0.3), SamplingParams(presence_penalty=1.2)]
    # prompt tokens must not count for OpenAI penalties
    ours = apply_logits_processors(logits, [inp(p, [2, 5, 6], o) for p, o in zip(params, outs)])
    for r, (p, o) in enumerate(zip(params, outs)):
        counts = torch.bincount(torch.tensor(o), minlength=20).float()
        ref = logits[r] - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        torch.testing.assert_close(ours[r], ref)


def test_logit_bias_matches_sequence_bias():
    logits = rand_logits(2, 20, seed=4)
    biases = [{3: 5.0, 7: -2.5}, {0: 100.0}]
    ours = apply_logits_processors(logits, [inp(SamplingParams(logit_bias=b)) for b in biases])
    for r, b in enumerate(biases):
        proc = SequenceBiasLogitsProcessor([[[t], v] for t, v in b.items()])
        ref = proc(torch.tensor([[1, 2]]), logits[r:r + 1].clone())
        torch.testing.assert_close(ours[r:r + 1], ref)


def test_bad_words_match_transformers():
    logits = rand_logits(3, 20, seed=5)
    bad = [[4], [7, 8], [1, 2, 9]]
    outs = [[5, 7], [1, 2], [3, 3]]  # row 0: [7,8] prefix matches; row 1: [1,2,9]; row 2: only [4]
    ours = apply_logits_processors(logits, [inp(SamplingParams(), [], o, bad) for o in outs])
    proc = NoBadWordsLogitsProcessor(bad, eos_token_id=EOS)
    for r, o in enumerate(outs):
        ref = proc(torch.tensor([o]), logits[r:r + 1].clone())
        torch.testing.assert_close(ours[r:r + 1], ref)
    assert torch.isinf(ours[0, 8]) and torch.isinf(ours[1, 9]) and not torch.isinf(ours[2, 8])


def test_allowed_token_ids_and_min_tokens():
    logits = rand_logits(3, 20, seed=6)
    p_allowed = SamplingParams(allowed_token_ids=[2, 5, 11])
    p_min = SamplingParams(min_tokens=3, stop_token_ids=[9])
    ours = apply_logits_processors(logits, [inp(p_allowed), inp(p_min, output=[1, 2]), inp(p_min, output=[1, 2, 4])],
                                   eos_token_ids=[EOS])
    assert torch.isfinite(ours[0]).tolist() == [t in (2, 5, 11) for t in range(20)]
    assert torch.isinf(ours[1, EOS]) and torch.isinf(ours[1, 9]) and torch.isfinite(ours[1]).sum() == 18
    torch.testing.assert_close(ours[2], logits[2])  # min_tokens reached: nothing masked


def test_all_processors_compose_in_order():
    # one batch with every processor on different rows equals each row processed alone, and the order
    # (bias before repetition penalty) is visible: a biased token that was seen is biased then penalised
    logits = rand_logits(4, 30, seed=8)
    ps = [SamplingParams(logit_bias={4: 3.0}, repetition_penalty=1.5, frequency_penalty=0.4),
          SamplingParams(allowed_token_ids=[1, 4, 6], presence_penalty=0.5, min_tokens=5),
          SamplingParams(temperature=0),
          SamplingParams(repetition_penalty=0.8, logit_bias={7: -1.0})]
    rows = [inp(p, [4, 6], [4, 4, 6], [[6, 2]]) for p in ps]
    batched = apply_logits_processors(logits, rows, [EOS])
    for r in range(4):
        torch.testing.assert_close(batched[r:r + 1], apply_logits_processors(logits[r:r + 1], [rows[r]], [EOS]))
    x = logits[0, 4] + 3.0
    ref = (x / 1.5 if x > 0 else x * 1.5) - 0.4 * 2
    torch.testing.assert_close(batched[0, 4], ref)
    assert torch.isinf(batched[:, 2]).all()  # bad word [6, 2]: the output ends in 6
    assert torch.isfinite(batched[1]).sum() == 3 and torch.isinf(batched[1, EOS])


# ----------------------------------------------------------------------------------------- logprobs

def test_logprobs_are_raw_log_softmax():
    logits = rand_logits(3, 30, seed=9)
    ps = [SamplingParams(logprobs=5, temperature=0.5, repetition_penalty=1.3, top_k=3),
          SamplingParams(),  # no logprobs
          SamplingParams(logprobs=0, temperature=0)]
    out = Sampler(30, {EOS})(logits, [inp(p, [1, 2], [3]) for p in ps])
    assert out.logprobs[1] is None
    ref = torch.log_softmax(logits, -1)
    for r in (0, 2):
        d = out.logprobs[r]
        tok = out.token_ids[r]
        assert tok in d and next(iter(d)) == tok
        order = ref[r].argsort(descending=True).tolist()
        for t, lp in d.items():
            assert lp.logprob == pytest.approx(float(ref[r, t]), abs=1e-5)
            assert lp.rank == order.index(t) + 1
    assert set(out.logprobs[0]) >= set(ref[0].topk(5).indices.tolist()) and len(out.logprobs[0]) <= 6
    assert len(out.logprobs[2]) == 1


def test_prompt_logprobs():
    logits = rand_logits(4, 30, seed=10)
    nxt = [5, 0, 29, 7]
    got = compute_prompt_logprobs(logits, nxt, 2)
    ref = torch.log_softmax(logits, -1)
    for i, d in enumerate(got):
        assert nxt[i] in d and set(d) >= set(ref[i].topk(2).indices.tolist())
        for t, lp in d.items():
            assert lp.logprob == pytest.approx(float(ref[i, t]), abs=1e-5)
            assert lp.rank == int((ref[i] > ref[i, t]).sum()) + 1
    assert compute_prompt_logprobs(logits[:0], [], 3) == []


# ----------------------------------------------------------------------------------------- no waiting midway

# ops whose output shape or host value depends on a device tensor's data: on a GPU each one waits for the device
_DATA_DEPENDENT = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.unique",
                   "aten._unique", "aten._unique2", "aten.unique_consecutive", "aten.unique_dim"}


class _DataDependentOps(TorchDispatchMode):
    """Records every aten op that reads a tensor's data back to the host or sizes its output by it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func.overloadpacket) in _DATA_DEPENDENT:
            self.seen.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def host_reads(monkeypatch):
    """Counts Tensor.tolist / .cpu / .item / .numpy calls (patched on torch.Tensor)."""
    counts = {"tolist": 0, "cpu": 0, "item": 0, "numpy": 0}
    for name in counts:
        orig = getattr(torch.Tensor, name)

        def counting(self, *a, _orig=orig, _name=name, **kw):
            counts[_name] += 1
            return _orig(self, *a, **kw)
        monkeypatch.setattr(torch.Tensor, name, counting)
    return counts


def _mixed_batch(vocab: int) -> list[SamplingInput]:
    """Every stage on some row: greedy, temperature + top-k + top-p + min-p, penalties, logit_bias, allowed ids,
    bad_words, min_tokens, seeded rows, logprobs, a grammar bitmask, a draft model's guess."""
    words = -(-vocab // 32)
    mask = torch.zeros(words, dtype=torch.int32)
    mask[0] = 0b1011_0110                                   # tokens 1, 2, 4, 5, 7
    q = torch.softmax(rand_logits(1, vocab, seed=42)[0], -1)
    ps = [SamplingParams(temperature=0),
          SamplingParams(temperature=0.8, top_k=7, top_p=0.9, min_p=0.02, seed=11, logprobs=3),
          SamplingParams(temperature=1.1, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4),
          SamplingParams(temperature=0, logit_bias={5: 4.0, 9: -3.0}, logprobs=3),
          SamplingParams(temperature=0.7, seed=5, allowed_token_ids=[2, 3, 8, 13]),
          SamplingParams(temperature=0.9, min_tokens=4, stop_token_ids=[6], seed=6),
          SamplingParams(temperature=1.0, seed=7),                       # the bitmask row
          SamplingParams(temperature=1.0, top_k=3, seed=8),              # verifies a draft guess
          SamplingParams(temperature=0, logprobs=0)]
    rows = [inp(p, [0, 1, 2], [4, 4, 9], [[9, 10], [11]]) for p in ps]
    rows[6].token_bitmask = mask
    rows[7].draft_token, rows[7].draft_probs = 3, q
    return rows


def test_a_step_reads_nothing_back_until_its_one_result_copy(host_reads):
    vocab = 40
    logits = rand_logits(9, vocab, seed=12)
    sampler = Sampler(vocab, {EOS})
    inputs = _mixed_batch(vocab)
    torch.manual_seed(0)
    with _DataDependentOps() as ops:
        pending = sampler.sample(logits, inputs)
        assert isinstance(pending, PendingSample)
        assert ops.seen == [] and sum(host_reads.values()) == 0, (ops.seen, host_reads)
        out = pending.result()
        assert pending.result() is out                          # built once
    assert ops.seen == [], ops.seen
    assert host_reads == {"tolist": 1, "cpu": 0, "item": 0, "numpy": 0}     # the one final read
    # the device tensor of the tokens, for the next step, holds what result() read
    ids = pending.token_ids_device
    assert ids.dtype == torch.int64 and ids.shape == (9,) and ids.device == logits.device
    assert torch.equal(ids, torch.tensor(out.token_ids))
    # and the work is __call__'s
    torch.manual_seed(0)
    again = sampler(logits, _mixed_batch(vocab))
    assert again == out
    assert [lp is not None for lp in out.logprobs] == [p.params.logprobs is not None for p in inputs]
    assert out.token_ids[6] in (1, 2, 4, 5, 7)                  # the grammar's tokens only
    assert out.token_ids[4] in (2, 3, 8, 13)
    assert out.token_ids[5] not in (EOS, 6) and 11 not in out.token_ids


class _CrossDeviceCopies(TorchDispatchMode):
    """Records every op that moves data between devices (its tensors on more than one device)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in [*args, *(kwargs or {}).values(), out] if isinstance(a, torch.Tensor)]
        if len({t.device.type for t in tensors}) > 1:
            self.seen.append(str(func))
        return out


def test_a_step_sends_its_host_values_in_one_copy():
    # the meta device stands in for an accelerator: every host value a step needs crosses in one copy (seeded rows'
    # generators live on the logits' device, as the engine makes them: none here, meta has no generator)
    vocab = 40
    inputs = _mixed_batch(vocab)
    for i in inputs:
        i.generator = None
    inputs[7].draft_probs = inputs[7].draft_probs.to("meta")       # a draft model's q lives on the device
    logits = rand_logits(9, vocab, seed=12).to("meta")
    with _CrossDeviceCopies() as copies:
        pending = Sampler(vocab, {EOS}).sample(logits, inputs)
    assert copies.seen == ["aten._to_copy.default"], copies.seen
    assert pending.token_ids_device.device.type == "meta"
    # a plain greedy batch sends nothing
    with _CrossDeviceCopies() as copies:
        Sampler(vocab, {EOS}).sample(logits, [inp(SamplingParams(temperature=0)) for _ in range(9)])
    assert copies.seen == []


def test_a_greedy_step_and_prompt_logprobs_read_back_once(host_reads):
    logits = rand_logits(5, 30, seed=13)
    with _DataDependentOps() as ops:
        pending = Sampler(30, {EOS}).sample(logits, [inp(SamplingParams(temperature=0)) for _ in range(5)])
        assert sum(host_reads.values()) == 0
        assert pending.result().token_ids == logits.argmax(-1).tolist()
        assert host_reads["tolist"] == 2            # the result's read, and this test's own argmax above
        compute_prompt_logprobs(logits, [1, 2, 3, 4, 5], 3)
        assert host_reads["tolist"] == 3 and host_reads["cpu"] == host_reads["item"] == 0
        # a draft model's draw: one read too
        tokens, probs = Sampler(30, {EOS}).draw(logits, [inp(SamplingParams(temperature=0.8, top_k=5, seed=s))
                                                         for s in range(5)])
        assert host_reads["tolist"] == 4 and len(tokens) == 5 and all(q.shape == (30,) for q in probs)
    assert ops.seen == []


def test_packed_result_equals_per_field_values():
    """The one packed read gives what the tensors give field by field: tokens (a seeded row's draw from its own
    generator: the Gumbel race on its temperature-scaled, top-k-filtered logits), chosen logprobs and ranks,
    the top-N ids and logprobs."""
    vocab = 50
    logits = rand_logits(6, vocab, seed=21)
    ps = [SamplingParams(temperature=0.7, seed=1, logprobs=3), SamplingParams(temperature=0, logprobs=5),
          SamplingParams(temperature=1.2, top_k=6, seed=2, logprobs=0), SamplingParams(temperature=0.9, seed=3),
          SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=1.0, seed=4, logprobs=vocab)]
    pending = Sampler(vocab, {EOS}).sample(logits, [inp(p) for p in ps])
    out = pending.result()
    # tokens, computed here with torch
    expected = []
    for r, p in enumerate(ps):
        if p.greedy:
            expected.append(int(logits[r].argmax()))
            continue
        y = logits[r] / torch.tensor(p.temperature)
        if p.top_k:
            y = y.masked_fill(y < y.topk(p.top_k).values[-1], -math.inf)
        u = torch.empty(vocab).uniform_(generator=torch.Generator().manual_seed(p.seed))
        expected.append(int((y - u.log().neg().clamp_min(1e-30).log()).argmax()))
    assert out.token_ids == expected
    assert pending.token_ids_device.tolist() == expected
    # logprobs, field by field: the batch's raw log_softmax, gathered at the chosen tokens, ranked, top-N
    lp = torch.log_softmax(logits, dim=-1)
    chosen = torch.tensor(expected)
    chosen_lp = lp.gather(1, chosen[:, None])[:, 0]
    ranks = (lp > chosen_lp[:, None]).sum(-1) + 1
    top_lp, top_ids = lp.topk(vocab, dim=-1)
    for r, p in enumerate(ps):
        if p.logprobs is None:
            assert out.logprobs[r] is None
            continue
        d = out.logprobs[r]
        ref = {expected[r]: (chosen_lp[r].item(), ranks[r].item())}
        for j in range(p.logprobs):
            ref.setdefault(top_ids[r, j].item(), (top_lp[r, j].item(), j + 1))
        assert list(d) == list(ref)                              # the chosen token first, then the top-N in order
        assert {t: (v.logprob, v.rank) for t, v in d.items()} == ref
        assert all(type(t) is int and type(v.rank) is int and type(v.logprob) is float for t, v in d.items())
    assert all(type(t) is int for t in out.token_ids)


def test_top_k_bound_from_the_host_equals_the_read_one():
    logits = rand_logits(4, 64, seed=14)
    top_k, top_p = torch.tensor([3, 10, 12, 7]), torch.tensor([0.9, 1.0, 0.8, 0.95])
    torch.testing.assert_close(apply_top_k_top_p_min_p(logits, top_k, top_p, None, k_max=12),
                               apply_top_k_top_p_min_p(logits, top_k, top_p, None))


# ----------------------------------------------------------------------------------------- validation

@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 3}, "min_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"logit_bias": {1: float("inf")}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"stop": ["x"], "detokenize": False}, "stop"),
])
def test_invalid_params_rejected(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_params_checked_against_vocab():
    check_params_for_vocab(SamplingParams(logit_bias={5: 1.0}, allowed_token_ids=[1]), 10)
    for kw, field in [({"logit_bias": {10: 1.0}}, "logit_bias"), ({"allowed_token_ids": [3, 12]}, "allowed_token_ids"),
                      ({"stop_token_ids": [10]}, "stop_token_ids"), ({"logprobs": 11}, "logprobs")]:
        with pytest.raises(ValueError, match=field):
            check_params_for_vocab(SamplingParams(**kw), 10)
