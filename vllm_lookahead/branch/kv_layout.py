"""Where one token's K and V live in a layer's paged KV cache, for any of
vLLM 0.32's attention backends, and a fast gather of a request's pages.

vLLM 0.32 gives every attention layer a *logical* per-layer view
``[num_blocks, kv_heads, block_size, C]`` of one shared buffer (RFC 42082,
``vllm/v1/kv_cache_interface.py: create_kv_cache_views``), with physical
strides from the resolved ``KVCacheLayout`` (LBHNC on the CPU, LBNHC by
default on CUDA, block-outermost layouts for some connectors): on a GPU the
per-layer view is generally *not* contiguous. Within a ``(block, head)``
cell, ``[block_size, C]``, backends pack K and V differently:

* FlashAttention, FlashInfer, Triton: ``C = [K (D) | V (D)]`` per token
  (``kv_cache.transpose(1, 2).split(D, -1)``);
* vLLM's CPU backend: the cell as ``[2 * block_size, D]``, K's half
  first (its "vec" kernels keep it transposed, ``[D, block_size]``), then
  V's; its ISA-specific kernels permute further (the AMX kernels, bfloat16
  on a CPU with AMX tiles: K in 16-token tiles of dim pairs, V in 16-dim
  tiles of token pairs).

We never hard-code either: :func:`probe_page_layout` writes coded values
with the backend's *own* cache writer (``impl.do_kv_cache_update``) into a
scratch page laid out like the real cache, on the cache's device, and reads
back where each ``K[t, d]`` / ``V[t, d]`` landed. A layout whose offsets are
affine in ``(t, d)`` (the first two packings), or in the digits of ``t``
and ``d`` split once each into tiles (``t = t1 * a + t0``, ``d = d1 * b +
d0``: the AMX packing), is then read with strided views; any other
permutation with one index per element (on the AMX packing, bfloat16
SmolLM2, two 128-token blocks: 1.5 ms a layer that way, 0.16 ms strided).

Pure torch, no vLLM import; every tensor made here lives on the cache's
device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

#: write_fn(key, value, kv_cache, slot_mapping): the backend's op storing
#: key/value ``[tokens, kv_heads, head_size]`` into a logical
#: ``[num_blocks, kv_heads, block_size, C]`` cache at flat slots
#: ``block * block_size + offset``.
WriteFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


class UnsupportedLayout(RuntimeError):
    """The backend's cache cannot be read by the lookahead branch."""


