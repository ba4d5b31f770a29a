"""Tree attention over a request's paged KV cache (read only).

The lookahead pass queries a tree of tokens (see :mod:`attn_mask`) whose keys
and values are never written to the cache: each tree node attends to the
request's cached prefix (gathered from vLLM's paged cache) and to its tree
ancestors (the keys/values computed in this very pass).

Pure torch, no vLLM import: the cache *layout* within a block is learnt once
by :func:`probe_block_layout`, which calls the backend's own cache-write op on
a scratch block, so we never hard-code how a backend packs K and V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

#: write_fn(key, value, kv_cache, slot_mapping): the backend's op that stores
#: key/value [num_tokens, kv_heads, head_size] into a
#: [num_blocks, kv_heads, block_size, 2 * head_size] cache.
WriteFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class BlockLayout:
    """Where token t, dim d of one head lives inside a block.

    A layer's cache is ``[num_blocks, kv_heads, block_size, 2 * head_size]``;
    per (block, head) the first ``block_size * head_size`` elements hold K and
    the next as many hold V, each in a backend-specific order.
    ``k_perm[t * head_size + d]`` is the offset of K[t, d] inside the K half
    (likewise ``v_perm``).
    """

    block_size: int
    head_size: int
    k_perm: torch.Tensor  # int64 [block_size * head_size]
    v_perm: torch.Tensor  # int64 [block_size * head_size]


def split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key/value views of a ``[nb, kvh, bs, 2*hd]`` cache, as vLLM's CPU
    backend makes them (each ``[nb, kvh, bs, hd]``)."""
    nb, kvh, bs, _ = kv_cache.shape
    kv = kv_cache.view(nb, kvh, 2 * bs, -1)
    k, v = kv.chunk(2, dim=2)
    return k, v


