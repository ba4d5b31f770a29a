"""The lookahead branch on the GPU backends' cache layouts, run on the CPU.

No GPU vLLM runs here, so what a CUDA engine hands the branch is rebuilt
with vLLM's own code: per-layer strided views of one shared buffer made by
``vllm.v1.kv_cache_interface.create_kv_cache_views`` for every
``KVCacheLayout`` (LBNHC is CUDA's default), filled by a torch writer of
the FlashAttention / FlashInfer / Triton packing (``C = [K | V]``: what
their ``reshape_and_cache_flash`` writes through
``kv_cache.transpose(1, 2).split(head_size, -1)``). On those caches:

* the layout probe finds the ``split`` packing, whatever the strides;
* the gather reads back exactly what was written;
* the worker's batched tree attention equals the plain per-request
  reference;
* every index, mask and id tensor follows the cache's device (``meta``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import gpu_tree_check  # benchmarks/, on the path through conftest.py
from gpu_tree_check import gather_sequence, tree_attention
from test_tree_attention import _slots, tree_meta
from vllm_lookahead.branch.kv_layout import probe_page_layout, scratch_like

kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

BS, KVH, HD, NB, LAYERS = 16, 2, 64, 12, 3


class FlashWriter(gpu_tree_check.FlashWriter):
    """``reshape_and_cache_flash`` in torch (the GPU check's writer) at this
    file's head size: K into ``C[:D]``, V into ``C[D:]``, any strides."""

    def __init__(self) -> None:
        super().__init__(HD)


def gpu_views(layout: KVCacheLayout, dtype, num_layers=LAYERS, seed=0):
    """Per-layer cache views as vLLM 0.32 builds them for ``layout``, over
    a random backing buffer (garbage wherever nothing is written)."""
    spec = kvi.FullAttentionSpec(block_size=BS, num_kv_heads=KVH, head_size=HD, dtype=dtype)
    layer_stride, block_stride, *_ = kvi.compute_layout_strides(spec, NB, num_layers, layout)
    size = num_layers * NB * spec.page_size_bytes
    tensor = kvi.KVCacheTensor(size=size, layers=[f"l{i}" for i in range(num_layers)],
                               layer_stride=layer_stride, block_stride=block_stride)
    g = torch.Generator().manual_seed(seed)
    elem = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randn(size // elem, generator=g).to(dtype).view(torch.int8)  # finite garbage
    return kvi.create_kv_cache_views(raw, spec, NB, layout, tensor)


LAYOUTS = [pytest.param(lay, id=lay.name) for lay in KVCacheLayout]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_probe_and_gather_on_gpu_layouts(layout, dtype):
    views = gpu_views(layout, dtype)
    cache = views[1]
    assert cache.shape == (NB, KVH, BS, 2 * HD) and cache.dtype == dtype
    if layout is not KVCacheLayout.LBHNC:
        assert not cache.is_contiguous()  # what the old branch refused
    # the scratch page keeps the real cache's physical order
    scratch = scratch_like(cache)
    def order(t):  # physical order of the dims within a block
        return [i for i in sorted(range(4), key=lambda i: (-t.stride()[i], i)) if i]

    assert order(scratch) == order(cache)
    lay = probe_page_layout(cache, HD, FlashWriter())
    assert lay.name == "split"
    writer = FlashWriter()
    g = torch.Generator().manual_seed(1)
    seqs = [(40, [5, 1, 6]), (16, [3]), (17, [0, 7]), (1, [2])]
    written = []
    before = [v.clone() for v in views]
    for length, blocks in seqs:
        k = torch.randn(length, KVH, HD, generator=g).to(dtype)
        v = torch.randn(length, KVH, HD, generator=g).to(dtype)
        writer(k, v, cache, _slots(blocks, length, BS))
        written.append((k, v))
    # the other layers' views of the shared buffer are untouched
    assert torch.equal(views[0], before[0]) and torch.equal(views[2], before[2])
    for (length, blocks), (k, v) in zip(seqs, written):
        gk, gv = gather_sequence(cache, torch.tensor(blocks + [0]), length, lay)
        assert torch.equal(gk, k.transpose(0, 1)), (layout, length)
        assert torch.equal(gv, v.transpose(0, 1)), (layout, length)


def test_probe_tells_gpu_and_cpu_packings_apart():
    """The same bytes read with the wrong packing give other values: the
    probe decides the packing, not the shape."""
    from test_tree_attention import _vllm_writer

    cache = torch.zeros(4, KVH, BS, 2 * HD)
    gpu = probe_page_layout(cache, HD, FlashWriter())
    cpu = probe_page_layout(cache, HD, _vllm_writer("vec"))
    assert gpu.name == "split" and cpu.name == "strided"
    k = torch.randn(20, KVH, HD)
    v = torch.randn(20, KVH, HD)
    FlashWriter()(k, v, cache, _slots([2, 0], 20, BS))
    right, _ = gather_sequence(cache, torch.tensor([2, 0]), 20, gpu)
    wrong, _ = gather_sequence(cache, torch.tensor([2, 0]), 20, cpu)
    assert torch.equal(right, k.transpose(0, 1))
    assert not torch.equal(wrong, k.transpose(0, 1))


@pytest.mark.parametrize("softcap", [0.0, 4.0])
@pytest.mark.parametrize("window", [-1, 30])
@pytest.mark.parametrize("layout", [KVCacheLayout.LBNHC, KVCacheLayout.BLNHC,
                                    KVCacheLayout.LHBNC])
def test_tree_attention_on_gpu_layouts_equals_reference(layout, window, softcap):
    from types import SimpleNamespace

    from vllm_lookahead.worker import TreeAttentionImpl

    torch.manual_seed(2)
    h = 4
    cache = gpu_views(layout, torch.float32, seed=3)[2]
    lay = probe_page_layout(cache, HD, FlashWriter())
    reqs = [(37, [3, 0, 9], (4, 3, 2)), (5, [7], (3, 2, 0)), (50, [1, 4, 8, 11], (2, 4, 3))]
    offset = 3
    meta, total, prefixes = tree_meta(reqs, offset, FlashWriter(), cache, BS)
    query = torch.randn(total, h, HD)
    key = torch.randn(total, KVH, HD)
    value = torch.randn(total, KVH, HD)
    inner = SimpleNamespace(scale=0.2, logits_soft_cap=softcap, sliding_window=window)
    impl = TreeAttentionImpl(inner, "layer", 0, lay, owner=None)
    out = torch.full((total, h, HD), 7.0)
    impl._tree(meta, query, key, value, cache, out)
    for r, (s, e) in enumerate(zip(meta.starts, meta.ends)):
        ck, cv = prefixes[r]
        ref = tree_attention(query[s:e], key[s:e], value[s:e], ck.transpose(0, 1),
                             cv.transpose(0, 1), torch.from_numpy(meta.masks[r]),
                             torch.from_numpy(meta.positions[s - offset:e - offset]), 0.2,
                             sliding_window=window, softcap=softcap)
        torch.testing.assert_close(out[s:e], ref, rtol=1e-5, atol=1e-5)
    assert torch.all(out[:offset] == 7.0)


class CellWriter:
    """A packing whose K runs across the cell's token rows: the cell
    ``[N, C]`` read flat as vLLM's CPU backend lays it, K transposed
    (``K[t, d]`` at ``d * N + t``), then V (``N * D + t * D + d``); written
    element by element through the logical view, so any strides."""

    head_size = HD

    def __call__(self, k, v, cache, slots):
        n, c = cache.shape[2], cache.shape[3]
        slots = slots.long()
        b, t = slots // n, slots % n
        h = torch.arange(cache.shape[1])
        d = torch.arange(HD)
        for vals, flat in ((k, d[None, :] * n + t[:, None]),
                           (v, n * HD + t[:, None] * HD + d[None, :])):
            row, col = flat // c, flat % c  # [tokens, D]
            cache[b[:, None, None], h[None, :, None], row[:, None, :], col[:, None, :]] = \
                vals.to(cache.dtype)


@pytest.mark.parametrize("layout", [KVCacheLayout.LBHNC, KVCacheLayout.LBNHC,
                                    KVCacheLayout.BHLNC])
def test_gather_reads_a_packing_across_token_rows_on_any_strides(layout):
    """Where the cache's blocks are copied in their physical order (a
    non-contiguous logical view), a K or V whose offsets cross the cell's
    token rows cannot be read by strides over that copy: the gather falls
    back to reading it by index, and still reads exactly what was written."""
    cache = gpu_views(layout, torch.float32)[1]
    lay = probe_page_layout(cache, HD, CellWriter())
    assert lay.name == "strided"
    g = torch.Generator().manual_seed(4)
    for length, blocks in [(40, [5, 1, 6]), (3, [2])]:
        k = torch.randn(length, KVH, HD, generator=g)
        v = torch.randn(length, KVH, HD, generator=g)
        CellWriter()(k, v, cache, _slots(blocks, length, BS))
        gk, gv = gather_sequence(cache, torch.tensor(blocks), length, lay)
        assert torch.equal(gk, k.transpose(0, 1)) and torch.equal(gv, v.transpose(0, 1))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_major_gather_reads_in_place_of_a_dense_copy(layout):
    """Where the copied blocks hold a request's tokens at one stride (the
    token outermost within a block: LBNHC, CUDA's default, and BLNHC), K
    and V come back as views of the one copy, equal to what was written;
    elsewhere the gather declines. The worker's tree attention over such a
    copy writes its tree rows into the copy, never into the cache."""
    from types import SimpleNamespace

    from vllm_lookahead.branch.kv_layout import gather_token_major
    from vllm_lookahead.worker import TreeAttentionImpl

    views = gpu_views(layout, torch.float32, seed=5)
    cache = views[1]
    lay = probe_page_layout(cache, HD, FlashWriter())
    g = torch.Generator().manual_seed(6)
    k = torch.randn(40, KVH, HD, generator=g)
    v = torch.randn(40, KVH, HD, generator=g)
    FlashWriter()(k, v, cache, _slots([5, 1, 6], 40, BS))
    got = gather_token_major(cache, torch.tensor([[5, 1, 6, 0]]), lay)
    if layout.name not in ("LBNHC", "BLNHC"):
        assert got is None
        return
    gk, gv = got
    assert gk.shape == (1, KVH, 4 * BS, HD) and gk.data_ptr() != cache.data_ptr()
    assert torch.equal(gk[0, :, :40], k.transpose(0, 1))
    assert torch.equal(gv[0, :, :40], v.transpose(0, 1))
    # the whole layer over that gather: the cache's bytes stay as they were
    reqs = [(37, [3, 0, 9], (4, 3, 2)), (5, [7], (3, 2, 0))]
    meta, total, _ = tree_meta(reqs, 2, FlashWriter(), cache, BS)
    before = [x.clone() for x in views]
    inner = SimpleNamespace(scale=0.2, logits_soft_cap=0.0, sliding_window=-1)
    impl = TreeAttentionImpl(inner, "layer", 0, lay, owner=None)
    impl._tree(meta, torch.randn(total, 4, HD), torch.randn(total, KVH, HD),
               torch.randn(total, KVH, HD), cache, torch.zeros(total, 4, HD))
    assert impl._token_major is True
    assert all(torch.equal(a, b) for a, b in zip(views, before))


class _NoWrite:
    head_size = HD

    def __call__(self, *args):
        pass


def test_everything_follows_the_cache_device():
    """On a ``meta`` device (no data, no CPU fallback possible), the step's
    block ids, masks, row maps and the whole batched layer run there: a
    tensor made on the CPU by mistake fails here as it would on CUDA."""
    from types import SimpleNamespace

    from vllm_lookahead.worker import TreeAttentionImpl

    cpu_cache = gpu_views(KVCacheLayout.LBNHC, torch.float32)[0]
    lay = probe_page_layout(cpu_cache, HD, FlashWriter())
    meta_dev = torch.device("meta")
    lay = type(lay)(**{**lay.__dict__, "k_off": lay.k_off.to(meta_dev),
                       "v_off": lay.v_off.to(meta_dev)})
    cache = torch.empty_strided(cpu_cache.shape, cpu_cache.stride(), device=meta_dev)
    for sizes in ("mixed", "uniform"):
        trees = [(4, 3, 2), (3, 2, 0)] if sizes == "mixed" else [(4, 3, 2), (4, 3, 2)]
        reqs = [(37, [3, 0, 9], trees[0]), (5, [7], trees[1])]
        meta, total, _ = tree_meta(reqs, 2, _NoWrite(), torch.empty(1, KVH, BS, 2 * HD), BS,
                                   device="meta")
        ids, p = meta.pages(0)
        assert ids.device == meta_dev and p == 3 * BS
        assert meta.float_mask(0, -1, torch.float32).device == meta_dev
        assert meta.float_mask(0, 8, torch.float32).device == meta_dev
        if sizes == "mixed":
            assert all(t.device == meta_dev for t in meta.rows_slots)
        inner = SimpleNamespace(scale=0.2, logits_soft_cap=0.0, sliding_window=-1)
        impl = TreeAttentionImpl(inner, "layer", 0, lay, owner=None)
        q = torch.empty(total, 4, HD, device=meta_dev)
        kv = torch.empty(total, KVH, HD, device=meta_dev)
        out = impl._tree(meta, q, kv, kv, cache, torch.empty(total, 4, HD, device=meta_dev))
        assert out.device == meta_dev


def test_worker_inputs_follow_the_runner_device():
    """The tree's input ids and positions are made on the runner's device."""
    from types import SimpleNamespace

    from vllm_lookahead.attn_mask import build_tree
    from vllm_lookahead.worker import LookaheadWorker, TreeRequest

    table = SimpleNamespace(block_size=BS, block_table=SimpleNamespace(
        cpu=torch.arange(40, dtype=torch.int32).view(4, 10)))
    w = LookaheadWorker.__new__(LookaheadWorker)
    w.runner = SimpleNamespace(input_batch=SimpleNamespace(block_table=[table]))
    w.num_groups, w.device = 1, torch.device("meta")
    tree = build_tree(3, 2, 1)
    reqs = [TreeRequest(tokens=np.arange(tree.num_nodes, dtype=np.int32),
                        positions=(33 + tree.depth).astype(np.int64), mask=tree.mask,
                        context_len=33, batch_index=2)]
    ids, pos, meta = w._metadata(reqs, offset=4)
    assert ids.device == pos.device == torch.device("meta")
    assert meta.blocks[0][1][0].tolist() == [20, 21, 22]  # row 2's first 3 blocks
    assert meta.pages(0)[0].device == torch.device("meta")