@dataclass(frozen=True)
class PageLayout:
    """How K and V sit in one ``(block, head)`` cell of the logical cache.

    The cell, ``[block_size, C]`` viewed flat (``block_size * C`` elements,
    logical order), holds ``K[t, d]`` at ``k_off[t * D + d]`` and ``V[t, d]``
    at ``v_off[t * D + d]``. ``k_view`` / ``v_view`` are ``(start, sizes,
    strides)`` when the offsets are affine in the tile digits ``(t1, t0,
    d1, d0)`` of ``t = t1 * a + t0``, ``d = d1 * b + d0`` (``sizes =
    (N / a, a, D / b, b)``, the least tiling found first), else None;
    ``k_affine`` / ``v_affine`` (derived) are ``(start, t_stride,
    d_stride)`` when that tiling is ``a = b = 1``, offsets affine in ``(t,
    d)``, else None.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    content: int  # C, elements per (head, token) cell row
    k_off: torch.Tensor  # int64 [block_size * head_size], on the cache's device
    v_off: torch.Tensor
    k_view: tuple[int, tuple[int, ...], tuple[int, ...]] | None
    v_view: tuple[int, tuple[int, ...], tuple[int, ...]] | None

    @property
    def k_affine(self) -> tuple[int, int, int] | None:
        return _untiled(self.k_view)

    @property
    def v_affine(self) -> tuple[int, int, int] | None:
        return _untiled(self.v_view)

    @property
    def name(self) -> str:
        """``split`` (K and V side by side in C: the GPU backends),
        ``strided`` (other affine offsets, read with strided views: vLLM's
        CPU backend keeps a block's K transposed, then its V), ``tiled``
        (offsets affine in tile digits, read with strided views: vLLM's
        CPU backend with AMX), ``indexed`` (any other permutation: one
        index per element)."""
        d = self.head_size
        if self.k_affine == (0, self.content, 1) and self.v_affine == (d, self.content, 1):
            return "split"
        if self.k_affine is not None and self.v_affine is not None:
            return "strided"
        if self.k_view is not None and self.v_view is not None:
            return "tiled"
        return "indexed"


def _untiled(view) -> tuple[int, int, int] | None:
    """``(start, t_stride, d_stride)`` of a view whose tiling is ``a = b =
    1`` (offsets affine in ``(t, d)``), else None."""
    if view is None:
        return None
    start, sizes, strides = view
    return (start, strides[0], strides[2]) if sizes[1] == sizes[3] == 1 else None


def _divisors(n: int) -> list[int]:
    return [x for x in range(1, n + 1) if n % x == 0]


def _tiled(off: torch.Tensor, bs: int, hd: int
           ) -> tuple[int, tuple[int, ...], tuple[int, ...]] | None:
    """``(start, sizes, strides)`` of the first tiling ``t = t1 * a + t0``,
    ``d = d1 * b + d0`` (``a`` | ``bs``, ``b`` | ``hd``, untiled first) in
    whose digits the offsets are affine with strides >= 0; None if none."""
    o = off.view(bs, hd).cpu()
    start = int(o[0, 0])
    t = torch.arange(bs).view(bs, 1)
    d = torch.arange(hd).view(1, hd)
    for a in _divisors(bs):
        for b in _divisors(hd):
            sizes = (bs // a, a, hd // b, b)
            strides = (int(o[a, 0]) - start if bs // a > 1 else 0,
                       int(o[1, 0]) - start if a > 1 else 0,
                       int(o[0, b]) - start if hd // b > 1 else 0,
                       int(o[0, 1]) - start if b > 1 else 0)
            if min(strides) < 0:  # as_strided takes no negative strides
                continue
            expect = (start + (t // a) * strides[0] + (t % a) * strides[1]
                      + (d // b) * strides[2] + (d % b) * strides[3])
            if torch.equal(o, expect):
                return start, sizes, strides
    return None


def scratch_like(cache: torch.Tensor, num_blocks: int = 1) -> torch.Tensor:
    """A zeroed ``[num_blocks, H, N, C]`` tensor with ``cache``'s dtype,
    device and physical dimension order (so a backend's writer that relies
    on its layout's strides meets the same order)."""
    shape = (num_blocks, *cache.shape[1:])
    strides = cache.stride()
    # physical order: largest stride first (ties: logical order)
    order = sorted(range(cache.dim()), key=lambda i: (-strides[i], i))
    phys = torch.zeros([shape[i] for i in order], dtype=cache.dtype, device=cache.device)
    inverse = [order.index(i) for i in range(cache.dim())]
    return phys.permute(*inverse)


def probe_page_layout(cache: torch.Tensor, head_size: int, write_fn: WriteFn) -> PageLayout:
    """Learn where ``write_fn`` (the backend's own cache writer) puts K and V.

    ``cache`` is the layer's real logical ``[num_blocks, H, N, C]`` cache
    (read for shape, dtype, device and stride order only; never written).
    Values written are small integers, exact in float32, bfloat16 and
    float16: probes code the token and the dim (two base-64 digits each)
    and the head; one writes K as +1 and V as -1 to tell them apart.

    Raises :class:`UnsupportedLayout` for a cache that is not 4-D, mixes
    heads or tokens, differs between heads, or loses a value.
    """
    if cache.dim() != 4:
        raise UnsupportedLayout(f"KV cache view of shape {tuple(cache.shape)} is not 4-D")
    _, kvh, bs, c = cache.shape
    hd = head_size
    if c < 2 * hd:
        raise UnsupportedLayout(f"KV cache cell of {c} elements cannot hold K and V of {hd}")
    dev = cache.device
    t_idx = torch.arange(bs, device=dev).view(bs, 1, 1).expand(bs, kvh, hd)
    d_idx = torch.arange(hd, device=dev).view(1, 1, hd).expand(bs, kvh, hd)
    h_idx = torch.arange(kvh, device=dev).view(1, kvh, 1).expand(bs, kvh, hd)
    slots = torch.arange(bs, dtype=torch.int64, device=dev)

    def write(code: torch.Tensor) -> torch.Tensor:
        """``code + 1`` where K or V of a token landed, 0 elsewhere: [kvh, N*C]."""
        page = scratch_like(cache)
        vals = (code + 1).to(cache.dtype).contiguous()
        write_fn(vals, (-vals).contiguous(), page, slots)
        return page[0].reshape(kvh, bs * c).float().cpu().abs()  # [kvh, bs*C], logical

    def sign() -> torch.Tensor:
        page = scratch_like(cache)
        ones = torch.ones(bs, kvh, hd, dtype=cache.dtype, device=dev)
        write_fn(ones, -ones, page, slots)
        return page[0].reshape(kvh, bs * c).float().cpu()

    # token and dim in two base-64 digits each: exact in bfloat16 whatever N and D
    tc = write(t_idx % 64) - 1 + 64 * (write(t_idx // 64) - 1)
    dc = write(d_idx % 64) - 1 + 64 * (write(d_idx // 64) - 1)
    hc = write(h_idx)
    sg = sign()
    is_k, is_v = sg > 0, sg < 0
    heads = torch.arange(1, kvh + 1, dtype=torch.float32).view(kvh, 1)
    if not torch.equal(hc[is_k | is_v], heads.expand_as(hc)[is_k | is_v]):
        raise UnsupportedLayout("KV cache layout mixes heads within a block")

    def offsets(sel: torch.Tensor, h: int) -> torch.Tensor:
        where = sel[h].nonzero().view(-1)
        t = tc[h, where].long()
        d = dc[h, where].long()
        off = torch.full((bs * hd,), -1, dtype=torch.int64)
        if where.numel() != bs * hd or not (((t >= 0) & (t < bs) & (d >= 0) & (d < hd)).all()):
            raise UnsupportedLayout("KV cache layout probe is not a permutation")
        off[t * hd + d] = where
        if (off < 0).any():
            raise UnsupportedLayout("KV cache layout probe is not a permutation")
        return off

    k_off, v_off = offsets(is_k, 0), offsets(is_v, 0)
    for h in range(1, kvh):
        if not (torch.equal(offsets(is_k, h), k_off) and torch.equal(offsets(is_v, h), v_off)):
            raise UnsupportedLayout("KV cache layout differs between heads")
    return PageLayout(
        block_size=bs, num_kv_heads=kvh, head_size=hd, content=c,
        k_off=k_off.to(dev), v_off=v_off.to(dev),
        k_view=_tiled(k_off, bs, hd), v_view=_tiled(v_off, bs, hd),
    )


def gather_pages(
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    layout: PageLayout,
    out_k: torch.Tensor,
    out_v: torch.Tensor,
) -> None:
    """Copy the K and V of whole blocks, request by request.

    Args:
        kv_cache: the layer's logical ``[num_blocks, H, N, C]`` cache (any
            strides).
        block_ids: int64 ``[R, nb]`` on the cache's device (pad a short
            request with any valid block id; mask what lies past its length).
        out_k, out_v: ``[R, H, nb * N, D]`` views to fill (token ``j`` of a
            request is its block ``j // N``, offset ``j % N``).
    """
    r_n, nb = block_ids.shape
    bs, hd, c, kvh = layout.block_size, layout.head_size, layout.content, layout.num_kv_heads
    pages = _block_pages(kv_cache, block_ids.view(-1))  # [R*nb, H, N, C], any strides
    for off, view, out in ((layout.k_off, layout.k_view, out_k),
                           (layout.v_off, layout.v_view, out_v)):
        strided = None if view is None else _cell_view(pages, view, c)
        if strided is not None:
            start, sizes, strides = strided
            p0 = pages.stride(0)
            src = pages.as_strided((r_n, nb, kvh, *sizes),
                                   (nb * p0, p0, pages.stride(1), *strides),
                                   pages.storage_offset() + start)
            out.view(r_n, kvh, nb, *sizes).copy_(src.permute(0, 2, 1, 3, 4, 5, 6))
        else:
            flat = pages.reshape(r_n * nb, kvh, bs * c)
            src = flat.index_select(2, off).view(r_n, nb, kvh, bs, hd)
            out.view(r_n, kvh, nb, bs, hd).copy_(src.permute(0, 2, 1, 3, 4))


def gather_token_major(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                       layout: PageLayout) -> tuple[torch.Tensor, torch.Tensor] | None:
    """K and V of whole blocks as views of one copy, each ``[R, H, nb * N,
    D]`` (token ``j`` of a request: its block ``j // N``, offset ``j %
    N``), where the cache's blocks, copied in their physical order, hold
    every token of a request at one stride (the token outermost within a
    block, K and V each at affine offsets within a token's row: CUDA's
    default LBNHC with FlashAttention's ``K | V`` packing); else None
    (:func:`gather_pages` then). One copy of the blocks and no second one
    into a dense K and V; slots past a request's tokens (its padding
    blocks) may be overwritten, the cache never is.

    Args:
        kv_cache: the layer's logical ``[num_blocks, H, N, C]`` cache.
        block_ids: int64 ``[R, nb]`` on the cache's device.
    """
    r_n, nb = block_ids.shape
    pages = _block_pages(kv_cache, block_ids.view(-1))
    out = []
    for view in (layout.k_view, layout.v_view):
        cell = None if view is None else _cell_view(pages, view, layout.content)
        if cell is None:
            return None
        start, sizes, strides = cell
        if sizes[1] != 1 or sizes[3] != 1 or strides[0] * layout.block_size != pages.stride(0):
            return None  # tiled, or a token stride that changes at a block's edge
        p0 = pages.stride(0)
        out.append(pages.as_strided((r_n, layout.num_kv_heads, nb * layout.block_size,
                                     layout.head_size),
                                    (nb * p0, pages.stride(1), strides[0], strides[2]),
                                    pages.storage_offset() + start))
    return out[0], out[1]


def _block_pages(kv_cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The blocks ``ids`` of the logical ``[num_blocks, H, N, C]`` cache,
    ``[len(ids), H, N, C]``: copied whole in the cache's physical order
    within a block (a plain row copy per block), returned as a logical view
    of that copy. On a cache whose logical view is not its physical order
    (CUDA's default LBNHC: ``[N, H, C]`` within a block) a logical
    ``index_select`` gathers element by element: on an H200, Llama-3-8B's
    heads, 64 requests over 2048 cached tokens, 0.95 ms a layer against
    about 0.3 ms so."""
    inner = sorted(range(1, 4), key=lambda i: (-kv_cache.stride(i), i))
    phys = kv_cache.permute(0, *inner)
    if not phys[0].is_contiguous():  # blocks not dense: gather logically
        return kv_cache.index_select(0, ids)
    back = [0] * 4
    for pos, dim in enumerate([0, *inner]):
        back[dim] = pos
    return phys.index_select(0, ids).permute(*back)


def _cell_view(pages: torch.Tensor, view, content: int):
    """``view`` (``(start, sizes, strides)`` in a ``(block, head)`` cell's
    logical flat offsets ``t * C + c``) as ``pages``' own element offsets
    (``pages``: ``[B, H, N, C]``, any strides), or None where a stride of
    the view is not one of whole tokens or one within a token."""
    if pages.is_contiguous():  # logical order: the view as it is
        return view
    start, sizes, strides = view
    s_t, s_c = pages.stride(2), pages.stride(3)
    t0, c0 = divmod(start, content)
    out, reach = [], c0  # reach: the last column within a token the view reads
    for size, stride in zip(sizes, strides):
        if size == 1 or stride == 0:
            out.append(0)
        elif stride % content == 0:
            out.append(stride // content * s_t)
        else:
            out.append(stride * s_c)
            reach += stride * (size - 1)
    if reach >= content:
        return None
    return t0 * s_t + c0 * s_c, sizes, tuple(out)


def gather_sequence(kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int,
                    layout: PageLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K and V of one sequence's first ``length`` tokens, each
    ``[H, length, D]`` (copies): ``block_ids`` int ``[>= ceil(length / N)]``."""
    bs = layout.block_size
    nb = max(-(-length // bs), 1)
    ids = torch.as_tensor(block_ids[:nb], dtype=torch.int64, device=kv_cache.device).view(1, nb)
    kvh, hd = layout.num_kv_heads, layout.head_size
    k = torch.empty(1, kvh, nb * bs, hd, dtype=kv_cache.dtype, device=kv_cache.device)
    v = torch.empty_like(k)
    gather_pages(kv_cache, ids, layout, k, v)
    return k[0, :, :length], v[0, :, :length]
