"""Tree attention over vLLM's paged KV cache (vllm_lookahead.branch.kv_layout,
vllm_lookahead.branch.tree_attention).

(a) ``probe_page_layout`` + ``gather_pages`` read back exactly what vLLM's
    own CPU cache writer stored (and what deliberately odd fake writers
    stored). The GPU backends' layouts are in tests/test_kv_layouts.py.
(b) the reference ``tree_attention`` (benchmarks/gpu_tree_check.py) over a
    paged cache equals a dense reference that
    explicitly recomputes, for every tree node, the causal sequence
    prefix + (the node's ancestor chain, root first, ending at the node).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from vllm_lookahead.attn_mask import build_tree
from vllm_lookahead.branch.kv_layout import UnsupportedLayout, probe_page_layout

# shared with the check of the GPU layouts (benchmarks/gpu_tree_check.py,
# on the path through conftest.py)
from gpu_tree_check import gather_sequence as _gather_sequence  # noqa: E402
from gpu_tree_check import slots as _slots  # noqa: E402
from gpu_tree_check import tree_attention  # noqa: E402
from gpu_tree_check import tree_meta  # noqa: E402,F401  (tests/test_kv_layouts.py)

ops = pytest.importorskip("vllm._custom_ops")


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """Many tiny matmuls: with several OpenMP threads on a loaded 2-core
    machine they are ~100x slower than on one thread."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def split_cache(cache):
    """K and V views of a contiguous ``[nb, kvh, bs, 2*hd]`` cache as vLLM's
    CPU backend makes them (each ``[nb, kvh, bs, hd]``)."""
    nb, kvh, bs, _ = cache.shape
    return cache.view(nb, kvh, 2 * bs, -1).chunk(2, dim=2)


def probe_block_layout(bs, kvh, hd, dtype, write_fn):
    """The layout of a ``[*, kvh, bs, 2*hd]`` contiguous cache of ``dtype``."""
    return probe_page_layout(torch.empty(1, kvh, bs, 2 * hd, dtype=dtype), hd, write_fn)


def gather_kv(cache, block_ids, length, layout):
    return _gather_sequence(cache, torch.as_tensor(block_ids), length, layout)


def _vllm_writer(isa: str):
    def write_fn(k, v, cache, slots):
        ops.cpu_attn_reshape_and_cache(
            k, v, *split_cache(cache), slots, isa, k_scale=1.0, v_scale=1.0,
            kv_cache_dtype="auto",
        )

    return write_fn


def _amx_ok() -> bool:
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except Exception:
        return False


WRITERS = [
    pytest.param(torch.float32, "vec", id="fp32-vec"),
    pytest.param(torch.bfloat16, "vec", id="bf16-vec"),
    pytest.param(
        torch.bfloat16,
        "amx",
        id="bf16-amx",
        marks=pytest.mark.skipif(not _amx_ok(), reason="no AMX tiles on this CPU"),
    ),
]


# --------------------------------------------------------------------------
# (a) layout probe + gather round trip
# --------------------------------------------------------------------------

# sequences: (length, block ids) with non-contiguous, out-of-order blocks and
# partial last blocks
SEQS = [(300, [5, 1, 6]), (128, [3]), (129, [0, 7]), (1, [2]), (257, [9, 4, 8])]


