"""The CPU verifier's top-k/top-p and noise (patch 15) against vLLM's own
functions, without an engine."""

from __future__ import annotations

import pytest
import torch

from vllm_lookahead.cpu import sampling
from vllm_lookahead.cpu.sampling import TopPCounts, recovered_inv_q, top_k_top_p_rows

VOCAB = 49152


def fresh_counts() -> TopPCounts:
    """A new ``sampling.COUNTS``, which the functions under test count into."""
    sampling.COUNTS = TopPCounts()
    return sampling.COUNTS


def vllm_top_k_top_p(logits, k, p):
    """vLLM 0.32's CPU path: sort the vocabulary."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    return apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)


def lm_like(rows: int, seed: int, bf16: bool = False) -> torch.Tensor:
    """Logits with a language model's shape: a few large ones over a long
    tail (the nucleus of p 0.9 is a few to a few hundred tokens); ``bf16``:
    rounded to bfloat16 first (ties, as vLLM's bf16 models give)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, VOCAB, generator=g)
    head = 13 + 6 * torch.rand(rows, 1, generator=g)  # the head's height
    decay = 0.05 + 0.5 * torch.rand(rows, 1, generator=g)  # its steepness
    x[:, :64] += head - decay * torch.arange(64) + torch.rand(rows, 64, generator=g)
    x = x[:, torch.randperm(VOCAB, generator=g)]
    return x.bfloat16().float() if bf16 else x


def check(logits, k, p) -> TopPCounts:
    want = vllm_top_k_top_p(logits.clone(), None if k is None else k.clone(), p)
    counts = fresh_counts()
    got = top_k_top_p_rows(logits.clone(), k, p, vllm_top_k_top_p)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert torch.equal(got, want)
    assert counts.rows == logits.shape[0]
    return counts


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("p", [0.5, 0.9, 0.95, 0.99])
def test_top_p_matches_vllm(bf16, p):
    logits = lm_like(64, seed=int(p * 100) + bf16, bf16=bf16)
    counts = check(logits, None, torch.full((64,), p))
    # most rows decided without sorting (ties and near-threshold rows not)
    assert counts.fallback_rows < 0.5 * counts.rows, counts


def test_top_k_and_top_p_match_vllm():
    logits = lm_like(48, seed=7, bf16=True)
    k = torch.tensor([20, VOCAB, 1, 300, 256, 5] * 8, dtype=torch.int32)
    p = torch.tensor([0.9, 0.95, 0.5, 0.8, 0.99, 0.7] * 8)
    counts = check(logits, k, p)
    # k beyond the window (300) cannot be decided from it
    assert counts.fallback_rows >= 8


def test_rows_left_to_vllm_still_match():
    """Rows it cannot decide go to the fallback: p = 1 (vLLM still masks
    tokens of zero probability), a flat row (nucleus past the window),
    a row of ties, -inf entries (a grammar's mask)."""
    logits = lm_like(6, seed=3)
    logits[1] = torch.randn(VOCAB) * 0.01  # flat: thousands in the nucleus
    logits[2] = torch.randint(0, 3, (VOCAB,)).float()  # ties everywhere
    logits[3, 100:] = float("-inf")  # only 100 tokens allowed
    logits[4, :] = -80.0
    logits[4, 7] = 30.0  # one token holds all the mass (others underflow)
    p = torch.tensor([1.0, 0.9, 0.9, 0.9, 0.9, 0.9])
    counts = check(logits, None, p)
    assert counts.fallback_rows >= 3  # rows 0, 1, 2


def test_decided_rows_never_call_the_fallback():
    logits = lm_like(8, seed=11)

    def boom(*args):
        raise AssertionError("fallback called")

    p = torch.full((8,), 0.9)
    counts = fresh_counts()
    top_k_top_p_rows(logits.clone(), None, p, boom, margin=0.0)
    assert counts.fallback_rows == 0


def test_recovered_noise_only_for_drafting_requests_and_their_support():
    vocab = 1000
    # draft positions: request 1 has 3, request 2 (seeded) 2
    probs = torch.zeros(5, vocab)
    probs[0, [3, 7]] = 0.5
    probs[1, 9] = 1.0
    probs[2, [3, 500]] = 0.5
    probs[3:, :] = 1.0 / vocab
    gens = {2: torch.Generator().manual_seed(5)}
    twin = torch.Generator().manual_seed(5)
    inv_q = recovered_inv_q([0, 3, 2, 0], probs, gens, torch.float32, "cpu")
    assert inv_q.shape == (4, vocab)
    assert torch.all(inv_q[0] == 0) and torch.all(inv_q[3] == 0)  # never read
    # request 1: noise on the union of its positions' support, 0 elsewhere
    support = inv_q[1].nonzero().squeeze(1).tolist()
    assert support == [3, 7, 9, 500]
    # the seeded request's row is its generator's draw, as vLLM makes it
    assert torch.equal(inv_q[2], torch.empty(vocab).exponential_(generator=twin).reciprocal())
    # a seeded request without a draft leaves its generator untouched
    gens = {0: torch.Generator().manual_seed(5)}
    recovered_inv_q([0, 1], torch.full((1, 10), 0.1), gens, torch.float64, "cpu")
    assert torch.equal(gens[0].get_state(), torch.Generator().manual_seed(5).get_state())


def test_recovered_tokens_keep_vllms_distribution():
    """The recovered token of a rejected draft position is drawn from the
    target's probabilities less the draft token's, normalised: with noise
    on the support only, as with vLLM's full draw (the same argmax)."""
    vocab, n = 50, 20000
    p = torch.zeros(vocab)
    p[[2, 5, 11, 40]] = torch.tensor([0.4, 0.3, 0.2, 0.1])
    draft = 5
    adj = p.clone()
    adj[draft] = 0
    want = adj / adj.sum()
    torch.manual_seed(0)
    counts = torch.zeros(vocab)
    for _ in range(n // 500):
        probs = p.repeat(500, 1)
        inv_q = recovered_inv_q([1] * 500, probs, {}, torch.float32, "cpu")
        scores = probs * inv_q
        scores[:, draft] = 0  # the kernel's NO_DRAFT_PROBS mask
        counts += torch.bincount(scores.argmax(dim=1), minlength=vocab).float()
    freq = counts / n
    assert freq[draft] == 0 and float(freq[p == 0].sum()) == 0
    assert torch.allclose(freq, want, atol=0.012)


# -- lazy verification (verify_sampled_rows) ---------------------------------------

PLACEHOLDER = -1


def _vllm_kernels():
    """vLLM 0.32's CPU kernels of the rejection sampler (the C++ ops its CPU
    platform registers for the Triton ones)."""
    from vllm.utils import cpu_triton_utils as k

    return k


def _setup(seed, nd, greedy, vocab=4096, p=0.9, top_k=None):
    g = torch.Generator().manual_seed(seed)
    num_tokens = sum(nd)
    logits = torch.randn(num_tokens, vocab, generator=g)
    # a head of a few tokens over a long tail; drafts mostly from the head,
    # so that positions are accepted and rejected at every depth
    logits[:, :4] += 9 + 3 * torch.rand(num_tokens, 4, generator=g)
    drafts = torch.randint(0, 5, (num_tokens,), generator=g, dtype=torch.int32)
    likely = torch.rand(num_tokens, generator=g) < 0.6
    drafts[likely] = logits[likely].argmax(dim=-1).to(torch.int32)
    drafts[torch.rand(num_tokens, generator=g) < 0.05] = -1  # padded positions
    bonus = torch.randint(0, vocab, (len(nd), 1), generator=g, dtype=torch.int64)
    temp = torch.tensor([0.0 if gr else 0.8 for gr in greedy])
    per_tok = torch.repeat_interleave(torch.where(temp == 0, 1.0, temp), torch.tensor(nd))
    target = logits / per_tok.unsqueeze(1)
    pp = torch.full((num_tokens,), p)
    kk = None if top_k is None else torch.full((num_tokens,), top_k, dtype=torch.int32)
    return target, drafts, bonus, temp == 0, pp, kk


def _generators(nd, greedy, seed):
    return {i: torch.Generator().manual_seed(seed + i) for i in range(len(nd)) if not greedy[i]}


def _uniform(nd, gens):
    from vllm.v1.sample.rejection_sampler import generate_uniform_probs

    return generate_uniform_probs(sum(nd), nd, gens, "cpu")


def _greedy_rows(target, drafts, nd, bonus, is_greedy, gens, max_spec):
    """The output buffer with the greedy requests verified by vLLM's kernel,
    and the uniform draws (both paths start so)."""
    k = _vllm_kernels()
    cu = torch.tensor(nd).cumsum(0)
    out = torch.full((len(nd), max_spec + 1), PLACEHOLDER, dtype=torch.int32)
    uniform = _uniform(nd, gens)
    k._rejection_greedy_sample_kernel_impl(out, cu, drafts, target.argmax(dim=-1), bonus,
                                           is_greedy, max_spec)
    return k, cu, out, uniform


def vllm_rejection(target, drafts, nd, bonus, is_greedy, kk, pp, gens, max_spec):
    """vLLM 0.32's rejection_sample on the CPU, every draft row computed."""
    k, cu, out, uniform = _greedy_rows(target, drafts, nd, bonus, is_greedy, gens, max_spec)
    probs = vllm_top_k_top_p(target.clone(), kk, pp).softmax(dim=-1, dtype=torch.float32)
    q = torch.empty(len(nd), target.shape[1]).exponential_()
    for i, gen in gens.items():
        if nd[i] > 0:
            q[i].exponential_(generator=gen)
    recovered = torch.empty_like(drafts)
    k._sample_recovered_tokens_kernel_impl(recovered, cu, drafts, None, probs, q.reciprocal(),
                                           target.shape[1], NO_DRAFT_PROBS=True)
    k._rejection_random_sample_kernel_impl(out, cu, drafts, None, probs, bonus, recovered,
                                           uniform, is_greedy, max_spec, target.shape[1],
                                           NO_DRAFT_PROBS=True)
    return out


def lazy_rejection(target, drafts, nd, bonus, is_greedy, kk, pp, gens, max_spec):
    from vllm_lookahead.cpu.sampling import verify_sampled_rows

    _, _, out, uniform = _greedy_rows(target, drafts, nd, bonus, is_greedy, gens, max_spec)
    verify_sampled_rows(out, drafts, nd, target.clone(), kk, pp, bonus, uniform, is_greedy,
                        gens, lambda x, k_, p_, ties=None: top_k_top_p_rows(
                            x, k_, p_, vllm_top_k_top_p, ties=ties))
    return out


@pytest.mark.parametrize("top_k", [None, 20])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lazy_verification_samples_what_vllm_samples(seed, top_k):
    """Seeded requests (every random draw from its generator): the tokens
    are vLLM's, token for token, greedy requests and drafts of every length
    (none, padded positions) in the batch, though rows past a rejection are
    never computed."""
    nd = [3, 0, 6, 1, 4, 2, 16, 5, 0, 7] * 4
    greedy = [False, False, True, False, False, True, False, False, True, False] * 4
    target, drafts, bonus, is_greedy, pp, kk = _setup(seed, nd, greedy, top_k=top_k)
    want = vllm_rejection(target, drafts, nd, bonus, is_greedy, kk, pp,
                          _generators(nd, greedy, 100 * seed), 16)
    counts = fresh_counts()
    got = lazy_rejection(target, drafts, nd, bonus, is_greedy, kk, pp,
                         _generators(nd, greedy, 100 * seed), 16)
    assert torch.equal(got, want), (got, want)
    sampled_rows = sum(n for n, gr in zip(nd, greedy) if not gr)
    assert counts.draft_rows == sampled_rows
    # the accepted prefixes decide the rows computed: one per accepted token
    # and one for the rejection, none past it
    expect = 0
    for i, n in enumerate(nd):
        if greedy[i] or n == 0:
            continue
        drafted = drafts[sum(nd[:i]): sum(nd[:i]) + n].tolist()
        accepted = 0
        while accepted < n and int(got[i, accepted]) == drafted[accepted]:
            accepted += 1
        expect += min(accepted + 1, n)
    assert counts.verified_rows == expect < sampled_rows


def test_lazy_verification_keeps_the_distribution():
    """Unseeded requests draw the recovered token's noise on the row's
    support only: the sequences sampled keep vLLM's frequencies."""
    vocab, reqs, n = 6, 4000, 3
    g = torch.Generator().manual_seed(3)
    row_logits = torch.randn(n, vocab, generator=g) * 1.5
    target = row_logits.repeat(reqs, 1)
    drafts = torch.tensor([1, 2, 0] * reqs, dtype=torch.int32)
    bonus = torch.full((reqs, 1), 5, dtype=torch.int64)
    nd = [n] * reqs
    pp = torch.full((n * reqs,), 0.9)
    freq = []
    for fn in (vllm_rejection, lazy_rejection):
        torch.manual_seed(11)
        counts: dict = {}
        for _ in range(3):
            out = fn(target, drafts, nd, bonus, None, None, pp, {}, n)
            for row in out.tolist():
                counts[tuple(row)] = counts.get(tuple(row), 0) + 1
        freq.append(counts)
    keys = set(freq[0]) | set(freq[1])
    total = 3 * reqs
    tv = 0.5 * sum(abs(freq[0].get(k, 0) - freq[1].get(k, 0)) for k in keys) / total
    assert len(keys) > 4
    assert tv < 0.03, (tv, freq)


def _setup_ties(seed, nd, vocab=4096):
    """Draft rows whose nucleus cut falls inside a group of tied logits (as
    bfloat16 logits give): a head of 2-4 tokens, a group of 4-12 tokens of
    one logit, a long tail; p set so that the cut falls inside the group.
    Drafts: head tokens (mostly accepted), tied tokens (only vLLM's sort
    says whether kept), tail tokens (probability 0) and padded positions."""
    g = torch.Generator().manual_seed(seed)
    num_tokens = sum(nd)
    logits = torch.randn(num_tokens, vocab, generator=g) - 4.0
    pp = torch.empty(num_tokens)
    drafts = torch.empty(num_tokens, dtype=torch.int32)
    for r in range(num_tokens):
        perm = torch.randperm(vocab, generator=g)
        n_head = int(torch.randint(2, 5, (1,), generator=g))
        n_tie = int(torch.randint(4, 13, (1,), generator=g))
        head, tied = perm[:n_head], perm[n_head:n_head + n_tie]
        logits[r, head] = 4.0 + 2.0 * torch.rand(n_head, generator=g)
        logits[r, tied] = 2.5
        probs = (logits[r] / 0.8).softmax(-1).double()  # at the temperature below
        above = probs[head].sum()
        q = float(probs[tied[0]])
        # the cut after 1..n_tie-1 tied tokens, half-way between two places
        k = int(torch.randint(1, n_tie, (1,), generator=g))
        pp[r] = float(above) + (k - 0.5) * q
        kind = float(torch.rand(1, generator=g))
        drafts[r] = (int(head[0]) if kind < 0.45 else int(tied[0]) if kind < 0.6
                     else int(perm[-1]) if kind < 0.95 else -1)
    bonus = torch.randint(0, vocab, (len(nd), 1), generator=g, dtype=torch.int64)
    is_greedy = torch.zeros(len(nd), dtype=torch.bool)
    target = logits / 0.8
    return target, drafts, bonus, is_greedy, pp


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_lazy_verification_decides_ties_as_vllm(seed):
    """Rows whose cut falls inside a tie are decided without vLLM's sort
    where the answer does not depend on which tied tokens it keeps: seeded
    requests sample vLLM's tokens, token for token, and most such rows are
    never sorted."""
    nd = [3, 0, 6, 1, 4, 2, 5, 1] * 6
    greedy = [False] * len(nd)
    target, drafts, bonus, is_greedy, pp = _setup_ties(seed, nd)
    want = vllm_rejection(target, drafts, nd, bonus, is_greedy, None, pp,
                          _generators(nd, greedy, 7 + seed), 6)
    counts = fresh_counts()
    got = lazy_rejection(target, drafts, nd, bonus, is_greedy, None, pp,
                         _generators(nd, greedy, 7 + seed), 6)
    assert torch.equal(got, want), (got, want)
    assert counts.tie_rows > 10, counts
    # tied draft tokens (about 15%) and tied recovered winners need the sort
    assert counts.tie_rows_sorted < 0.5 * counts.tie_rows, counts
    assert counts.fallback_rows == counts.tie_rows_sorted, counts


def test_lazy_verification_keeps_the_distribution_with_ties():
    """Unseeded requests on rows cut inside a tie: the recovered tokens
    (drawn on the superset's noise, the sort taken only for a tied winner)
    keep vLLM's frequencies."""
    vocab, reqs = 12, 3000
    row = torch.tensor([3.0, 2.0, 1.0, 1.0, 1.0, 1.0, -1.0, -2.0, -2.0, -3.0, -3.0, -4.0])
    probs = row.softmax(-1).double()
    p = float(probs[:2].sum() + 2.5 * probs[2])  # the cut inside the tie
    target = row.repeat(reqs, 1)
    drafts = torch.zeros(reqs, dtype=torch.int32)  # the head token, often rejected
    bonus = torch.full((reqs, 1), 11, dtype=torch.int64)
    nd = [1] * reqs
    pp = torch.full((reqs,), p)
    freq = []
    for fn in (vllm_rejection, lazy_rejection):
        torch.manual_seed(5)
        counts: dict = {}
        for _ in range(3):
            out = fn(target, drafts, nd, bonus, None, None, pp, {}, 1)
            for r in out[:, 0].tolist():
                counts[r] = counts.get(r, 0) + 1
        freq.append(counts)
    keys = set(freq[0]) | set(freq[1])
    total = 3 * reqs
    tv = 0.5 * sum(abs(freq[0].get(k, 0) - freq[1].get(k, 0)) for k in keys) / total
    assert len(keys) >= 3, freq
    assert tv < 0.03, (tv, freq)


def test_margin_covers_vllms_rounding():
    """``MARGIN`` against what it guards: where vLLM's float32 sums (the
    softmax, the cumulative sum over the sorted row) put the mass above
    each of the row's largest tokens, against this module's float64 sums
    over the window; kept well inside the margin."""
    from vllm_lookahead.cpu.sampling import MARGIN, WINDOW

    worst = 0.0
    for bf16 in (False, True):
        x = lm_like(16, seed=41 + bf16, bf16=bf16)
        for scale in (1.25, 0.6, 0.3):
            rows = x * scale
            asc = rows.sort(dim=-1).values.softmax(dim=-1).cumsum(dim=-1)
            top = rows.topk(WINDOW, dim=-1).values
            mx = top[:, :1]
            lse = mx.double() + torch.log(torch.exp(rows - mx).sum(-1, keepdim=True).double())
            probs = torch.exp(top.double() - lse)
            above = probs.cumsum(-1) - probs
            vllm_above = 1 - asc.flip(-1)[:, :WINDOW].double()
            d = torch.where(above < 0.9999, (vllm_above - above).abs(), 0.0)
            worst = max(worst, float(d.max()))
    assert 0 < worst < MARGIN / 4, worst
