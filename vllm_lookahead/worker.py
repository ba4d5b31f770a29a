"""Runs the lookahead trees inside vLLM's model runner.

Every attention layer's ``impl`` is wrapped by :class:`TreeAttentionImpl`.
Fused mode (:meth:`LookaheadWorker.fused_forward`) appends the trees' tokens
after vLLM's own query tokens of a step: vLLM's backend attends and caches its
rows as usual, then the wrapper attends the tree rows over each request's paged
cache, read only. Separate mode (:meth:`LookaheadWorker.run`) is a second
forward over the trees alone, with an empty slot mapping. Outside those the
wrapper hands every call to the original impl.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from vllm.forward_context import set_forward_context
from vllm.logger import init_logger

from vllm_lookahead.branch.kv_layout import (
    PageLayout,
    gather_pages,
    gather_token_major,
    probe_page_layout,
)
from vllm_lookahead.branch.tree_attention import batched_tree_attention

logger = init_logger("vllm." + __name__)  # under "vllm": vLLM configures that logger


@dataclass
class TreeRequest:
    """One request's tree: ``tokens`` int32 ``[T]``, ``positions`` int64
    ``[T]``, ``mask`` bool ``[T, T]`` (a node sees its ancestors and itself),
    rooted after ``context_len`` cached tokens, in row ``batch_index`` of the
    runner's input batch; ``read`` the nodes whose argmax is read (None: all)."""

    tokens: np.ndarray
    positions: np.ndarray
    mask: np.ndarray
    context_len: int
    batch_index: int
    read: np.ndarray | None = None