@pytest.mark.parametrize("dtype,isa", WRITERS)
def test_gather_roundtrip_vllm_cpu_writer(dtype, isa):
    bs, kvh, hd, nb = 128, 2, 64, 10
    write_fn = _vllm_writer(isa)
    layout = probe_block_layout(bs, kvh, hd, dtype, write_fn)
    assert layout.k_off.shape == (bs * hd,) and layout.v_off.shape == (bs * hd,)
    if isa == "vec":
        # K's half transposed ([hd, bs]), then V's: read with strided views
        assert layout.name == "strided"
        assert layout.k_affine == (0, 1, bs) and layout.v_affine == (bs * hd, hd, 1)
    else:
        # AMX: K in 16-token tiles of dim pairs, V in 16-dim tiles of token
        # pairs; read with strided views of the tile digits, not per index
        assert layout.name == "tiled"
        assert layout.k_view[1] == (bs // 16, 16, hd // 2, 2)
        assert layout.v_view[1] == (bs // 2, 2, hd // 16, 16)
    g = torch.Generator().manual_seed(0)
    # garbage everywhere first, so a wrong block or offset cannot read zeros
    cache = torch.randn(nb, kvh, bs, 2 * hd, generator=g).to(dtype)
    written = []
    for length, blocks in SEQS:
        k = torch.randn(length, kvh, hd, generator=g).to(dtype)
        v = torch.randn(length, kvh, hd, generator=g).to(dtype)
        write_fn(k, v, cache, _slots(blocks, length, bs))
        written.append((k, v))
    for (length, blocks), (k, v) in zip(SEQS, written):
        # block table may be longer than needed (vLLM pads it)
        table = torch.tensor(blocks + [0, 0], dtype=torch.int32)
        gk, gv = gather_kv(cache, table, length, layout)
        assert gk.shape == (kvh, length, hd) and gv.shape == (kvh, length, hd)
        assert gk.dtype == dtype
        assert torch.equal(gk, k.transpose(0, 1)), (length, blocks)
        assert torch.equal(gv, v.transpose(0, 1)), (length, blocks)
        # a prefix of the sequence reads back as the prefix
        gk2, gv2 = gather_kv(cache, table, length // 2 + 1, layout)
        assert torch.equal(gk2, k.transpose(0, 1)[:, : length // 2 + 1])
        assert torch.equal(gv2, v.transpose(0, 1)[:, : length // 2 + 1])
    # returned tensors are copies: editing them leaves the cache alone
    before = cache.clone()
    gk, gv = gather_kv(cache, torch.tensor([5, 1, 6]), 300, layout)
    gk.fill_(0)
    gv.fill_(0)
    assert torch.equal(cache, before)


def test_gather_empty():
    cache = torch.randn(2, 2, 16, 2 * 8)
    layout = probe_block_layout(16, 2, 8, torch.float32, _fake_weird_writer)
    k, v = gather_kv(cache, torch.tensor([1]), 0, layout)
    assert k.shape == (2, 0, 8) and v.shape == (2, 0, 8)


# -- fake backends with other layouts ---------------------------------------


def _offset_writer(k_at, v_at):
    """A fake backend's cache writer: ``K[t, d]`` of head ``h`` in a block
    at ``k_at(t, d, h, bs, hd)`` of its cell's K half, ``V[t, d]`` at
    ``v_at(...)`` of its V half."""
    def write(k, v, cache, slots):
        nb, kvh, bs, two_hd = cache.shape
        hd = two_hd // 2
        region = cache.view(nb, kvh, 2, bs * hd)
        for i, s in enumerate(slots.tolist()):
            b, t = divmod(s, bs)
            for h in range(kvh):
                for d in range(hd):
                    region[b, h, 0, k_at(t, d, h, bs, hd)] = k[i, h, d]
                    region[b, h, 1, v_at(t, d, h, bs, hd)] = v[i, h, d]
    return write


# K stored transposed ([hd, bs] per block/head), V in reversed order
_fake_weird_writer = _offset_writer(lambda t, d, h, bs, hd: d * bs + t,
                                    lambda t, d, h, bs, hd: bs * hd - 1 - (t * hd + d))


def _fake_head_mixing_writer(k, v, cache, slots):
    """Stores head h's data in head h+1 (mod kvh): unsupported."""
    nb, kvh, bs, _ = cache.shape
    kc, vc = split_cache(cache)
    for i, s in enumerate(slots.tolist()):
        b, t = divmod(s, bs)
        kc[b, :, t] = k[i].roll(1, dims=0)
        vc[b, :, t] = v[i].roll(1, dims=0)


# head 0 plain, head 1 with K transposed: the layout differs per head
_fake_per_head_layout_writer = _offset_writer(
    lambda t, d, h, bs, hd: d * bs + t if h == 1 else t * hd + d,
    lambda t, d, h, bs, hd: t * hd + d)


def _fake_lossy_writer(k, v, cache, slots):
    """Tokens 2i and 2i+1 land in the same place: not a permutation."""
    nb, kvh, bs, _ = cache.shape
    kc, vc = split_cache(cache)
    for i, s in enumerate(slots.tolist()):
        b, t = divmod(s, bs)
        kc[b, :, t - t % 2] = k[i]
        vc[b, :, t - t % 2] = v[i]


def _written(writer, shape, dtype, length, blocks, seed):
    """A random ``[nb, kvh, bs, 2 hd]`` cache (garbage everywhere) with
    random K and V of ``length`` tokens written into ``blocks`` by
    ``writer``: ``(cache, k, v)``."""
    nb, kvh, bs, hd = shape
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(nb, kvh, bs, 2 * hd, generator=g).to(dtype)
    k = torch.randn(length, kvh, hd, generator=g).to(dtype)
    v = torch.randn(length, kvh, hd, generator=g).to(dtype)
    writer(k, v, cache, _slots(blocks, length, bs))
    return cache, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_is_general_weird_layout(dtype):
    bs, kvh, hd, nb = 16, 2, 8, 5
    layout = probe_block_layout(bs, kvh, hd, dtype, _fake_weird_writer)
    ident = torch.arange(bs * hd)
    assert not torch.equal(layout.k_off, ident)
    assert layout.name == "indexed" and layout.v_affine is None
    # K[t, d] at d * bs + t (affine, transposed); V[t, d] at the mirrored offset
    t, d = 3, 5
    assert layout.k_off[t * hd + d] == d * bs + t
    assert layout.k_affine == (0, 1, bs)
    assert layout.v_off[t * hd + d] == 2 * bs * hd - 1 - (t * hd + d)
    length, blocks = 40, [4, 0, 2]
    cache, k, v = _written(_fake_weird_writer, (nb, kvh, bs, hd), dtype, length, blocks, seed=1)
    gk, gv = gather_kv(cache, torch.tensor(blocks), length, layout)
    assert torch.equal(gk, k.transpose(0, 1))
    assert torch.equal(gv, v.transpose(0, 1))
    # the plain layout would NOT read it back (the probe matters)
    plain = probe_block_layout(bs, kvh, hd, dtype, _fake_plain_writer)
    pk, _ = gather_kv(cache, torch.tensor(blocks), length, plain)
    assert not torch.equal(pk, k.transpose(0, 1))


# K in 4-token tiles of dim pairs, V in 4-dim tiles of token pairs (the
# shape of vLLM's AMX packing, on any CPU)
_fake_tiled_writer = _offset_writer(
    lambda t, d, h, bs, hd: (t // 4) * 4 * hd + (d // 2) * 8 + (t % 4) * 2 + d % 2,
    lambda t, d, h, bs, hd: (d // 4) * 4 * bs + (t // 2) * 8 + (d % 4) * 2 + t % 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_layout_read_with_views(dtype):
    """A layout affine in tile digits is found and read with strided views,
    equal to reading it index by index."""
    import dataclasses

    bs, kvh, hd, nb = 16, 2, 8, 5
    layout = probe_block_layout(bs, kvh, hd, dtype, _fake_tiled_writer)
    assert layout.name == "tiled"
    assert layout.k_affine is None and layout.v_affine is None
    assert layout.k_view == (0, (4, 4, 4, 2), (4 * hd, 2, 8, 1))
    assert layout.v_view == (bs * hd, (8, 2, 2, 4), (8, 1, 4 * bs, 2))
    indexed = dataclasses.replace(layout, k_view=None, v_view=None)
    assert indexed.name == "indexed"
    length, blocks = 37, [3, 0, 4]
    cache, k, v = _written(_fake_tiled_writer, (nb, kvh, bs, hd), dtype, length, blocks, seed=2)
    for lay in (layout, indexed):
        gk, gv = gather_kv(cache, torch.tensor(blocks), length, lay)
        assert torch.equal(gk, k.transpose(0, 1))
        assert torch.equal(gv, v.transpose(0, 1))
    # a plain layout is the tiling of one, and affine in (t, d)
    plain = probe_block_layout(bs, kvh, hd, dtype, _fake_plain_writer)
    assert plain.k_view == (0, (bs, 1, hd, 1), (hd, 0, 1, 0))
    assert plain.v_view == (bs * hd, (bs, 1, hd, 1), (hd, 0, 1, 0))
    assert plain.k_affine == (0, hd, 1) and plain.v_affine == (bs * hd, hd, 1)


def _fake_plain_writer(k, v, cache, slots):
    nb, kvh, bs, _ = cache.shape
    kc, vc = split_cache(cache)
    for i, s in enumerate(slots.tolist()):
        b, t = divmod(s, bs)
        kc[b, :, t] = k[i]
        vc[b, :, t] = v[i]


@pytest.mark.parametrize(
    "writer", [_fake_head_mixing_writer, _fake_per_head_layout_writer, _fake_lossy_writer]
)
def test_probe_rejects_unsupported_layouts(writer):
    with pytest.raises(UnsupportedLayout):
        probe_block_layout(8, 2, 4, torch.float32, writer)


# --------------------------------------------------------------------------
# (b) tree attention == explicit per-node recomputation
# --------------------------------------------------------------------------

H, KVH, D, DM, VOCAB, MAXPOS, BS = 4, 2, 32, 48, 97, 512, 128


class ToyAttention:
    """One attention layer: token + learned position embedding, then Wq/Wk/Wv
    (GQA: H query heads over KVH key/value heads), float32."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.randn(VOCAB, DM, generator=g)
        self.pos = torch.randn(MAXPOS, DM, generator=g)
        self.wq = torch.randn(DM, H * D, generator=g) / math.sqrt(DM)
        self.wk = torch.randn(DM, KVH * D, generator=g) / math.sqrt(DM)
        self.wv = torch.randn(DM, KVH * D, generator=g) / math.sqrt(DM)

    def qkv(self, tokens, positions):
        x = self.emb[torch.as_tensor(tokens).long()] + self.pos[torch.as_tensor(positions).long()]
        n = x.shape[0]
        return (
            (x @ self.wq).view(n, H, D),
            (x @ self.wk).view(n, KVH, D),
            (x @ self.wv).view(n, KVH, D),
        )


def _reference_last_row(model, tokens, scale, sliding_window=-1, softcap=0.0):
    """Plain causal attention over an explicit sequence at positions 0..n-1;
    output of the last query row, [H, D]. Written without tree_attention."""
    n = len(tokens)
    q, k, v = model.qkv(tokens, list(range(n)))
    qi = q[-1]  # [H, D]
    out = torch.empty(H, D)
    group = H // KVH
    for h in range(H):
        kh, vh = k[:, h // group], v[:, h // group]  # [n, D]
        s = (kh @ qi[h]) * scale  # [n]
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        if sliding_window > 0:
            s = s[-sliding_window:]
            vh = vh[-sliding_window:]
        out[h] = torch.softmax(s, dim=0) @ vh
    return out


def _chain(parents, i):
    chain = [i]
    while parents[chain[-1]] >= 0:
        chain.append(int(parents[chain[-1]]))
    return chain[::-1]  # root first, ending at i


def _fp32_paged_cache(model, prefix, seed):
    """Write the prefix's K/V through vLLM's fp32 CPU writer into scattered
    blocks; return (cache, block table, layout)."""
    length = len(prefix)
    write_fn = _vllm_writer("vec")
    layout = probe_block_layout(BS, KVH, D, torch.float32, write_fn)
    nblk = -(-length // BS)
    rng = np.random.default_rng(seed)
    total_blocks = nblk + 5
    blocks = rng.permutation(total_blocks)[:nblk].tolist()
    cache = torch.randn(total_blocks, KVH, BS, 2 * D, generator=torch.Generator().manual_seed(seed))
    if length:
        _, k, v = model.qkv(prefix, list(range(length)))
        write_fn(k.contiguous(), v.contiguous(), cache, _slots(blocks, length, BS))
    return cache, torch.tensor(blocks + [0], dtype=torch.int32), layout


def _run_tree(n, w, g, length, seed, scale=None, sliding_window=-1, softcap=0.0):
    model = ToyAttention(seed)
    rng = np.random.default_rng(seed + 1)
    prefix = rng.integers(0, VOCAB, size=length).tolist()
    cache, table, layout = _fp32_paged_cache(model, prefix, seed)
    ctx_k, ctx_v = gather_kv(cache, table, length, layout)

    tree = build_tree(n, w, g)
    t = tree.num_nodes
    tree_tokens = rng.integers(0, VOCAB, size=t).tolist()
    positions = torch.as_tensor(length + tree.depth.astype(np.int64))
    q, k, v = model.qkv(tree_tokens, positions)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    out = tree_attention(
        q, k, v, ctx_k, ctx_v, torch.tensor(tree.mask), positions, scale,
        sliding_window=sliding_window, softcap=softcap,
    )
    assert out.shape == (t, H, D) and out.dtype == torch.float32

    refs = torch.empty(t, H, D)
    for i in range(t):
        seq = prefix + [tree_tokens[j] for j in _chain(tree.parents, i)]
        # the chain sits at positions L, L+1, ..., L+depth(i): contiguous
        assert len(seq) == length + int(tree.depth[i]) + 1
        refs[i] = _reference_last_row(model, seq, scale, sliding_window, softcap)
    return out, refs


TREE_SIZES = [(2, 1, 0), (2, 3, 2), (3, 4, 0), (4, 5, 3), (5, 7, 4), (3, 1, 3), (4, 0, 3)]


@pytest.mark.parametrize("n,w,g", TREE_SIZES)
@pytest.mark.parametrize("length", [150, 300])
def test_tree_attention_equals_dense_recomputation(n, w, g, length):
    out, refs = _run_tree(n, w, g, length, seed=n * 31 + w * 7 + g + length)
    torch.testing.assert_close(out, refs, atol=1e-5, rtol=1e-5)


def test_tree_attention_large_tree():
    out, refs = _run_tree(5, 15, 15, 150, seed=3)
    torch.testing.assert_close(out, refs, atol=1e-5, rtol=1e-5)


def test_tree_attention_empty_prefix():
    out, refs = _run_tree(4, 3, 2, 0, seed=4)
    torch.testing.assert_close(out, refs, atol=1e-5, rtol=1e-5)


def test_tree_attention_detects_wrong_mask():
    """Sanity check of the reference: a node attending to a sibling branch
    gives a different answer, so the comparison above has teeth."""
    n, w, g, length = 4, 3, 2, 150
    model = ToyAttention(0)
    rng = np.random.default_rng(1)
    prefix = rng.integers(0, VOCAB, size=length).tolist()
    cache, table, layout = _fp32_paged_cache(model, prefix, 0)
    ctx_k, ctx_v = gather_kv(cache, table, length, layout)
    tree = build_tree(n, w, g)
    toks = rng.integers(0, VOCAB, size=tree.num_nodes).tolist()
    pos = torch.as_tensor(length + tree.depth.astype(np.int64))
    q, k, v = model.qkv(toks, pos)
    good = tree_attention(q, k, v, ctx_k, ctx_v, torch.tensor(tree.mask), pos, D**-0.5)
    causal = torch.ones(tree.num_nodes, tree.num_nodes, dtype=torch.bool).tril()
    bad = tree_attention(q, k, v, ctx_k, ctx_v, causal, pos, D**-0.5)
    assert torch.equal(good[0], bad[0])  # the root sees only itself either way
    assert (good - bad).abs().amax() > 1e-3


@pytest.mark.parametrize("window", [1, 5, 60, 151, 1000])
@pytest.mark.parametrize("n,w,g", [(4, 5, 3), (2, 3, 1), (3, 2, 0)])
def test_tree_attention_sliding_window(window, n, w, g):
    out, refs = _run_tree(n, w, g, 150, seed=window + n, sliding_window=window)
    torch.testing.assert_close(out, refs, atol=1e-5, rtol=1e-5)
    if window < 150:
        full, _ = _run_tree(n, w, g, 150, seed=window + n)
        assert (full - out).abs().amax() > 1e-4  # the window really applies


@pytest.mark.parametrize("softcap", [0.5, 3.0, 30.0])
def test_tree_attention_softcap(softcap):
    # a large scale makes raw scores big enough for the cap to matter
    out, refs = _run_tree(4, 5, 3, 150, seed=11, scale=1.0, softcap=softcap)
    torch.testing.assert_close(out, refs, atol=1e-5, rtol=1e-5)
    plain, _ = _run_tree(4, 5, 3, 150, seed=11, scale=1.0)
    assert (plain - out).abs().amax() > 1e-4


def test_tree_attention_softcap_and_window_together():
    out, refs = _run_tree(5, 4, 2, 300, seed=12, scale=0.5, sliding_window=40, softcap=2.0)
    torch.testing.assert_close(out, refs, atol=1e-5, rtol=1e-5)


def test_tree_attention_keeps_query_dtype():
    model = ToyAttention(0)
    tree = build_tree(3, 2, 1)
    pos = torch.as_tensor(10 + tree.depth.astype(np.int64))
    q, k, v = model.qkv(list(range(tree.num_nodes)), pos)
    _, ck, cv = model.qkv(list(range(10)), list(range(10)))
    ck, cv = ck.transpose(0, 1), cv.transpose(0, 1)
    m = torch.tensor(tree.mask)
    ref = tree_attention(q, k, v, ck, cv, m, pos, D**-0.5)
    out = tree_attention(
        q.bfloat16(), k.bfloat16(), v.bfloat16(), ck.bfloat16(), cv.bfloat16(), m, pos, D**-0.5
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=5e-2, rtol=5e-2)


# --------------------------------------------------------------------------
# (c) the worker's batched path (all requests in one padded attention call,
#     whole blocks gathered) equals the per-request reference
# --------------------------------------------------------------------------


class _CpuWriter:
    head_size = 64

    def __call__(self, k, v, cache, slots):
        _vllm_writer("vec")(k, v, cache, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("sizes", ["mixed", "uniform"])
@pytest.mark.parametrize("window", [-1, 40])
def test_batched_tree_attention_equals_reference(window, sizes, softcap, dtype):
    from types import SimpleNamespace

    from vllm_lookahead.worker import TreeAttentionImpl

    torch.manual_seed(0)
    kvh, h, hd, bs = 2, 6, 64, 16
    cache = torch.randn(12, kvh, bs, 2 * hd).to(dtype)  # garbage outside what is written
    writer = _CpuWriter()
    layout = probe_block_layout(bs, kvh, hd, dtype, writer)
    reqs = [(37, [3, 0, 9], (4, 3, 2)), (5, [7], (3, 2, 0)), (60, [1, 4, 8, 11], (2, 4, 3))]
    if sizes == "uniform":  # same tree everywhere: the unpadded path
        reqs = [(length, blk, (4, 3, 2)) for length, blk, _ in reqs]
    offset = 5  # fused: tree rows follow vLLM's own rows
    meta, total, prefixes = tree_meta(reqs, offset, writer, cache, bs)
    assert meta.uniform == (sizes == "uniform")
    query = torch.randn(total, h, hd).to(dtype)
    key = torch.randn(total, kvh, hd).to(dtype)
    value = torch.randn(total, kvh, hd).to(dtype)
    inner = SimpleNamespace(scale=0.3, logits_soft_cap=softcap, sliding_window=window)
    impl = TreeAttentionImpl(inner, "layer", 0, layout, owner=None)
    out = torch.full((total, h, hd), 7.0, dtype=dtype)
    impl._tree(meta, query, key, value, cache, out)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for r, (s, e) in enumerate(zip(meta.starts, meta.ends)):
        ck, cv = prefixes[r]
        ref = tree_attention(query[s:e].float(), key[s:e].float(), value[s:e].float(),
                             ck.transpose(0, 1), cv.transpose(0, 1),
                             torch.from_numpy(meta.masks[r]),
                             torch.from_numpy(meta.positions[s - offset:e - offset]), 0.3,
                             sliding_window=window, softcap=softcap)
        torch.testing.assert_close(out[s:e].float(), ref, rtol=tol, atol=tol)
    # vLLM's own rows are left alone
    assert torch.all(out[:offset] == 7.0)


def test_read_only_tree_masks_build_the_step_mask_without_a_warning():
    """The trees' masks are read-only (``build_tree``'s cached layouts): the
    step's mask is built from them with no warning (``torch.from_numpy`` of a
    read-only array warns), prefix then tree from slot ``P``."""
    import warnings

    from vllm_lookahead.branch.tree_attention import TreeAttnMetadata

    tree = build_tree(3, 2, 1)
    assert not tree.mask.flags.writeable
    t = tree.num_nodes
    meta = TreeAttnMetadata(starts=[2], ends=[2 + t], context_lens=[20], masks=[tree.mask],
                            positions=(20 + tree.depth).astype(np.int64),
                            blocks=[(16, [np.array([3, 1])])], device=torch.device("cpu"),
                            offset=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mask = meta.float_mask(0, -1, torch.float32)
        windowed = meta.float_mask(0, 4, torch.float32)
    seen = torch.isfinite(mask[0, 0])
    assert mask.shape == (1, 1, t, 32 + t)
    assert seen[:, :20].all() and not seen[:, 20:32].any()
    assert torch.equal(seen[:, 32:], torch.from_numpy(tree.mask.copy()))
    # window 4: a node at position q sees keys at q - 3 .. q
    q = 20 + tree.depth[:, None]
    assert torch.equal(torch.isfinite(windowed[0, 0, :, :20]),
                       torch.from_numpy((np.arange(20)[None, :] > q - 4)))
