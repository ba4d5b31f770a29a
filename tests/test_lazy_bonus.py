"""A drafting step's bonus tokens sampled only where used (patch 15,
``vllm_lookahead.cpu.lazy_bonus``), against vLLM 0.32's own rejection sampler
on the CPU, without an engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import vllm_lookahead.cpu.lazy_bonus as lazy_bonus
from vllm_lookahead.cpu import sampling
from vllm_lookahead.cpu.sampling import TopPCounts
from vllm_lookahead.patches.registry import APPLIED, CPU_SAMPLER

VOCAB = 64


@pytest.fixture(scope="module")
def verifier():
    """vLLM's RejectionSampler over its Sampler, with the CPU fallbacks of
    its Triton kernels registered as a CPU worker registers them (and the
    expand kernel fixed)."""
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    fix = patch_named("expand_kernel_impl")
    if APPLIED.get(fix.target) is not fix:
        fix.apply()
    current_platform.register_triton_kernel_overrides()
    return RejectionSampler(Sampler())


def patch_named(name: str):
    from vllm_lookahead import patches

    return next(p for p in patches.declared() if p.name == name)


def metadata(b: int, **over):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    def full(v):
        return torch.full((b,), v, dtype=torch.float32)

    fields = dict(
        temperature=full(1.0), all_greedy=False, all_random=True, top_p=full(0.95),
        top_k=None, generators={}, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=full(0.0), presence_penalties=full(0.0),
        repetition_penalties=full(1.0), output_token_ids=[[] for _ in range(b)],
        spec_token_ids=[[] for _ in range(b)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    fields.update(over)
    return SamplingMetadata(**fields)


def spec(drafts: list[list[int]]):
    """vLLM's metadata with its row order: each request's draft rows, then
    its bonus row."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    md = SpecDecodeMetadata.make_dummy(drafts, "cpu")
    target, bonus, row = [], [], 0
    for d in drafts:
        target += list(range(row, row + len(d)))
        bonus.append(row + len(d))
        row += len(d) + 1
    md.target_logits_indices = torch.tensor(target, dtype=torch.int32)
    md.bonus_logits_indices = torch.tensor(bonus, dtype=torch.int32)
    return md, row


def test_applies_only_where_rows_can_be_cut():
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor

    assert lazy_bonus.applies(metadata(3))
    inactive = LogitBiasLogitsProcessor(None, torch.device("cpu"), False)
    assert lazy_bonus.applies(metadata(3, logitsprocs=LogitsProcessors([inactive])))
    active = LogitBiasLogitsProcessor(None, torch.device("cpu"), False)
    active.biases = {0: {5: 1.0}}
    unknown = SimpleNamespace(is_argmax_invariant=lambda: True)
    for over in (dict(generators={1: torch.Generator()}), dict(max_num_logprobs=0),
                 dict(no_penalties=False), dict(bad_words_token_ids={0: [[3]]}),
                 dict(allowed_token_ids_mask=torch.zeros(3, VOCAB, dtype=torch.bool)),
                 dict(all_random=False), dict(logprob_token_ids={0: [1]}),
                 dict(logitsprocs=LogitsProcessors([active])),
                 dict(logitsprocs=LogitsProcessors([unknown]))):
        assert not lazy_bonus.applies(metadata(3, **over)), over


def test_rows_metadata_keeps_the_rows_asked():
    sm = metadata(4, temperature=torch.tensor([0.5, 0.6, 0.7, 0.8]),
                  top_k=torch.tensor([1, 2, 3, 4]),
                  output_token_ids=[[1], [2], [3], [4]])
    sub = lazy_bonus.rows_metadata(sm, [3, 1], 4)
    assert sub.temperature.tolist() == pytest.approx([0.8, 0.6])
    assert sub.top_k.tolist() == [4, 2] and sub.top_p.shape == (2,)
    assert sub.output_token_ids == [[4], [2]] and sub.spec_token_ids == [[], []]
    assert sub.repetition_penalties.shape == (2,) and sub.generators == {}
    # token lists vLLM leaves empty (nothing reads them) stay empty
    sub = lazy_bonus.rows_metadata(metadata(4, output_token_ids=[], spec_token_ids=[]), [2], 4)
    assert sub.output_token_ids == [] and sub.spec_token_ids == []


