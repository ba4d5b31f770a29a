"""Where a token's K and V live in a layer's paged KV cache (a logical
``[num_blocks, kv_heads, block_size, C]`` view, any strides), and gathers of
a request's blocks. Backends pack a ``(block, head)`` cell differently (``[K |
V]`` per token, K transposed then V, tiles): :func:`probe_page_layout` learns
it with the backend's own writer; affine or tiled offsets are read with
strided views, anything else by index. Every tensor on the cache's device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

#: ``(start, sizes, strides)`` over the tile digits ``(t1, t0, d1, d0)``.
View = tuple[int, tuple[int, ...], tuple[int, ...]]


class UnsupportedLayout(RuntimeError):
    """The backend's cache cannot be read by the lookahead branch."""


@dataclass(frozen=True)
class PageLayout:
    """How K and V sit in one ``(block, head)`` cell ``[N, C]`` read flat:
    ``K[t, d]`` at ``k_off[t * D + d]`` (int64 ``[N * D]``), V likewise;
    ``k_view``/``v_view``: those as a :data:`View` over ``t = t1 * a + t0``,
    ``d = d1 * b + d0`` (the least tiling), None where none is affine."""

    block_size: int
    num_kv_heads: int
    head_size: int
    content: int  # C
    k_off: torch.Tensor
    v_off: torch.Tensor
    k_view: View | None
    v_view: View | None

    #: ``(start, t_stride, d_stride)`` where K (V) is untiled, else None
    k_affine = property(lambda self: _untiled(self.k_view))
    v_affine = property(lambda self: _untiled(self.v_view))

    @property
    def name(self) -> str:
        """``split`` (``[K | V]`` per token), ``strided`` (other affine
        offsets), ``tiled`` (affine in tile digits) or ``indexed``."""
        k, v = self.k_affine, self.v_affine
        if (k, v) == ((0, self.content, 1), (self.head_size, self.content, 1)):
            return "split"
        if k is not None and v is not None:
            return "strided"
        return "tiled" if self.k_view is not None and self.v_view is not None else "indexed"


def _untiled(view: View | None) -> tuple[int, int, int] | None:
    if view is None or view[1][1] != 1 or view[1][3] != 1:
        return None
    return view[0], view[2][0], view[2][2]


