"""Tree attention over the paged KV cache, read only: a tree node attends to
its request's cached prefix and to its tree ancestors (never cached).
:class:`TreeAttentionImpl` wraps a vLLM attention impl and runs all trees of a
forward in one padded call under :class:`TreeAttnMetadata`."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from vllm_lookahead.branch.kv_layout import PageLayout, gather_pages, gather_token_major


def batched_tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: torch.Tensor, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """``q`` ``[R, H, T, D]`` over ``k``, ``v`` ``[R, KVH, S, D]`` under the
    additive ``mask`` ``[R, 1, T, S]``; ``softcap`` > 0: scores become
    ``softcap * tanh(s / softcap)``. ``[R, H, T, D]``."""
    r, h, t, d = q.shape
    g = h // k.shape[1]
    # the G query heads of a KV head as G * T rows (else K and V repeat G times)
    q = q.reshape(r, k.shape[1], g * t, d)
    mask = mask.unsqueeze(2).expand(r, 1, g, t, mask.shape[-1]).reshape(r, 1, g * t, -1)
    if softcap > 0:
        s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        s = softcap * torch.tanh(s / softcap) + mask.float()
        out = torch.matmul(torch.softmax(s, dim=-1), v.float()).to(k.dtype)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.reshape(r, h, t, d)


@dataclass
class TreeAttnMetadata:
    """The trees of one forward, shared by all layers: request ``r``'s rows
    ``starts[r]:ends[r]`` (fused: after vLLM's, from ``offset``) at
    ``positions`` (int64, all rows), ``masks[r]`` bool ``[T_r, T_r]``;
    ``blocks``: per KV-cache group ``(block size, per request block ids)``.
    Keys: a request's cached blocks (``P`` slots, padded), then its tree."""

    starts: list[int]
    ends: list[int]
    context_lens: list[int]
    masks: list[np.ndarray]
    positions: np.ndarray
    blocks: list[tuple[int, list[np.ndarray]]]
    device: torch.device
    offset: int = 0
    _memo: dict = field(default_factory=dict)  # what the layers share, built once

    def __post_init__(self) -> None:
        self.sizes = [e - s for s, e in zip(self.starts, self.ends)]
        self.t_max = max(self.sizes)
        #: all trees of one size: the rows view as ``[R, T, ...]`` unpadded
        self.uniform = len(set(self.sizes)) == 1
        #: per group ``P``: the key slots of the longest request's cached blocks
        self.prefix = [bs * max(1, *(-(-n // bs) for n in self.context_lens))
                       for bs, _ in self.blocks]

    def pages(self, group: int, extra: int = 0) -> tuple[torch.Tensor, int]:
        """int64 ``[R, nb + extra]`` block ids (a short request padded with
        its first block, masked off) and ``P = nb * block_size``."""
        key = ("pages", group, extra)
        if key not in self._memo:
            bs, per_req = self.blocks[group]
            nb = self.prefix[group] // bs
            ids = np.empty((len(per_req), nb + extra), dtype=np.int64)
            for r, (b, n) in enumerate(zip(per_req, self.context_lens)):
                k = max(-(-n // bs), 1)
                ids[r, :k], ids[r, k:] = b[:k], b[0]
            self._memo[key] = torch.from_numpy(ids).to(self.device), nb * bs
        return self._memo[key]

    @cached_property
    def rows_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Uneven trees: the forward's tree rows and their slots in the padded ``[R * T]``."""
        rows = np.concatenate([np.arange(s, e) for s, e in zip(self.starts, self.ends)])
        slots = np.concatenate([np.arange(t) + r * self.t_max for r, t in enumerate(self.sizes)])
        return torch.from_numpy(rows).to(self.device), torch.from_numpy(slots).to(self.device)

    def float_mask(self, group: int, window: int, dtype: torch.dtype,
                   width: int | None = None) -> torch.Tensor:
        """Additive ``[R, 1, T, width >= P + T]`` mask: the cached prefix (its
        last ``window`` positions where > 0), the tree from slot ``P``; a
        padded query sees only its own slot."""
        p, t_max = self.prefix[group], self.t_max
        width = p + t_max if width is None else width
        key = ("mask", group, window, dtype, width)
        if key not in self._memo:
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
            self._memo[key] = torch.from_numpy(mask).to(self.device, dtype)
        return self._memo[key]


class TreeAttentionImpl:
    """Wraps an attention impl: tree attention for the trees' rows, the
    original backend otherwise; other attributes pass through."""

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
        return self._inner.do_kv_cache_update(layer, key[:n], value[:n], kv_cache, slot_mapping)

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
        """All trees in one call: the cached blocks copied, the trees' K and V after."""
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
            rows, slots = m.rows_slots
            q, k, v = (x.new_zeros((r_n * t_max, *x.shape[1:])) for x in (query, key, value))
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