def test_bonus_rows_sampled_only_where_used(verifier):
    """Peaked rows make every outcome certain: request 0 accepts its whole
    draft (its bonus token follows), 1 has no draft (its bonus token is
    its token), 2 rejects its first token (its recovered token, no bonus),
    3 rejects its second. The tokens are what vLLM's own path gives, and
    vLLM's sampler is called once, on the two bonus rows used."""
    drafts = [[3, 4], [], [7, 8, 9], [10, 11]]
    md, rows = spec(drafts)
    logits = torch.full((rows, VOCAB), -30.0)
    peaks = {0: 3, 1: 4, 2: 20, 3: 21, 4: 30, 5: 31, 6: 32, 7: 33, 8: 10, 9: 40, 10: 41}
    for row, tok in peaks.items():  # request 0: 0-2, 1: 3, 2: 4-7, 3: 8-10
        logits[row, tok] = 30.0
    sm = metadata(4, output_token_ids=[], spec_token_ids=[])  # as vLLM's engine fills it
    want = verifier(md, None, logits.clone(), sm).sampled_token_ids
    calls = []
    orig = verifier.sampler.forward

    def spy(*args, **kwargs):
        calls.append(kwargs["logits"].shape[0])
        return orig(*args, **kwargs)

    counts = sampling.COUNTS = TopPCounts()
    verifier.sampler.forward = spy
    try:
        got = lazy_bonus.forward(verifier, md, logits.clone(), sm)
    finally:
        del verifier.sampler.forward
    assert got.sampled_token_ids.tolist() == want.tolist() == [
        [3, 4, 20, -1], [21, -1, -1, -1], [30, -1, -1, -1], [10, 40, -1, -1]]
    assert calls == [2]
    assert (counts.bonus_rows, counts.bonus_rows_sampled) == (4, 2)
    assert (got.sampled_token_ids != lazy_bonus.PENDING).all()


def test_no_bonus_row_used_no_sampler_call(verifier):
    drafts = [[7], [8]]
    md, rows = spec(drafts)
    logits = torch.zeros(rows, VOCAB)
    logits[:, 1] = 30.0  # the drafts (7, 8) are never accepted
    calls = []
    orig = verifier.sampler.forward
    verifier.sampler.forward = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        out = lazy_bonus.forward(verifier, md, logits, metadata(2))
    finally:
        del verifier.sampler.forward
    assert out.sampled_token_ids[:, 0].tolist() == [1, 1] and calls == []


def test_the_distribution_is_vllms(verifier):
    """Unseeded requests whose drafts are accepted about a third of the
    time: the joint frequencies of (first token, second token) over 12000
    requests match vLLM's own path within sampling error."""
    n, rounds = 2000, 6
    drafts = [[2]] * n
    md, rows = spec(drafts)
    # a few tokens hold the mass (the joint's categories stay few, so the
    # sampling error of the distance is small)
    draft_row = torch.full((VOCAB,), -30.0)
    draft_row[:4] = torch.tensor([3.0, 2.5, 3.2, 2.0])  # the draft (2): p about 0.38
    bonus_row = torch.full((VOCAB,), -30.0)
    bonus_row[10:13] = torch.tensor([3.0, 3.5, 2.8])
    logits = torch.stack([draft_row, bonus_row]).repeat(n, 1)
    freq = []
    for lazy in (False, True):
        torch.manual_seed(11)
        counts: dict = {}
        for _ in range(rounds):
            sm = metadata(n)
            if lazy:
                out = lazy_bonus.forward(verifier, md, logits.clone(), sm)
            else:
                out = verifier(md, None, logits.clone(), sm)
            for row in out.sampled_token_ids.tolist():
                counts[tuple(row)] = counts.get(tuple(row), 0) + 1
        freq.append(counts)
    keys = set(freq[0]) | set(freq[1])
    tv = 0.5 * sum(abs(freq[0].get(k, 0) - freq[1].get(k, 0)) for k in keys) / (n * rounds)
    accepted = sum(c for k, c in freq[1].items() if k[0] == 2) / (n * rounds)
    assert 0.25 < accepted < 0.5 and len(keys) >= 5
    assert tv < 0.025, tv


def test_request_applies_predicts_the_batches_it_allows():
    """What the planner reads to price a rejected draft's skipped bonus row
    (``RequestState.lazy_bonus``): only a request that leaves
    :func:`lazy_bonus.applies` true for its batches."""
    from vllm import SamplingParams

    assert lazy_bonus.request_applies(SamplingParams(temperature=0.8, top_p=0.95))
    assert lazy_bonus.request_applies(SamplingParams(temperature=0.8, top_k=20))
    assert not lazy_bonus.request_applies(None)
    assert not lazy_bonus.request_applies(SamplingParams(temperature=0.0))
    for over in (dict(seed=3), dict(logprobs=2), dict(presence_penalty=0.5),
                 dict(frequency_penalty=0.1), dict(repetition_penalty=1.1),
                 dict(min_p=0.05), dict(min_tokens=4), dict(logit_bias={5: 1.0}),
                 dict(allowed_token_ids=[1, 2, 3]), dict(bad_words=["x"])):
        assert not lazy_bonus.request_applies(SamplingParams(temperature=0.8, **over)), over


