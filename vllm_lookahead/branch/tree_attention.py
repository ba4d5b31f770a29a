"""Tree attention over a request's cached prefix (read only).

The lookahead branch queries a tree of tokens (see :mod:`attn_mask`) whose
keys and values are never written to the cache: each tree node attends to
the request's cached prefix (gathered from vLLM's paged cache by
:mod:`kv_layout`) and to its tree ancestors (the keys/values computed in
this very pass).

* :func:`batched_tree_attention`: all requests of a step in one call,
  padded, under an additive mask (what every layer runs);
* :func:`tree_attention`: one request, written plainly; the reference the
  tests hold the batched path to.

Pure torch, no vLLM import, device-agnostic (every tensor made here is made
on the query's device).
"""

from __future__ import annotations

import torch


def tree_attention_mask(
    tree_mask: torch.Tensor, length: int, positions: torch.Tensor, sliding_window: int = -1
) -> torch.Tensor:
    """bool [T, L+T]: what each tree node may see, the cached prefix of
    ``length`` tokens first (all of it, or the last ``sliding_window``
    positions), then the tree (``tree_mask``)."""
    t = tree_mask.shape[0]
    dev = tree_mask.device
    allowed = torch.cat([torch.ones(t, length, dtype=torch.bool, device=dev), tree_mask], dim=1)
    if sliding_window is not None and sliding_window > 0:
        pos = positions.to(dev)
        key_pos = torch.cat([torch.arange(length, device=dev), pos])
        allowed = allowed & (key_pos[None, :] > pos[:, None] - sliding_window)
    return allowed


def batched_tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of every request's tree rows over its keys.

    Args:
        q: ``[R, H, T, D]``; k, v: ``[R, KVH, S, D]`` (prefix then tree).
        mask: additive float ``[R, 1, T, S]`` (0 where allowed, -inf not;
            every row allows at least one key).
        softcap: > 0 to apply ``softcap * tanh(s / softcap)`` to the scores.
    Returns:
        ``[R, H, T, D]`` in ``k``'s dtype.
    """
    r, h, t, d = q.shape
    kvh = k.shape[1]
    if not softcap or softcap <= 0:
        if h == kvh:
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale)
        # Grouped queries folded into rows: the G = H / KVH query heads of
        # one KV head (heads g * G .. g * G + G - 1, enable_gqa's grouping)
        # become G * T rows over that head's keys, so K and V are read as
        # they are instead of repeated G times (torch's kernels for an
        # arbitrary mask expand them: on an H200, Llama-3-8B's heads, 64
        # requests over 2048 cached tokens, 2.5 ms a layer expanded).
        g = h // kvh
        qf = q.reshape(r, kvh, g * t, d)
        mf = mask.unsqueeze(2).expand(r, 1, g, t, mask.shape[-1]).reshape(r, 1, g * t, -1)
        out = torch.nn.functional.scaled_dot_product_attention(
            qf, k, v, attn_mask=mf, scale=scale)
        return out.reshape(r, h, t, d)
    qf, kf, vf = q.float(), k.float(), v.float()
    if h != kvh:
        kf = kf.repeat_interleave(h // kvh, dim=1)
        vf = vf.repeat_interleave(h // kvh, dim=1)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    s = softcap * torch.tanh(s / softcap) + mask.float()
    return torch.matmul(torch.softmax(s, dim=-1), vf).to(k.dtype)


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
) -> torch.Tensor:
    """Attention of T tree nodes over a cached prefix of L tokens plus the
    tree, for one request (the plain reference).

    Args:
        query: [T, H, D]; key, value: [T, KVH, D] of the tree nodes.
        ctx_key, ctx_value: [KVH, L, D], the prefix (positions 0..L-1).
        tree_mask: bool [T, T], True where node i may see node j.
        positions: int [T], position of each node (>= L).
        sliding_window: > 0 to limit each query to the last that many
            positions (itself included), -1 for none.
        softcap: > 0 to apply ``softcap * tanh(s / softcap)`` to the scores.
    Returns:
        [T, H, D] in the query's dtype.
    """
    t, h, d = query.shape
    kvh, length, _ = ctx_key.shape
    allowed = tree_attention_mask(tree_mask.to(query.device), length, positions, sliding_window)
    k = torch.cat([ctx_key, key.transpose(0, 1).to(ctx_key.dtype)], dim=1).float()  # [KVH, L+T, D]
    v = torch.cat([ctx_value, value.transpose(0, 1).to(ctx_value.dtype)], dim=1).float()
    q = query.transpose(0, 1).float()  # [H, T, D]
    if h != kvh:
        k = k.repeat_interleave(h // kvh, dim=0)
        v = v.repeat_interleave(h // kvh, dim=0)
    scores = torch.matmul(q, k.transpose(1, 2)) * scale  # [H, T, L+T]
    if softcap and softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [H, T, D]
    return out.transpose(0, 1).to(query.dtype)