@dataclass
class TreeAttnMetadata:
    """The trees of one forward, shared by all layers.

    Request ``r``'s tree rows are ``starts[r]:ends[r]`` of the forward's batch
    (fused: after vLLM's rows, from ``offset``); ``positions`` int64 covers
    them all. Layers attend all ``R`` requests in one padded call: ``T =
    t_max`` query slots each, keys = the request's cached blocks (``P``
    slots, padded with its first block), then its ``T`` tree slots.
    ``blocks``: per KV-cache group ``(block size, per request block ids)``.
    What the layers share is built once, on ``device``, on first use.
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

    @functools.cached_property
    def sizes(self) -> list[int]:
        return [e - s for s, e in zip(self.starts, self.ends)]

    @functools.cached_property
    def t_max(self) -> int:
        return max(self.sizes)

    @functools.cached_property
    def uniform(self) -> bool:
        """All trees of one size: the rows view as ``[R, T, ...]``, no padding."""
        return len(set(self.sizes)) == 1

    def _cached(self, key, make):
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def prefix_slots(self, group: int) -> int:
        """``P``: the key slots of the longest request's cached blocks."""
        bs = self.blocks[group][0]
        return self._cached(("prefix", group), lambda: max(
            max(-(-n // bs) for n in self.context_lens), 1) * bs)

    def pages(self, group: int, extra: int = 0) -> tuple[torch.Tensor, int]:
        """int64 ``[R, nb + extra]`` block ids on the device and ``P = nb *
        block_size``; a short request is padded with its first block (masked
        off), ``extra`` more blocks of room for the tree rows."""
        def make():
            bs, per_req = self.blocks[group]
            nb = self.prefix_slots(group) // bs
            ids = np.empty((len(per_req), nb + extra), dtype=np.int64)
            for r, (b, n) in enumerate(zip(per_req, self.context_lens)):
                k = max(-(-n // bs), 1)
                ids[r, :k] = b[:k]
                ids[r, k:] = b[0]
            return torch.from_numpy(ids).to(self.device), nb * bs
        return self._cached(("pages", group, extra), make)

    def rows_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Uneven trees: the tree rows of the batch and their slots in the
        padded ``[R * T]`` layout (device tensors)."""
        def make():
            rows = np.concatenate([np.arange(s, e) for s, e in zip(self.starts, self.ends)])
            slots = np.concatenate([np.arange(t) + r * self.t_max
                                    for r, t in enumerate(self.sizes)])
            return torch.from_numpy(rows).to(self.device), torch.from_numpy(slots).to(self.device)
        return self._cached("rows", make)

    def float_mask(self, group: int, window: int, dtype: torch.dtype,
                   width: int | None = None) -> torch.Tensor:
        """Additive ``[R, 1, T, width]`` mask (``width`` >= ``P + T``): the
        cached prefix (its last ``window`` positions where > 0), the tree from
        slot ``P``; a padded query sees only its own slot."""
        p, t_max = self.prefix_slots(group), self.t_max
        width = p + t_max if width is None else width

        def make():
            allowed = np.zeros((len(self.starts), 1, t_max, width), dtype=bool)
            allowed[:, 0, np.arange(t_max), p + np.arange(t_max)] = True
            for r, (n, t, m) in enumerate(zip(self.context_lens, self.sizes, self.masks)):
                s = self.starts[r] - self.offset
                a = allowed[r, 0, :t]
                a[:, :n] = True
                a[:, p:p + t] = m
                if window > 0:
                    pos = self.positions[s:s + t]
                    low = (pos - window)[:, None]  # a key is seen past it
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
        self._layer_name = layer_name
        self._group = group
        self._layout = layout
        self._owner = owner  # the LookaheadWorker (holds the fused metadata)
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
        # A fused step's key/value also hold the tree rows: cache only vLLM's.
        n = slot_mapping.shape[0]
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
        """All requests' tree rows in one call: the cached blocks copied once,
        the tree rows' K and V after them."""
        lay = self._layout
        r_n, t_max = len(m.starts), m.t_max
        kvh, d = lay.num_kv_heads, lay.head_size
        h = query.shape[1]
        dt = kv_cache.dtype
        kv = None
        if self._token_major is not False:  # tree rows go into padding blocks of the copy
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


class TreesUnsupported(RuntimeError):
    """The trees cannot run on this engine's attention backend; the message
    names the backend, the layer and why."""


def unsupported_reason(impl, kv, block_size: int) -> str | None:
    """Why the trees cannot run on a layer's impl and cache (None: they can)."""
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
    if not callable(getattr(impl, "do_kv_cache_update", None)):
        problems.append("no do_kv_cache_update (the cache writer the layout probe uses)")
    if getattr(impl, "head_size", None) is None:
        problems.append("no head_size")
    if not isinstance(kv, torch.Tensor) or kv.dim() != 4:
        problems.append("a KV cache that is not one [blocks, heads, block_size, C] view")
    elif kv.shape[2] != block_size:
        problems.append(f"cache block size {kv.shape[2]} != block table's {block_size}")
    return ", ".join(problems) or None


class LookaheadWorker:
    """The trees of one model runner, made at warm-up once the KV cache
    exists: learns every layer's cache layout with the backend's own writer
    and wraps the attention impls, or raises :class:`TreesUnsupported`
    (nothing wrapped)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.vllm_config = runner.vllm_config
        self.device = torch.device(getattr(runner, "device", "cpu"))
        #: the tree rows' metadata during a fused forward, else None
        self.fused_meta: TreeAttnMetadata | None = None
        # Fused step: the read tree rows' hidden states until vLLM's logits
        # call (patch 12) takes them, their argmax, per request spans, preds.
        self._extra_rows: torch.Tensor | None = None
        self._extra_pred: np.ndarray | None = None
        self._spans: list = []
        self._preds: list[np.ndarray] | None = None
        groups = runner.kv_cache_config.kv_cache_groups
        self.num_groups = len(groups)
        group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        tables = runner.input_batch.block_table
        layouts: dict[tuple, PageLayout] = {}
        wrap = []
        for name, layer in self.vllm_config.compilation_config.static_forward_context.items():
            impl = getattr(layer, "impl", None)
            if impl is None or name not in group_of:
                continue
            if isinstance(impl, TreeAttentionImpl):
                impl._owner = self
                wrap.append((layer, impl))
                continue
            kv = layer.kv_cache
            kv = kv[0] if isinstance(kv, (list, tuple)) else kv
            why = unsupported_reason(impl, kv, tables[group_of[name]].block_size)
            if why is None:
                key = (kv.dtype, tuple(kv.shape[1:]), kv.stride()[1:], impl.head_size,
                       getattr(layer, "isa", None), type(impl).__name__)
                if key not in layouts:
                    try:  # the backend's own cache writer, on a scratch page
                        layouts[key] = probe_page_layout(
                            kv, impl.head_size, lambda k, v, cache, slots, layer=layer, impl=impl:
                            impl.do_kv_cache_update(layer, k, v, cache, slots))
                    except (RuntimeError, TypeError, AssertionError) as e:
                        why = f"its KV cache layout ({e})"
            if why is not None:
                raise TreesUnsupported(
                    f"attention backend {type(impl).__name__} (layer {name}): {why}")
            wrap.append((layer, TreeAttentionImpl(impl, name, group_of[name], layouts[key], self)))
        if not wrap:
            raise TreesUnsupported("found no attention layers to wrap")
        for layer, impl in wrap:  # only once every layer is known to be served
            layer.impl = impl
        self.layouts = sorted({lay.name for lay in layouts.values()})
        logger.info(
            "Lookahead: tree attention over the paged KV cache on %d layers "
            "(backend %s, page layout %s, device %s)", len(wrap),
            ", ".join(sorted({type(impl._inner).__name__ for _, impl in wrap})),
            ", ".join(self.layouts) or "as before", self.device)

    def _metadata(self, requests: list[TreeRequest], offset: int = 0):
        """Input ids and positions (on the device) and metadata of the trees,
        rows from ``offset``."""
        sizes = [len(r.tokens) for r in requests]
        ends = (np.cumsum(sizes) + offset).tolist()
        pos = np.concatenate([r.positions for r in requests]).astype(np.int64)
        blocks = []
        for g in range(self.num_groups):
            table = self.runner.input_batch.block_table[g]
            bs, cpu = table.block_size, table.block_table.cpu
            blocks.append((bs, [np.asarray(cpu[r.batch_index, :max(-(-r.context_len // bs), 1)])
                                for r in requests]))
        meta = TreeAttnMetadata(
            starts=[e - s for e, s in zip(ends, sizes)], ends=ends,
            context_lens=[r.context_len for r in requests],
            masks=[np.asarray(r.mask, dtype=bool) for r in requests],
            positions=pos, blocks=blocks, device=self.device, offset=offset)
        ids = np.concatenate([r.tokens for r in requests]).astype(np.int32)
        return (torch.from_numpy(ids).to(self.device), torch.from_numpy(pos).to(self.device),
                meta)

    @torch.inference_mode()
    def run(self, requests: list[TreeRequest]) -> list[np.ndarray]:
        """Separate mode: one forward over all trees. Per request int64
        ``[T]``: the argmax at the nodes it reads, -1 at the others."""
        input_ids, positions, meta = self._metadata(requests)
        model = self.runner.model
        with set_forward_context(meta, self.vllm_config, num_tokens=int(input_ids.shape[0]),
                                 slot_mapping={}):
            hidden = model(input_ids=input_ids, positions=positions)
        rows, spans = _read_rows(requests, meta.starts)
        return _spread(_argmax(model.compute_logits(hidden.index_select(
            0, rows.to(hidden.device)))), spans)

    def fused_forward(self, forward, requests: list[TreeRequest], input_ids, positions,
                      **kwargs):
        """Fused mode: ``forward`` (the runner's model call) with the trees'
        tokens appended. Returns vLLM's rows of the hidden states; the trees'
        argmax comes from :meth:`fused_preds` after vLLM's logits call."""
        n = int(input_ids.shape[0])
        ids, pos, meta = self._metadata(requests, offset=n)
        ids = torch.cat([input_ids, ids.to(input_ids.device, input_ids.dtype)])
        pos = torch.cat([positions, pos.to(positions.device, positions.dtype)])
        self.fused_meta = meta
        self._extra_rows = self._extra_pred = self._preds = None
        try:
            with graphs_off():
                hidden = forward(input_ids=ids, positions=pos, **kwargs)
        finally:
            self.fused_meta = None
        rows, self._spans = _read_rows(requests, meta.starts)
        self._extra_rows = hidden.index_select(0, rows.to(hidden.device))
        return hidden[:n]

    # patch 12: the read tree rows ride in vLLM's logits call
    def take_extra_rows(self) -> torch.Tensor | None:
        rows, self._extra_rows = self._extra_rows, None
        return rows

    def put_extra_logits(self, logits: torch.Tensor | None) -> None:
        self._extra_pred = _argmax(logits) if logits is not None else None

    def fused_preds(self) -> list[np.ndarray]:
        """Per request of the last fused step, int64 ``[T]``: the argmax at
        the nodes it reads, -1 at the others; computed here where vLLM's
        logits call did not (or this rank got no logits)."""
        if self._preds is None:
            pred, self._extra_pred = self._extra_pred, None
            rows = self.take_extra_rows()
            if pred is None and rows is not None:
                with torch.inference_mode():
                    pred = _argmax(self.runner.model.compute_logits(rows))
            if pred is None:
                raise RuntimeError("lookahead: the tree rows' logits were lost")
            self._preds = _spread(pred, self._spans)
        return self._preds


@contextlib.contextmanager
def graphs_off():
    """The enclosed model call without CUDA graph replay: a step with tree
    rows has a shape and an attention path no captured graph holds. vLLM's
    graph wrappers call the model directly under runtime mode NONE
    (``vllm/compilation/cuda_graph.py``); steps without trees keep graphs."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available

    ctx = get_forward_context() if is_forward_context_available() else None
    old = getattr(ctx, "cudagraph_runtime_mode", None)
    if old is None or old == CUDAGraphMode.NONE:
        yield
        return
    ctx.cudagraph_runtime_mode = CUDAGraphMode.NONE
    try:
        yield
    finally:
        ctx.cudagraph_runtime_mode = old


def _read_rows(requests: list[TreeRequest], starts: list[int]):
    """The batch rows whose logits are read (int64 tensor) and per request
    ``(begin, end, nodes, T)`` into them."""
    rows, spans, k = [], [], 0
    for r, s in zip(requests, starts):
        nodes = np.arange(len(r.tokens)) if r.read is None else np.asarray(r.read, np.int64)
        rows.append(s + nodes)
        spans.append((k, k + len(nodes), nodes, len(r.tokens)))
        k += len(nodes)
    return torch.from_numpy(np.concatenate(rows).astype(np.int64)), spans


def _spread(pred: np.ndarray, spans) -> list[np.ndarray]:
    """Per request int64 ``[T]``: the read nodes' argmax, -1 elsewhere."""
    out = []
    for a, b, nodes, t in spans:
        full = np.full(t, -1, dtype=np.int64)
        full[nodes] = pred[a:b]
        out.append(full)
    return out


def _argmax(logits: torch.Tensor) -> np.ndarray:
    """int64 ``[T]`` argmax of ``[T, vocab]`` logits (``max`` is the faster
    kernel on the CPU; ties: the first index, as ``argmax``)."""
    return logits.max(dim=-1).indices.cpu().numpy()
