"""Tree attention over the paged KV cache, read only.

A tree node attends to its request's cached prefix and to its tree ancestors,
whose K and V are never cached. :class:`TreeAttentionImpl` wraps a vLLM
attention impl and runs all requests' trees of a forward in one padded call
(:func:`batched_tree_attention`) under :class:`TreeAttnMetadata`. Pure torch
and numpy; every tensor on the cache's device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from vllm_lookahead.branch.kv_layout import PageLayout, gather_pages, gather_token_major


def batched_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """``q`` ``[R, H, T, D]`` over ``k``, ``v`` ``[R, KVH, S, D]`` under the
    additive ``mask`` ``[R, 1, T, S]`` (each row allows a key); ``softcap`` >
    0: scores become ``softcap * tanh(s / softcap)``. ``[R, H, T, D]``."""
    r, h, t, d = q.shape
    kvh = k.shape[1]
    if softcap <= 0:
        if h == kvh:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        # The G query heads of a KV head as G * T rows: torch's kernels for an
        # arbitrary mask would otherwise repeat K and V G times.
        g = h // kvh
        mf = mask.unsqueeze(2).expand(r, 1, g, t, mask.shape[-1]).reshape(r, 1, g * t, -1)
        out = F.scaled_dot_product_attention(q.reshape(r, kvh, g * t, d), k, v,
                                             attn_mask=mf, scale=scale)
        return out.reshape(r, h, t, d)
    kf, vf = k.float(), v.float()
    if h != kvh:
        kf, vf = kf.repeat_interleave(h // kvh, dim=1), vf.repeat_interleave(h // kvh, dim=1)
    s = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale
    s = softcap * torch.tanh(s / softcap) + mask.float()
    return torch.matmul(torch.softmax(s, dim=-1), vf).to(k.dtype)


@dataclass
class TreeAttnMetadata:
    """The trees of one forward, shared by all layers.

    Request ``r``'s tree rows are ``starts[r]:ends[r]`` of the forward (fused:
    after vLLM's rows, from ``offset``), at ``positions`` (int64, all rows);
    ``masks[r]`` bool ``[T_r, T_r]``; ``blocks``: per KV-cache group ``(block
    size, per request block ids)``. Layers attend ``R`` requests of ``T =
    t_max`` query slots each over keys = the request's cached blocks (``P``
    slots, padded), then its tree slots; what they share is built once.
    """

    starts: list[int]
    ends: list[int]
    context_lens: list[int]
    masks: list[np.ndarray]
    positions: np.ndarray
    blocks: list[tuple[int, list[np.ndarray]]]
    device: torch.device
    offset: int = 0
    _memo: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.sizes = [e - s for s, e in zip(self.starts, self.ends)]
        self.t_max = max(self.sizes)
        #: all trees of one size: the rows view as ``[R, T, ...]`` unpadded
        self.uniform = len(set(self.sizes)) == 1

    def _cached(self, key, make):
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def prefix_slots(self, group: int) -> int:
        """``P``: the key slots of the longest request's cached blocks."""
        bs = self.blocks[group][0]
        return self._cached(("prefix", group), lambda: bs * max(
            1, *(-(-n // bs) for n in self.context_lens)))

    def pages(self, group: int, extra: int = 0) -> tuple[torch.Tensor, int]:
        """int64 ``[R, nb + extra]`` block ids (a short request padded with
        its first block, masked off) and ``P = nb * block_size``."""
        def make():
            bs, per_req = self.blocks[group]
            nb = self.prefix_slots(group) // bs
            ids = np.empty((len(per_req), nb + extra), dtype=np.int64)
            for r, (b, n) in enumerate(zip(per_req, self.context_lens)):
                k = max(-(-n // bs), 1)
                ids[r, :k], ids[r, k:] = b[:k], b[0]
            return torch.from_numpy(ids).to(self.device), nb * bs
        return self._cached(("pages", group, extra), make)

    def rows_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Uneven trees: the tree rows of the forward and their slots in the
        padded ``[R * T]`` layout."""
        def make():
            rows = np.concatenate([np.arange(s, e) for s, e in zip(self.starts, self.ends)])
            slots = np.concatenate([np.arange(t) + r * self.t_max
                                    for r, t in enumerate(self.sizes)])
            return torch.from_numpy(rows).to(self.device), torch.from_numpy(slots).to(self.device)
        return self._cached("rows", make)

    def float_mask(self, group: int, window: int, dtype: torch.dtype,
                   width: int | None = None) -> torch.Tensor:
        """Additive ``[R, 1, T, width >= P + T]`` mask: the cached prefix (its
        last ``window`` positions where > 0), the tree from slot ``P``; a
        padded query sees only its own slot."""
        p, t_max = self.prefix_slots(group), self.t_max
        width = p + t_max if width is None else width

        def make():
            allowed = np.zeros((len(self.starts), 1, t_max, width), dtype=bool)
            allowed[:, 0, np.arange(t_max), p + np.arange(t_max)] = True
            for r, (n, t, m) in enumerate(zip(self.context_lens, self.sizes, self.masks)):
                a = allowed[r, 0, :t]
                a[:, :n], a[:, p:p + t] = True, m
                if window > 0:
                    s = self.starts[r] - self.offset
                    pos = self.positions[s:s + t]
                    low = (pos - window)[:, None]  # keys at positions past it
                    a[:, :n] &= np.arange(n)[None, :] > low
                    a[:, p:p + t] &= pos[None, :] > low
            mask = np.where(allowed, np.float32(0), np.float32(-np.inf))
            return torch.from_numpy(mask).to(self.device, dtype)
        return self._cached(("mask", group, window, dtype, width), make)


class TreeAttentionImpl:
    """Wraps an attention impl: tree attention during lookahead passes, the
    original backend otherwise. Other attributes pass through."""

    def __init__(self, inner, layer_name: str, group: int, layout: PageLayout, owner) -> None:
        self._inner = inner
        self._group = group
        self._layout = layout
        self._owner = owner  # holds ``fused_meta``: the trees of a fused forward
        self._softcap = float(getattr(inner, "logits_soft_cap", 0) or 0)
        #: whether this layer's cache gathers token-major (None: not tried)
        self._token_major: bool | None = None
        window = getattr(inner, "sliding_window", -1)
        if isinstance(window, (tuple, list)):  # some backends keep (left, right)
            window = window[0] + 1 if window[0] >= 0 else -1
        self._window = -1 if window is None else int(window)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        n = slot_mapping.shape[0]  # a fused step's tree rows are not cached
        if key.shape[0] != n:
            key, value = key[:n], value[:n]
        return self._inner.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        if isinstance(attn_metadata, TreeAttnMetadata):
            return self._tree(attn_metadata, query, key, value, kv_cache, output)
        fused = self._owner.fused_meta
        out = self._inner.forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                  *args, **kwargs)
        if fused is not None:
            self._tree(fused, query, key, value, kv_cache, output)
        return out

    def _tree(self, m: TreeAttnMetadata, query, key, value, kv_cache, output):
        """All trees in one call: the cached blocks copied once, the tree
        rows' K and V after them."""
        lay = self._layout
        r_n, t_max = len(m.starts), m.t_max
        kvh, d, h = lay.num_kv_heads, lay.head_size, query.shape[1]
        dt = kv_cache.dtype
        kv = None
        if self._token_major is not False:  # the tree rows go into padding blocks
            ids, p = m.pages(self._group, extra=-(-t_max // lay.block_size))
            kv = gather_token_major(kv_cache, ids, lay)
            self._token_major = kv is not None
        if kv is None:
            ids, p = m.pages(self._group)
            kb = torch.empty((r_n, kvh, p + t_max, d), dtype=dt, device=kv_cache.device)
            vb = torch.empty_like(kb)
            gather_pages(kv_cache, ids, lay, kb[:, :, :p], vb[:, :, :p])
        else:
            kb, vb = kv
        if m.uniform:
            s, e = m.offset, m.offset + r_n * t_max
            q, k, v = query[s:e], key[s:e], value[s:e]
        else:
            rows, slots = m.rows_slots()
            q = query.new_zeros((r_n * t_max, h, d))
            k = key.new_zeros((r_n * t_max, kvh, d))
            v = value.new_zeros((r_n * t_max, kvh, d))
            q[slots], k[slots], v[slots] = query[rows], key[rows], value[rows]
        kb[:, :, p:p + t_max].copy_(k.view(r_n, t_max, kvh, d).transpose(1, 2))
        vb[:, :, p:p + t_max].copy_(v.view(r_n, t_max, kvh, d).transpose(1, 2))
        q = q.view(r_n, t_max, h, d).transpose(1, 2).to(dt)
        mask = m.float_mask(self._group, self._window, dt, kb.shape[2])
        out = batched_tree_attention(q, kb, vb, mask, self._inner.scale, self._softcap)
        out = out.transpose(1, 2)  # [R, T, H, D]
        if m.uniform:
            output[s:e].view(r_n, t_max, h, d).copy_(out)
        else:
            output[rows] = out.reshape(r_n * t_max, h, d)[slots].to(output.dtype)
        return output