def _tiled(off: torch.Tensor, bs: int, hd: int) -> View | None:
    """The least tiling (``a | bs``, ``b | hd``) in whose digits ``off`` is
    affine with strides >= 0 (``as_strided`` takes no negative ones)."""
    o = off.view(bs, hd).cpu()
    start = int(o[0, 0])
    t = torch.arange(bs).view(bs, 1)
    d = torch.arange(hd).view(1, hd)
    for a in (x for x in range(1, bs + 1) if bs % x == 0):
        for b in (x for x in range(1, hd + 1) if hd % x == 0):
            sizes = (bs // a, a, hd // b, b)
            strides = (int(o[a, 0]) - start if bs // a > 1 else 0,
                       int(o[1, 0]) - start if a > 1 else 0,
                       int(o[0, b]) - start if hd // b > 1 else 0,
                       int(o[0, 1]) - start if b > 1 else 0)
            if min(strides) < 0:
                continue
            expect = (start + t // a * strides[0] + t % a * strides[1]
                      + d // b * strides[2] + d % b * strides[3])
            if torch.equal(o, expect):
                return start, sizes, strides
    return None


def scratch_like(cache: torch.Tensor, num_blocks: int = 1) -> torch.Tensor:
    """Zeroed ``[num_blocks, H, N, C]`` with ``cache``'s dtype, device and
    physical dimension order."""
    shape = (num_blocks, *cache.shape[1:])
    order = sorted(range(cache.dim()), key=lambda i: (-cache.stride(i), i))
    phys = torch.zeros([shape[i] for i in order], dtype=cache.dtype, device=cache.device)
    return phys.permute(*[order.index(i) for i in range(cache.dim())])


def probe_page_layout(cache: torch.Tensor, head_size: int,
                      write_fn: Callable[..., None]) -> PageLayout:
    """Where ``write_fn(key, value [tokens, H, D], cache, flat slots)`` puts K
    and V in the cells of ``cache`` (4-D, not written): small integers (exact
    in bfloat16) coding token, dim and head, K as +1 and V as -1. Raises
    :class:`UnsupportedLayout` unless every head holds K and V alike."""
    _, kvh, bs, c = cache.shape
    hd = head_size
    if c < 2 * hd:
        raise UnsupportedLayout(f"KV cache cell of {c} elements cannot hold K and V of {hd}")
    dev = cache.device
    shape = (bs, kvh, hd)
    t_idx = torch.arange(bs, device=dev).view(bs, 1, 1).expand(shape)
    d_idx = torch.arange(hd, device=dev).view(1, 1, hd).expand(shape)
    h_idx = torch.arange(kvh, device=dev).view(1, kvh, 1).expand(shape)
    slots = torch.arange(bs, dtype=torch.int64, device=dev)

    def write(vals: torch.Tensor) -> torch.Tensor:
        """Signed float32 ``[H, N * C]`` of the page after writing K = vals, V = -vals."""
        page = scratch_like(cache)
        vals = vals.to(cache.dtype).contiguous()
        write_fn(vals, (-vals).contiguous(), page, slots)
        return page[0].reshape(kvh, bs * c).float().cpu()

    def code(idx: torch.Tensor) -> torch.Tensor:  # idx where it was written, else -1
        return write(idx + 1).abs() - 1

    tc = code(t_idx % 64) + 64 * code(t_idx // 64)
    dc = code(d_idx % 64) + 64 * code(d_idx // 64)
    sg = write(torch.ones(shape, device=dev))
    is_k, is_v = sg > 0, sg < 0
    hc = code(h_idx)
    heads = torch.arange(kvh, dtype=torch.float32).view(kvh, 1).expand_as(hc)
    if not torch.equal(hc[is_k | is_v], heads[is_k | is_v]):
        raise UnsupportedLayout("KV cache layout mixes heads within a block")

    def offsets(sel: torch.Tensor, h: int) -> torch.Tensor:
        where = sel[h].nonzero().view(-1)
        t, d = tc[h, where].long(), dc[h, where].long()
        off = torch.full((bs * hd,), -1, dtype=torch.int64)
        if where.numel() == bs * hd and bool(((t >= 0) & (t < bs) & (d >= 0) & (d < hd)).all()):
            off[t * hd + d] = where
        if (off < 0).any():
            raise UnsupportedLayout("KV cache layout probe is not a permutation")
        return off

    k_off, v_off = offsets(is_k, 0), offsets(is_v, 0)
    for h in range(1, kvh):
        if not (torch.equal(offsets(is_k, h), k_off) and torch.equal(offsets(is_v, h), v_off)):
            raise UnsupportedLayout("KV cache layout differs between heads")
    return PageLayout(bs, kvh, hd, c, k_off.to(dev), v_off.to(dev),
                      _tiled(k_off, bs, hd), _tiled(v_off, bs, hd))


def gather_pages(kv_cache: torch.Tensor, block_ids: torch.Tensor, layout: PageLayout,
                 out_k: torch.Tensor, out_v: torch.Tensor) -> None:
    """Copy K and V of the blocks ``block_ids`` (int64 ``[R, nb]``) into
    ``out_k``, ``out_v`` ``[R, H, nb * N, D]``."""
    r_n, nb = block_ids.shape
    bs, hd, kvh = layout.block_size, layout.head_size, layout.num_kv_heads
    pages = _block_pages(kv_cache, block_ids.view(-1))
    for off, view, out in ((layout.k_off, layout.k_view, out_k),
                           (layout.v_off, layout.v_view, out_v)):
        src = _strided(pages, view, layout, r_n, nb)
        if src is not None:  # [R, H, nb, *sizes]
            out.view(src.shape).copy_(src)
        else:
            src = pages.reshape(r_n * nb, kvh, bs * layout.content).index_select(2, off)
            out.view(r_n, kvh, nb, bs, hd).copy_(src.view(r_n, nb, kvh, bs, hd).transpose(1, 2))


def gather_token_major(kv_cache: torch.Tensor, block_ids: torch.Tensor,
                       layout: PageLayout) -> tuple[torch.Tensor, torch.Tensor] | None:
    """K and V ``[R, H, nb * N, D]`` as views of one copy of the blocks where
    it holds a request's tokens at one stride (LBNHC with ``[K | V]``), else
    None; the caller may write into the copy past a request's tokens."""
    r_n, nb = block_ids.shape
    pages = _block_pages(kv_cache, block_ids.view(-1))
    out = []
    for view in (layout.k_view, layout.v_view):
        src = _strided(pages, view, layout, r_n, nb)  # [R, H, nb, N / a, a, D / b, b]
        if src is None or src.shape[4] != 1 or src.shape[6] != 1 or (
                src.stride(3) * layout.block_size != src.stride(2)):
            return None  # tiled, or the token stride changes at a block's edge
        out.append(src.view(r_n, layout.num_kv_heads, nb * layout.block_size, layout.head_size))
    return out[0], out[1]


def _strided(pages: torch.Tensor, view: View | None, layout: PageLayout, r_n: int,
             nb: int) -> torch.Tensor | None:
    """K or V of ``pages`` (``[R * nb, H, N, C]``, any strides) as a strided
    ``[R, H, nb, *sizes]`` view over ``view``'s tile digits, or None where a
    stride is neither whole tokens nor within a token."""
    if view is None:
        return None
    start, sizes, strides = view
    if not pages.is_contiguous():  # the cell's offsets t * C + c in pages' own strides
        s_t, s_c = pages.stride(2), pages.stride(3)
        t0, c0 = divmod(start, layout.content)
        out, reach = [], c0  # reach: the last column within a token the view reads
        for size, stride in zip(sizes, strides):
            if size == 1 or stride == 0:
                out.append(0)
            elif stride % layout.content == 0:
                out.append(stride // layout.content * s_t)
            else:
                out.append(stride * s_c)
                reach += stride * (size - 1)
        if reach >= layout.content:
            return None
        start, strides = t0 * s_t + c0 * s_c, tuple(out)
    p0 = pages.stride(0)
    return pages.as_strided((r_n, layout.num_kv_heads, nb, *sizes),
                            (nb * p0, pages.stride(1), p0, *strides),
                            pages.storage_offset() + start)


def _block_pages(kv_cache: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Blocks ``ids`` of the logical cache, ``[len(ids), H, N, C]``: copied
    whole in their physical order (one row copy per block), viewed logically."""
    order = [0, *sorted(range(1, 4), key=lambda i: (-kv_cache.stride(i), i))]
    phys = kv_cache.permute(*order)
    if not phys[0].is_contiguous():
        return kv_cache.index_select(0, ids)
    return phys.index_select(0, ids).permute(*[order.index(i) for i in range(4)])
