"""Runs the lookahead branch inside vLLM's model runner.

Every attention layer's ``impl`` is wrapped once by :class:`TreeAttentionImpl`.
Two ways to run the trees of all running requests:

* fused (:meth:`LookaheadWorker.fused_forward`, one target forward per step):
  the tree tokens are appended after vLLM's own query tokens of the step.
  vLLM's backend attends and caches its tokens as usual (the cache update is
  cut to the step's slot mapping); the wrapper then computes
  :func:`tree_attention` for the appended rows over the request's paged KV
  cache, which by then holds the step's verification tokens, read only.
* separate (:meth:`LookaheadWorker.run`): a second forward over the trees
  alone, with an empty slot mapping so nothing is written.

Outside those, the wrapper hands every call to the original impl untouched.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from vllm.forward_context import set_forward_context
from vllm.logger import init_logger

from vllm_lookahead.tree_attention import (
    BlockLayout,
    gather_index,
    probe_block_layout,
    take_kv,
    tree_attention,
    tree_attention_mask,
)

logger = init_logger("vllm." + __name__)  # under "vllm": vLLM configures that logger


@dataclass
class TreeRequest:
    """One request's part of a lookahead pass.

    Attributes:
        tokens: int32 [T] node tokens; positions: int64 [T] absolute positions.
        mask: bool [T, T] tree mask (node sees ancestors and itself).
        context_len: cached prefix length L (the tree root sits at position L).
        batch_index: the request's row in the runner's input batch (block table).
    """

    tokens: np.ndarray
    positions: np.ndarray
    mask: np.ndarray
    context_len: int
    batch_index: int


@dataclass
class TreeAttnMetadata:
    """Attention metadata of a lookahead pass (one object for all layers)."""

    starts: list[int]
    ends: list[int]
    context_lens: list[int]
    masks: list[torch.Tensor]
    positions: torch.Tensor  # int64 [total]
    #: (kv group, layout) -> per request (idx_k, idx_v) from gather_index,
    #: built on first use and shared by every layer of that group and layout.
    gather: dict
    block_ids: list[list[torch.Tensor]]  # [kv group][request] -> int block ids
    #: Row of the first tree token in the forward's batch (fused: after
    #: vLLM's own tokens); ``positions`` starts there.
    offset: int = 0
    #: (request, sliding window) -> tree_attention_mask, shared by layers.
    allowed: dict = None
    #: (group, layout, window) -> padded batch layout (see ``padded``).
    pads: dict = None
    #: (group, layout, window, dtype) -> additive float mask (0 / -inf).
    fmasks: dict = None

    @functools.cached_property
    def uniform(self) -> bool:
        """Every request's tree has the same size: the tree rows (contiguous
        from ``offset``) view as ``[R, T, ...]`` with no padding. Computed
        once per step, read by every layer."""
        sizes = {e - s for s, e in zip(self.starts, self.ends)}
        return len(sizes) == 1

    def float_mask(self, group: int, layout: BlockLayout, num_kv_heads: int, window: int,
                   dtype: torch.dtype) -> torch.Tensor:
        """``padded``'s mask as an additive float mask in ``dtype``, built
        once per step (SDPA would convert a bool mask in every layer)."""
        if self.fmasks is None:
            self.fmasks = {}
        key = (group, id(layout), window, dtype)
        fm = self.fmasks.get(key)
        if fm is None:
            mask = self.padded(group, layout, num_kv_heads, window)[4]
            fm = self.fmasks[key] = torch.zeros(mask.shape, dtype=dtype).masked_fill_(
                ~mask, float("-inf"))
        return fm

    def attention_mask(self, r: int, window: int) -> torch.Tensor:
        if self.allowed is None:
            self.allowed = {}
        m = self.allowed.get((r, window))
        if m is None:
            s, e = self.starts[r] - self.offset, self.ends[r] - self.offset
            m = self.allowed[(r, window)] = tree_attention_mask(
                self.masks[r], self.context_lens[r], self.positions[s:e], window
            )
        return m

    def padded(self, group: int, layout: BlockLayout, num_kv_heads: int, window: int):
        """Everything one batched SDPA over all requests needs, built once per
        step and shared by the layers of a (group, layout, window):

        * ``idx``: int64 flat cache indices of every request's K and V,
          padded to the longest context: viewed ``[2, R, KVH, L_max, D]``;
        * ``rows`` / ``slots``: the tree rows of the forward's batch and
          their places in the padded ``[R * T_max]`` query layout;
        * ``mask``: bool ``[R, 1, T_max, L_max + T_max]``: cached prefix
          (or its sliding window) then the tree; padded keys and queries
          are masked off (a padded query sees only itself).
        """
        if self.pads is None:
            self.pads = {}
        key = (group, id(layout), window)
        pad = self.pads.get(key)
        if pad is not None:
            return pad
        r_n = len(self.starts)
        sizes = [e - s for s, e in zip(self.starts, self.ends)]
        t_max, l_max = max(sizes), max(max(self.context_lens), 1)
        per_req = self.gather_indices(group, layout, num_kv_heads)
        d = per_req[0][0].shape[-1]
        idx = torch.zeros((2, r_n, num_kv_heads, l_max, d), dtype=torch.long)
        mask = torch.zeros((r_n, 1, t_max, l_max + t_max), dtype=torch.bool)
        mask[:, 0, torch.arange(t_max), l_max + torch.arange(t_max)] = True
        rows, slots = [], []
        for r, ((ik, iv), n, t) in enumerate(zip(per_req, self.context_lens, sizes)):
            idx[0, r, :, :n] = ik
            idx[1, r, :, :n] = iv
            allowed = self.attention_mask(r, window)  # [t, n + t]
            mask[r, 0, :t, :n] = allowed[:, :n]
            mask[r, 0, :t, l_max : l_max + t] = allowed[:, n:]
            rows.append(torch.arange(self.starts[r], self.ends[r]))
            slots.append(torch.arange(t) + r * t_max)
        pad = self.pads[key] = (
            idx.view(-1), (r_n, l_max, t_max), torch.cat(rows), torch.cat(slots), mask
        )
        return pad

    def gather_indices(self, group: int, layout: BlockLayout, num_kv_heads: int) -> list:
        key = (group, id(layout))
        idx = self.gather.get(key)
        if idx is None:
            idx = self.gather[key] = [
                gather_index(b, n, num_kv_heads, layout)
                for b, n in zip(self.block_ids[group], self.context_lens)
            ]
        return idx


class TreeAttentionImpl:
    """Wraps an attention impl: our tree attention during lookahead passes,
    the original backend otherwise. Other attributes pass through."""

    def __init__(self, inner, layer_name: str, group: int, layout: BlockLayout, owner) -> None:
        self._inner = inner
        self._layer_name = layer_name
        self._group = group
        self._layout = layout
        self._owner = owner  # the LookaheadWorker (holds the fused metadata)
        self._softcap = float(getattr(inner, "logits_soft_cap", 0) or 0)
        window = getattr(inner, "sliding_window", -1)
        self._window = -1 if window is None else int(window)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        # In a fused step key/value also hold the tree rows: cache only
        # vLLM's own tokens (the first len(slot_mapping) rows).
        n = slot_mapping.shape[0]
        return self._inner.do_kv_cache_update(layer, key[:n], value[:n], kv_cache, slot_mapping)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        if isinstance(attn_metadata, TreeAttnMetadata):
            return self._tree(attn_metadata, query, key, value, kv_cache, output)
        fused = self._owner.fused_meta
        out = self._inner.forward(
            layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs
        )
        if fused is not None:
            self._tree(fused, query, key, value, kv_cache, output)
        return out

    def _tree(self, m: "TreeAttnMetadata", query, key, value, kv_cache, output):
        if self._softcap:
            return self._tree_per_request(m, query, key, value, kv_cache, output)
        # All requests in one SDPA call, padded to the longest context; the
        # index, the mask and the row layout are built once per step.
        kvh = kv_cache.shape[1]
        idx, (r_n, l_max, t_max), rows, slots, _ = m.padded(
            self._group, self._layout, kvh, self._window
        )
        h, d = query.shape[1], query.shape[2]
        ctx = kv_cache.view(-1).index_select(0, idx).view(2, r_n, kvh, l_max, d)
        if m.uniform:  # no padding: views of the tree rows
            s, e = m.offset, m.offset + r_n * t_max
            q, k, v = query[s:e], key[s:e], value[s:e]
        else:
            q = query.new_zeros((r_n * t_max, h, d))
            k = key.new_zeros((r_n * t_max, kvh, d))
            v = value.new_zeros((r_n * t_max, kvh, d))
            q[slots] = query[rows]
            k[slots] = key[rows]
            v[slots] = value[rows]
        dt = ctx.dtype
        k = torch.cat([ctx[0], k.view(r_n, t_max, kvh, d).transpose(1, 2).to(dt)], dim=2)
        v = torch.cat([ctx[1], v.view(r_n, t_max, kvh, d).transpose(1, 2).to(dt)], dim=2)
        q = q.view(r_n, t_max, h, d).transpose(1, 2).to(dt)
        mask = m.float_mask(self._group, self._layout, kvh, self._window, dt)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=self._inner.scale, enable_gqa=h != kvh
        ).transpose(1, 2)  # [R, T_max, H, D]
        if m.uniform:
            output[s:e].view(r_n, t_max, h, d).copy_(out)
        else:
            output[rows] = out.reshape(r_n * t_max, h, d)[slots].to(output.dtype)
        return output

    def _tree_per_request(self, m: "TreeAttnMetadata", query, key, value, kv_cache, output):
        inner = self._inner
        softcap, window = self._softcap, self._window
        indices = m.gather_indices(self._group, self._layout, kv_cache.shape[1])
        for r in range(len(m.starts)):
            s, e = m.starts[r], m.ends[r]
            ck, cv = take_kv(kv_cache, indices[r])
            output[s:e] = tree_attention(
                query[s:e],
                key[s:e],
                value[s:e],
                ck,
                cv,
                m.masks[r],
                m.positions[s - m.offset : e - m.offset],
                inner.scale,
                sliding_window=window,
                softcap=softcap,
                allowed=m.attention_mask(r, window),
            ).to(output.dtype)
        return output


def _check_supported(name: str, layer, impl) -> None:
    problems = []
    if getattr(impl, "alibi_slopes", None) is not None:
        problems.append("ALiBi")
    if getattr(impl, "sinks", None) is not None:
        problems.append("attention sinks")
    if getattr(impl, "kv_sharing_target_layer_name", None):
        problems.append("KV sharing between layers")
    kv_dtype = getattr(impl, "kv_cache_dtype", "auto")
    if kv_dtype not in ("auto", None):
        problems.append(f"kv_cache_dtype={kv_dtype!r}")
    if getattr(impl, "attn_type", "decoder") not in ("decoder", "DECODER"):
        problems.append(f"attention type {impl.attn_type!r}")
    if problems:
        raise NotImplementedError(
            f"lookahead decoding does not support {', '.join(problems)} "
            f"(attention layer {name})"
        )


class LookaheadWorker:
    """Owns the lookahead pass of one model runner.

    Created once, on the first step, when the KV cache exists: it wraps the
    attention impls and learns the cache layout.
    """

    def __init__(self, runner) -> None:
        self.runner = runner
        #: TreeAttnMetadata of the tree rows during a fused forward, else None.
        self.fused_meta: TreeAttnMetadata | None = None
        self.vllm_config = runner.vllm_config
        layers = self.vllm_config.compilation_config.static_forward_context
        group_of = {}
        for g, group in enumerate(runner.kv_cache_config.kv_cache_groups):
            for name in group.layer_names:
                group_of[name] = g
        self.num_groups = len(runner.kv_cache_config.kv_cache_groups)
        layouts: dict[tuple, BlockLayout] = {}
        self.layer_names = []
        for name, layer in layers.items():
            impl = getattr(layer, "impl", None)
            if impl is None or name not in group_of:
                continue
            if isinstance(impl, TreeAttentionImpl):
                impl._owner = self
                self.layer_names.append(name)
                continue
            _check_supported(name, layer, impl)
            kv = layer.kv_cache
            if isinstance(kv, (list, tuple)):
                kv = kv[0]
            if not kv.is_contiguous():
                raise NotImplementedError(f"lookahead: non-contiguous KV cache in layer {name}")
            _, kvh, bs, two_hd = kv.shape
            isa = getattr(layer, "isa", None)
            key = (kv.dtype, kvh, bs, two_hd // 2, isa)
            if key not in layouts:
                layouts[key] = probe_block_layout(
                    bs, kvh, two_hd // 2, kv.dtype,
                    # the backend's own cache writer, on a scratch block
                    lambda k, v, cache, slots, layer=layer, impl=impl: (
                        impl.do_kv_cache_update(layer, k, v, cache, slots)
                    ),
                )
            layer.impl = TreeAttentionImpl(impl, name, group_of[name], layouts[key], self)
            self.layer_names.append(name)
        if not self.layer_names:
            raise RuntimeError("lookahead: found no attention layers to wrap")
        logger.info(
            "Lookahead: tree attention over the paged KV cache on %d layers",
            len(self.layer_names),
        )

    def block_ids(self, batch_index: int, context_len: int) -> list[torch.Tensor]:
        out = []
        bt = self.runner.input_batch.block_table
        for g in range(self.num_groups):
            table = bt[g]
            nb = -(-max(context_len, 1) // table.block_size)
            out.append(table.block_table.cpu[batch_index, :nb])
        return out

    def _metadata(self, requests: list[TreeRequest], offset: int = 0):
        """Inputs and attention metadata of the trees, rows from ``offset``."""
        sizes = [len(r.tokens) for r in requests]
        ends = (np.cumsum(sizes) + offset).tolist()
        starts = [e - s for e, s in zip(ends, sizes)]
        input_ids = torch.from_numpy(np.concatenate([r.tokens for r in requests]).astype(np.int32))
        positions = torch.from_numpy(np.concatenate([r.positions for r in requests]).astype(np.int64))
        per_req_blocks = [self.block_ids(r.batch_index, r.context_len) for r in requests]
        meta = TreeAttnMetadata(
            starts=starts,
            ends=ends,
            context_lens=[r.context_len for r in requests],
            masks=[torch.from_numpy(np.array(r.mask, dtype=bool)) for r in requests],
            positions=positions,
            gather={},
            block_ids=[[b[g] for b in per_req_blocks] for g in range(self.num_groups)],
            offset=offset,
        )
        return input_ids, positions, meta

    @torch.inference_mode()
    def run(self, requests: list[TreeRequest]) -> list[np.ndarray]:
        """Separate mode: one tree-masked forward over all requests' trees.

        Returns, per request, int64 [T] the target's argmax at every node.
        """
        input_ids, positions, meta = self._metadata(requests)
        model = self.runner.model
        total = int(input_ids.shape[0])
        with set_forward_context(meta, self.vllm_config, num_tokens=total, slot_mapping={}):
            hidden = model(input_ids=input_ids, positions=positions)
        pred = _argmax(model.compute_logits(hidden))
        return [pred[s:e] for s, e in zip(meta.starts, meta.ends)]

    def fused_forward(self, forward, requests: list[TreeRequest], input_ids, positions, **kwargs):
        """Fused mode: vLLM's model forward of the step with the trees'
        tokens appended (``forward`` is the runner's own model call).

        Returns ``(hidden, preds)``: vLLM's hidden states (its rows only, as
        if nothing was appended) and, per request, int64 [T] the target's
        argmax at every tree node.
        """
        n = int(input_ids.shape[0])
        ids, pos, meta = self._metadata(requests, offset=n)
        ids = torch.cat([input_ids, ids.to(input_ids.device, input_ids.dtype)])
        pos = torch.cat([positions, pos.to(positions.device, positions.dtype)])
        self.fused_meta = meta
        try:
            hidden = forward(input_ids=ids, positions=pos, **kwargs)
        finally:
            self.fused_meta = None
        with torch.inference_mode():
            pred = _argmax(self.runner.model.compute_logits(hidden[n:]))
        return hidden[:n], [pred[s - n : e - n] for s, e in zip(meta.starts, meta.ends)]


def _argmax(logits: torch.Tensor) -> np.ndarray:
    """int64 [T] argmax of [T, vocab] logits (``max`` is the faster kernel on
    CPU; ties: the first index, like ``argmax``)."""
    return logits.max(dim=-1).indices.cpu().numpy()