def probe_block_layout(
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    write_fn: WriteFn,
) -> BlockLayout:
    """Learn the in-block layout by writing coded values with ``write_fn``.

    Values are small integers (exact in bfloat16 and float16): one probe
    codes the token index, one the dim, one the head.
    """
    bs, hd, kvh = block_size, head_size, num_kv_heads
    t_idx = torch.arange(bs).view(bs, 1, 1).expand(bs, kvh, hd)
    d_idx = torch.arange(hd).view(1, 1, hd).expand(bs, kvh, hd)
    h_idx = torch.arange(kvh).view(1, kvh, 1).expand(bs, kvh, hd)
    slots = torch.arange(bs, dtype=torch.int64)

    def write(code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache = torch.zeros(1, kvh, bs, 2 * hd, dtype=dtype)
        vals = (code + 1).to(dtype).contiguous()
        write_fn(vals, vals.clone(), cache, slots)
        region = cache.view(1, kvh, 2, bs * hd)[0].float()  # [kvh, 2, bs*hd]
        return region[:, 0] - 1, region[:, 1] - 1

    tk, tv = write(t_idx)
    dk, dv = write(d_idx)
    hk, hv = write(h_idx)
    heads = torch.arange(kvh, dtype=torch.float32).view(kvh, 1)
    if not (torch.equal(hk, heads.expand_as(hk)) and torch.equal(hv, heads.expand_as(hv))):
        raise RuntimeError("KV cache layout mixes heads within a block: unsupported")

    def perm(t: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        t0, d0 = t[0].long(), d[0].long()  # head 0; every head is checked below
        for h in range(1, kvh):
            if not (torch.equal(t[h].long(), t0) and torch.equal(d[h].long(), d0)):
                raise RuntimeError("KV cache layout differs between heads")
        flat = t0 * hd + d0  # which (t, d) each offset holds
        p = torch.full((bs * hd,), -1, dtype=torch.int64)
        p[flat] = torch.arange(bs * hd, dtype=torch.int64)
        if (p < 0).any():
            raise RuntimeError("KV cache layout probe is not a permutation")
        return p

    return BlockLayout(bs, hd, perm(tk, dk), perm(tv, dv))


def gather_index(
    block_ids: torch.Tensor,
    length: int,
    num_kv_heads: int,
    layout: BlockLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat element indices of one sequence's first ``length`` tokens.

    The indices address a contiguous ``[num_blocks, kv_heads, block_size,
    2 * head_size]`` cache viewed as 1-D, and are the same for every layer
    whose cache has this shape and layout: build them once per step.

    Returns:
        idx_k, idx_v: int64 ``[kv_heads, length, head_size]``.
    """
    bs, hd, kvh = layout.block_size, layout.head_size, num_kv_heads
    t = torch.arange(length)
    blk = block_ids.long()[t // bs]  # [L]
    off = (t % bs) * hd  # [L]
    heads = torch.arange(kvh).view(kvh, 1, 1)
    # start of (block, head)'s K half; the V half follows it.
    base = (blk.view(1, length, 1) * kvh + heads) * (2 * bs * hd)  # [kvh, L, 1]
    d = torch.arange(hd).view(1, 1, hd)
    within = off.view(1, length, 1) + d  # [1, L, hd]: t * hd + d
    idx_k = base + layout.k_perm[within]
    idx_v = base + bs * hd + layout.v_perm[within]
    return idx_k, idx_v


def take_kv(
    kv_cache: torch.Tensor,
    index: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K and V of one sequence (copies), ``[kv_heads, length, head_size]``.

    Args:
        kv_cache: contiguous ``[num_blocks, kv_heads, block_size, 2 * head_size]``.
        index: from :func:`gather_index`.
    """
    flat = kv_cache.view(-1)
    idx_k, idx_v = index
    k = flat.index_select(0, idx_k.view(-1)).view(idx_k.shape)
    v = flat.index_select(0, idx_v.view(-1)).view(idx_v.shape)
    return k, v


def gather_kv(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int, layout: BlockLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense K and V of the first ``length`` tokens of one sequence.

    Args:
        kv_cache: contiguous ``[num_blocks, kv_heads, block_size, 2 * head_size]``.
        block_ids: int [>= ceil(length / block_size)], the sequence's blocks.
    Returns:
        K, V: ``[kv_heads, length, head_size]`` (copies).
    """
    return take_kv(kv_cache, gather_index(block_ids, length, kv_cache.shape[1], layout))


def tree_attention_mask(
    tree_mask: torch.Tensor, length: int, positions: torch.Tensor, sliding_window: int = -1
) -> torch.Tensor:
    """bool [T, L+T]: what each tree node may see, the cached prefix of
    ``length`` tokens first (all of it, or the last ``sliding_window``
    positions), then the tree (``tree_mask``). Same for every layer with the
    same sliding window: build it once per step."""
    t = tree_mask.shape[0]
    allowed = torch.cat([torch.ones(t, length, dtype=torch.bool), tree_mask], dim=1)
    if sliding_window is not None and sliding_window > 0:
        key_pos = torch.cat([torch.arange(length), positions.cpu()])
        allowed = allowed & (key_pos[None, :] > positions.cpu()[:, None] - sliding_window)
    return allowed


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ctx_key: torch.Tensor,
    ctx_value: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    sliding_window: int = -1,
    softcap: float = 0.0,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of T tree nodes over a cached prefix of L tokens plus the tree.

    Args:
        query: [T, H, D]; key, value: [T, KVH, D] of the tree nodes.
        ctx_key, ctx_value: [KVH, L, D], the prefix (positions 0..L-1).
        tree_mask: bool [T, T], True where node i may see node j.
        positions: int [T], position of each node (>= L).
        sliding_window: > 0 to limit each query to the last that many
            positions (itself included), -1 for none.
        softcap: > 0 to apply ``softcap * tanh(s / softcap)`` to the scores.
        allowed: optional precomputed :func:`tree_attention_mask`.
    Returns:
        [T, H, D] in the query's dtype.
    """
    t, h, d = query.shape
    kvh, length, _ = ctx_key.shape
    if allowed is None:
        allowed = tree_attention_mask(tree_mask, length, positions, sliding_window)
    allowed = allowed.to(query.device)
    k = torch.cat([ctx_key, key.transpose(0, 1).to(ctx_key.dtype)], dim=1)  # [KVH, L+T, D]
    v = torch.cat([ctx_value, value.transpose(0, 1).to(ctx_value.dtype)], dim=1)
    q = query.transpose(0, 1).to(k.dtype)  # [H, T, D]
    if not softcap or softcap <= 0:
        # Fused kernel, grouped-query heads without copying K/V.
        out = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),
            attn_mask=allowed, scale=scale, enable_gqa=h != kvh,
        )[0]
        return out.transpose(0, 1).to(query.dtype)
    k, v, q = k.float(), v.float(), q.float()
    if h != kvh:
        k = k.repeat_interleave(h // kvh, dim=0)
        v = v.repeat_interleave(h // kvh, dim=0)
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, T, L+T]
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [H, T, D]
    return out.transpose(0, 1).to(query.dtype)
