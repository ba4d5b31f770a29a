"""Tree attention over a request's cached prefix (read only).

Each tree node attends to the request's cached prefix and to its tree
ancestors, whose keys and values are never written to the cache.
:func:`batched_tree_attention` is what every layer runs (all requests, padded,
under an additive mask); :func:`tree_attention` is the plain one-request
reference the tests hold it to. Pure torch, on the query's device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def batched_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """Attention of every request's tree rows over its keys.

    ``q`` ``[R, H, T, D]``; ``k``, ``v`` ``[R, KVH, S, D]`` (prefix, then
    tree); ``mask`` additive float ``[R, 1, T, S]`` (every row allows a key);
    ``softcap`` > 0: scores become ``softcap * tanh(s / softcap)``.
    Returns ``[R, H, T, D]`` in ``k``'s dtype.
    """
    r, h, t, d = q.shape
    kvh = k.shape[1]
    if softcap <= 0:
        if h == kvh:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        # The G query heads of a KV head folded into G * T rows: torch's
        # kernels for an arbitrary mask would otherwise repeat K and V G times.
        g = h // kvh
        mf = mask.unsqueeze(2).expand(r, 1, g, t, mask.shape[-1]).reshape(r, 1, g * t, -1)
        out = F.scaled_dot_product_attention(q.reshape(r, kvh, g * t, d), k, v,
                                             attn_mask=mf, scale=scale)
        return out.reshape(r, h, t, d)
    kf, vf = k.float(), v.float()
    if h != kvh:
        kf = kf.repeat_interleave(h // kvh, dim=1)
        vf = vf.repeat_interleave(h // kvh, dim=1)
    s = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    s = softcap * torch.tanh(s / softcap) + mask.float()
    return torch.matmul(torch.softmax(s, dim=-1), vf).to(k.dtype)


def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   ctx_key: torch.Tensor, ctx_value: torch.Tensor, tree_mask: torch.Tensor,
                   positions: torch.Tensor, scale: float, sliding_window: int = -1,
                   softcap: float = 0.0) -> torch.Tensor:
    """One request's T tree nodes over its L cached tokens and the tree.

    ``query`` ``[T, H, D]``; ``key``, ``value`` ``[T, KVH, D]``; ``ctx_key``,
    ``ctx_value`` ``[KVH, L, D]`` (positions 0..L-1); ``tree_mask`` bool
    ``[T, T]``; ``positions`` int ``[T]``; ``sliding_window`` > 0: each query
    sees that many last positions, itself included. Returns ``[T, H, D]``.
    """
    t, h, _ = query.shape
    kvh, length, _ = ctx_key.shape
    dev = query.device
    allowed = torch.cat([torch.ones(t, length, dtype=torch.bool, device=dev),
                         tree_mask.to(dev)], dim=1)
    if sliding_window is not None and sliding_window > 0:
        pos = positions.to(dev)
        key_pos = torch.cat([torch.arange(length, device=dev), pos])
        allowed &= key_pos[None, :] > pos[:, None] - sliding_window
    k = torch.cat([ctx_key, key.transpose(0, 1).to(ctx_key.dtype)], dim=1).float()
    v = torch.cat([ctx_value, value.transpose(0, 1).to(ctx_value.dtype)], dim=1).float()
    if h != kvh:
        k = k.repeat_interleave(h // kvh, dim=0)
        v = v.repeat_interleave(h // kvh, dim=0)
    scores = torch.matmul(query.transpose(0, 1).float(), k.transpose(1, 2)) * scale  # [H, T, L+T]
    if softcap and softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [H, T, D]
    return out.transpose(0, 1).to(query.dtype)