def test_measure_verify_times_accepted_and_rejected_drafts(verifier):
    """The start-up measurement of vLLM's verification (warmup.measure_verify)
    runs vLLM's samplers on its synthetic rows: the one-token drafts it
    times as accepted are accepted and those it times as rejected are
    rejected (so ``bonus``, the accepted over the rejected, is what a lazy
    verifier skips), and every entry is ``(first, next, bonus, switch)``:
    at batch 1 the switch is 0 (one request's first token and the step's
    switch are one), and first + switch is what one drafting request adds
    over the plain sampler."""
    import vllm_lookahead.branch.warmup as warmup

    seen, seeded = [], []

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, md, draft_probs, logits, sm):
            out = self.inner(md, draft_probs, logits, sm)
            seen.append((md.draft_token_ids.tolist(), md.num_draft_tokens,
                         out.sampled_token_ids.tolist()))
            seeded.append(sorted(sm.generators))
            return out

    runner = SimpleNamespace(
        device=torch.device("cpu"), sampler=verifier.sampler, rejection_sampler=Spy(verifier),
        model_config=SimpleNamespace(get_vocab_size=lambda: 512, dtype=torch.float32))
    table = warmup._measure_verify(runner, [1, 2])
    assert set(table) == {"sampled", "greedy", "seeded"}
    for kind in table.values():
        assert set(kind) == {1, 2}
        for row in kind.values():
            assert len(row) == 4 and all(x >= 0 for x in row)
        assert kind[1][3] == 0.0
    # a greedy or seeded batch's bonus rows are never skipped: not timed, 0
    assert all(row[2] == 0.0 for row in table["greedy"].values())
    assert all(row[2] == 0.0 for row in table["seeded"].values())
    # the seeded kind ran vLLM's verifier with a generator for every request
    # (batches 1 and 2), the others with none
    assert [0] in seeded and [0, 1] in seeded and [] in seeded
    assert all(g in ([], [0], [0, 1]) for g in seeded)
    every = [(tokens, out) for tokens, nums, out in seen if len(nums) == 2 and nums == [1, 1]]
    hits = [out for tokens, out in every if tokens == [1, 1]]
    misses = [out for tokens, out in every if tokens == [511, 511]]
    assert hits and misses
    assert all(row[0] == 1 and row[1] >= 0 for out in hits for row in out)  # accepted, bonus
    assert all(row[0] != 511 and row[1] == -1 for out in misses for row in out)  # rejected


def test_patched_verifier_samples_vllms_tokens(verifier):
    """The CPU sampler patches as installed (the temperature divided by
    ``defer_top_k_top_p``, top-k/top-p expanded per draft token, the lazy
    verification, the tie rows) against vLLM's own rejection sampler:
    seeded requests (each draw from its generator), temperatures, top-k and
    top-p by request, a greedy request among them: the same tokens."""
    from vllm_lookahead import patches

    vocab, b = 4096, 6
    drafts = [[5, 6, 7], [], [8, 9], [10], [11, 12, 13, 14], [15, 16]]
    md, rows = spec(drafts)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(rows, vocab, generator=g)
    logits[:, :24] += 6 + 4 * torch.rand(rows, 24, generator=g)
    logits = logits.bfloat16().float()  # ties, as a bfloat16 model's
    temperature = torch.tensor([0.8, 1.0, 0.0, 0.6, 1.3, 0.9])
    top_k = torch.tensor([vocab, 40, vocab, 8, vocab, 100], dtype=torch.int32)
    top_p = torch.tensor([0.95, 0.9, 1.0, 0.8, 0.99, 0.7])

    def sampled(seed):
        return metadata(b, temperature=temperature, all_random=False, top_k=top_k,
                        top_p=top_p, output_token_ids=[], spec_token_ids=[],
                        generators={i: torch.Generator().manual_seed(seed + i)
                                    for i in range(b) if temperature[i] > 0})

    speedups = [p for p in patches.declared() if p.when is CPU_SAMPLER]
    assert len(speedups) == 5
    was = [p for p in speedups if APPLIED.get(p.target) is p]
    for p in was:  # the plugin applied them in this process: vLLM's own first
        p.revert()
    try:
        for seed in range(0, 40, 10):
            want = verifier(md, None, logits.clone(), sampled(seed)).sampled_token_ids
            for p in speedups:
                p.apply()
            try:
                got = verifier(md, None, logits.clone(), sampled(seed)).sampled_token_ids
            finally:
                for p in speedups:
                    p.revert()
            assert got.tolist() == want.tolist(), seed
    finally:
        for p in was:
            p.apply()
