"""The CPU verifier's top-k/top-p and noise (patch 15) against vLLM's own
functions, without an engine."""

from __future__ import annotations

import pytest
import torch

from vllm_lookahead.cpu_sampling import TopPCounts, recovered_inv_q, top_k_top_p_rows

VOCAB = 49152


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
    counts = TopPCounts()
    want = vllm_top_k_top_p(logits.clone(), None if k is None else k.clone(), p)
    got = top_k_top_p_rows(logits.clone(), k, p, vllm_top_k_top_p, counts)
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
    counts = TopPCounts()
    top_k_top_p_rows(logits.clone(), None, p, boom, counts, margin=0.0)
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
