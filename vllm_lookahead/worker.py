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
from vllm_lookahead.branch.tree_attention import batched_tree_attention, tree_attention_mask

logger = init_logger("vllm." + __name__)  # under "vllm": vLLM configures that logger


@dataclass
class TreeRequest:
    """One request's part of a lookahead pass.

    Attributes:
        tokens: int32 [T] node tokens; positions: int64 [T] absolute positions.
        mask: bool [T, T] tree mask (node sees ancestors and itself).
        context_len: cached prefix length L (the tree root sits at position L).
        batch_index: the request's row in the runner's input batch (block table).
        read: int [k] the nodes whose argmax is read (None: all); the
            others get -1 and no logits.
    """

    tokens: np.ndarray
    positions: np.ndarray
    mask: np.ndarray
    context_len: int
    batch_index: int
    read: np.ndarray | None = None


@dataclass
class TreeAttnMetadata:
    """Attention metadata of a lookahead pass, one object for all layers.

    The tree rows of request ``r`` are rows ``starts[r]:ends[r]`` of the
    forward's batch (fused: after vLLM's own rows, from ``offset``). Every
    layer attends all requests in one padded call: ``R`` requests, ``T``
    (``t_max``) query slots each, keys = the request's cached blocks
    (``nb`` of them, ``P = nb * block_size`` slots, padded with its first
    block) then its ``T`` tree slots. What the layers share is built once
    per step, on ``device`` (the KV cache's), on first use.
    """

    starts: list[int]
    ends: list[int]
    context_lens: list[int]
    masks: list[np.ndarray]  # bool [T_r, T_r] per request
    positions: np.ndarray  # int64 [total tree rows]
    #: per kv-cache group: (block size, per request int block ids [>= nb_r])
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
        """Every request's tree has the same size: the tree rows view as
        ``[R, T, ...]`` with no padding."""
        return len(set(self.sizes)) == 1

    def prefix_slots(self, group: int) -> int:
        """``P``: the key slots of the longest request's cached blocks."""
        key = ("prefix", group)
        hit = self._memo.get(key)
        if hit is None:
            bs = self.blocks[group][0]
            hit = self._memo[key] = max(max(-(-n // bs) for n in self.context_lens), 1) * bs
        return hit

    def pages(self, group: int, extra: int = 0) -> tuple[torch.Tensor, int]:
        """int64 ``[R, nb + extra]`` block ids on the device and ``P``, the
        prefix slots the first ``nb`` hold (``nb * block_size``); past them
        ``extra`` padding blocks a request's tree rows may go into
        (:func:`~vllm_lookahead.branch.kv_layout.gather_token_major`)."""
        key = ("pages", group, extra)
        hit = self._memo.get(key)
        if hit is None:
            bs, per_req = self.blocks[group]
            nb = self.prefix_slots(group) // bs
            ids = np.empty((len(per_req), nb + extra), dtype=np.int64)
            for r, (b, n) in enumerate(zip(per_req, self.context_lens)):
                k = max(-(-n // bs), 1)
                ids[r, :k] = b[:k]
                ids[r, k:] = b[0]  # padding: a valid block, masked off
            hit = self._memo[key] = (torch.from_numpy(ids).to(self.device), nb * bs)
        return hit

    def rows_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Non-uniform trees: the tree rows of the forward's batch and their
        places in the padded ``[R * T]`` query layout (device tensors)."""
        hit = self._memo.get("rows")
        if hit is None:
            rows = np.concatenate([np.arange(s, e) for s, e in zip(self.starts, self.ends)])
            slots = np.concatenate([np.arange(t) + r * self.t_max for r, t in enumerate(self.sizes)])
            hit = self._memo["rows"] = (torch.from_numpy(rows).to(self.device),
                                        torch.from_numpy(slots).to(self.device))
        return hit

    def float_mask(self, group: int, window: int, dtype: torch.dtype,
                   width: int | None = None) -> torch.Tensor:
        """Additive ``[R, 1, T, width]`` mask in ``dtype`` on the device
        (``width`` at least ``P + T``, its default): the request's cached
        prefix (or its last ``window`` positions), then its tree from slot
        ``P``; padded keys are masked off, a padded query sees only its own
        (zero) slot."""
        p, t_max = self.prefix_slots(group), self.t_max
        width = p + t_max if width is None else width
        key = ("mask", group, window, dtype, width)
        hit = self._memo.get(key)
        if hit is None:
            allowed = np.zeros((len(self.starts), 1, t_max, width), dtype=bool)
            allowed[:, 0, np.arange(t_max), p + np.arange(t_max)] = True
            for r, (n, t, m) in enumerate(zip(self.context_lens, self.sizes, self.masks)):
                s = self.starts[r] - self.offset
                own = tree_attention_mask(torch.from_numpy(m), n,
                                          torch.from_numpy(self.positions[s : s + t]),
                                          window).numpy()  # [t, n + t]
                allowed[r, 0, :t, :n] = own[:, :n]
                allowed[r, 0, :t, p : p + t] = own[:, n:]
            mask = torch.zeros(allowed.shape, dtype=dtype)
            mask.masked_fill_(torch.from_numpy(~allowed), float("-inf"))
            hit = self._memo[key] = mask.to(self.device)
        return hit


class TreeAttentionImpl:
    """Wraps an attention impl: our tree attention during lookahead passes,
    the original backend otherwise. Other attributes pass through."""

    def __init__(self, inner, layer_name: str, group: int, layout: PageLayout, owner) -> None:
        self._inner = inner
        self._layer_name = layer_name
        self._group = group
        self._layout = layout
        self._owner = owner  # the LookaheadWorker (holds the fused metadata)
        self._softcap = float(getattr(inner, "logits_soft_cap", 0) or 0)
        #: whether this layer's cache gathers token-major (kv_layout.
        #: gather_token_major); None: not tried yet
        self._token_major: bool | None = None
        window = getattr(inner, "sliding_window", -1)
        if isinstance(window, (tuple, list)):  # some backends keep (left, right)
            window = window[0] + 1 if window[0] >= 0 else -1
        self._window = -1 if window is None else int(window)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        # In a fused step key/value also hold the tree rows: cache only
        # vLLM's own tokens (the first len(slot_mapping) rows).
        # Sliced only then (two tensor views a layer less in other steps).
        n = slot_mapping.shape[0]
        if key.shape[0] != n:
            key, value = key[:n], value[:n]
        return self._inner.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)

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

    def _tree(self, m: TreeAttnMetadata, query, key, value, kv_cache, output):
        """All requests' tree rows in one attention call: the cached blocks
        gathered whole (one copy per layer), the tree rows after them."""
        lay = self._layout
        r_n, t_max = len(m.starts), m.t_max
        kvh, d = lay.num_kv_heads, lay.head_size
        h = query.shape[1]
        dt = kv_cache.dtype
        kv = None
        if self._token_major is not False:
            # the tree rows after the prefix, in padding blocks of the copy
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
        if m.uniform:  # no padding: views of the tree rows
            s, e = m.offset, m.offset + r_n * t_max
            q, k, v = query[s:e], key[s:e], value[s:e]
        else:
            rows, slots = m.rows_slots()
            q = query.new_zeros((r_n * t_max, h, d))
            k = key.new_zeros((r_n * t_max, kvh, d))
            v = value.new_zeros((r_n * t_max, kvh, d))
            q[slots] = query[rows]
            k[slots] = key[rows]
            v[slots] = value[rows]
        kb[:, :, p : p + t_max].copy_(k.view(r_n, t_max, kvh, d).transpose(1, 2))
        vb[:, :, p : p + t_max].copy_(v.view(r_n, t_max, kvh, d).transpose(1, 2))
        q = q.view(r_n, t_max, h, d).transpose(1, 2).to(dt)
        mask = m.float_mask(self._group, self._window, dt, kb.shape[2])
        out = batched_tree_attention(q, kb, vb, mask, self._inner.scale, self._softcap)
        out = out.transpose(1, 2)  # [R, T, H, D]
        if m.uniform:
            output[s:e].view(r_n, t_max, h, d).copy_(out)
        else:
            output[rows] = out.reshape(r_n * t_max, h, d)[slots].to(output.dtype)
        return output


def unsupported_reason(impl) -> str | None:
    """Why the lookahead branch cannot run on this attention impl (None: it
    can)."""
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
    return ", ".join(problems) or None


class TreesUnsupported(RuntimeError):
    """The lookahead branch cannot run on this engine's attention backend;
    the message names the backend, the layer and why."""


class LookaheadWorker:
    """Owns the lookahead pass of one model runner.

    Created once, at warm-up, when the KV cache exists: it learns every
    layer's cache layout with the backend's own writer and wraps the
    attention impls. Raises :class:`TreesUnsupported` (nothing wrapped)
    where a layer's backend or cache cannot serve the branch.
    """

    def __init__(self, runner) -> None:
        self.runner = runner
        #: TreeAttnMetadata of the tree rows during a fused forward, else None.
        self.fused_meta: TreeAttnMetadata | None = None
        #: Fused step: hidden states of the read tree rows, waiting for
        #: vLLM's logits call (patch 12), then the argmax of their logits.
        self._extra_rows: torch.Tensor | None = None
        self._extra_pred: np.ndarray | None = None
        self.vllm_config = runner.vllm_config
        self.device = torch.device(getattr(runner, "device", "cpu"))
        layers = self.vllm_config.compilation_config.static_forward_context
        group_of = {}
        for g, group in enumerate(runner.kv_cache_config.kv_cache_groups):
            for name in group.layer_names:
                group_of[name] = g
        self.num_groups = len(runner.kv_cache_config.kv_cache_groups)
        tables = runner.input_batch.block_table
        layouts: dict[tuple, PageLayout] = {}
        wrap = []
        for name, layer in layers.items():
            impl = getattr(layer, "impl", None)
            if impl is None or name not in group_of:
                continue
            if isinstance(impl, TreeAttentionImpl):
                impl._owner = self
                wrap.append((name, layer, None))
                continue
            backend = type(impl).__name__
            why = unsupported_reason(impl)
            kv = layer.kv_cache
            if isinstance(kv, (list, tuple)):
                kv = kv[0]
            if why is None and (not isinstance(kv, torch.Tensor) or kv.dim() != 4):
                why = "a KV cache that is not one [blocks, heads, block_size, C] view"
            head = getattr(impl, "head_size", None)
            if why is None and head is None:
                why = "no head_size"
            if why is None and kv.shape[2] != tables[group_of[name]].block_size:
                why = (f"cache block size {kv.shape[2]} != block table's "
                       f"{tables[group_of[name]].block_size}")
            if why is None:
                key = (kv.dtype, tuple(kv.shape[1:]), kv.stride()[1:], head,
                       getattr(layer, "isa", None), backend)
                if key not in layouts:
                    try:
                        layouts[key] = probe_page_layout(
                            kv, head,
                            # the backend's own cache writer, on a scratch page
                            lambda k, v, cache, slots, layer=layer, impl=impl: (
                                impl.do_kv_cache_update(layer, k, v, cache, slots)
                            ),
                        )
                    except (RuntimeError, TypeError, AssertionError) as e:
                        # UnsupportedLayout, or the writer refusing the page
                        why = f"its KV cache layout ({e})"
            if why is not None:
                raise TreesUnsupported(
                    f"attention backend {backend} (layer {name}): {why}")
            wrap.append((name, layer, TreeAttentionImpl(impl, name, group_of[name],
                                                        layouts[key], self)))
        if not wrap:
            raise TreesUnsupported("found no attention layers to wrap")
        # Wrap only once every layer is known to be served.
        for _, layer, impl in wrap:
            if impl is not None:
                layer.impl = impl

        self.layer_names = [name for name, _, _ in wrap]
        self.layouts = sorted({lay.name for lay in layouts.values()})
        logger.info(
            "Lookahead: tree attention over the paged KV cache on %d layers "
            "(backend %s, page layout %s, device %s)", len(self.layer_names),
            ", ".join(sorted({type(layer.impl._inner).__name__ for _, layer, _ in wrap})),
            ", ".join(self.layouts) or "as before", self.device,
        )

    def _metadata(self, requests: list[TreeRequest], offset: int = 0):
        """Inputs (on the device) and attention metadata of the trees, rows
        from ``offset``."""
        sizes = [len(r.tokens) for r in requests]
        ends = (np.cumsum(sizes) + offset).tolist()
        starts = [e - s for e, s in zip(ends, sizes)]
        ids_np = np.concatenate([r.tokens for r in requests]).astype(np.int32)
        pos_np = np.concatenate([r.positions for r in requests]).astype(np.int64)
        bt = self.runner.input_batch.block_table
        blocks = []
        for g in range(self.num_groups):
            table = bt[g]
            cpu = table.block_table.cpu
            blocks.append((table.block_size, [
                np.asarray(cpu[r.batch_index, : max(-(-r.context_len // table.block_size), 1)])
                for r in requests]))
        meta = TreeAttnMetadata(
            starts=starts,
            ends=ends,
            context_lens=[r.context_len for r in requests],
            masks=[np.asarray(r.mask, dtype=bool) for r in requests],
            positions=pos_np,
            blocks=blocks,
            device=self.device,
            offset=offset,
        )
        input_ids = torch.from_numpy(ids_np).to(self.device)
        positions = torch.from_numpy(pos_np).to(self.device)
        return input_ids, positions, meta

    @torch.inference_mode()
    def run(self, requests: list[TreeRequest]) -> list[np.ndarray]:
        """Separate mode: one tree-masked forward over all requests' trees.

        Returns, per request, int64 [T] the target's argmax at every node
        it reads (-1 at the others: no logits computed for them).
        """
        input_ids, positions, meta = self._metadata(requests)
        model = self.runner.model
        total = int(input_ids.shape[0])
        with set_forward_context(meta, self.vllm_config, num_tokens=total, slot_mapping={}):
            hidden = model(input_ids=input_ids, positions=positions)
        rows, spans = _read_rows(requests, meta.starts)
        pred = _argmax(model.compute_logits(hidden.index_select(0, rows.to(hidden.device))))
        return _spread(pred, spans)

    def fused_forward(self, forward, requests: list[TreeRequest], input_ids, positions, **kwargs):
        """Fused mode: vLLM's model forward of the step with the trees'
        tokens appended (``forward`` is the runner's own model call).

        Returns ``(hidden, preds)``: vLLM's hidden states (its rows only, as
        if nothing was appended) and a :class:`FusedPreds`, which gives per
        request int64 [T] the target's argmax at every node it reads (-1
        at the others) once vLLM's logits call has computed them.
        """
        n = int(input_ids.shape[0])
        ids, pos, meta = self._metadata(requests, offset=n)
        ids = torch.cat([input_ids, ids.to(input_ids.device, input_ids.dtype)])
        pos = torch.cat([positions, pos.to(positions.device, positions.dtype)])
        self.fused_meta = meta
        self._extra_rows = self._extra_pred = None
        try:
            with graphs_off():
                hidden = forward(input_ids=ids, positions=pos, **kwargs)
        finally:
            self.fused_meta = None
        rows, spans = _read_rows(requests, meta.starts)
        self._extra_rows = hidden.index_select(0, rows.to(hidden.device))
        return hidden[:n], FusedPreds(self, spans)

    # -- patch 12 (installed by patches on the runner's model): the read
    # tree rows ride in vLLM's logits call ---------------------------------
    def take_extra_rows(self) -> torch.Tensor | None:
        rows, self._extra_rows = self._extra_rows, None
        return rows

    def put_extra_logits(self, logits: torch.Tensor | None) -> None:
        self._extra_pred = _argmax(logits) if logits is not None else None

    def extra_pred(self) -> np.ndarray:
        """The argmax of the read tree rows of the last fused step: from
        vLLM's logits call, or computed here if that never came (or this
        rank got no logits)."""
        pred, self._extra_pred = self._extra_pred, None
        rows = self.take_extra_rows()
        if pred is None and rows is not None:
            with torch.inference_mode():
                pred = _argmax(self.runner.model.compute_logits(rows))
        if pred is None:
            raise RuntimeError("lookahead: the tree rows' logits were lost")
        return pred


@contextlib.contextmanager
def graphs_off():
    """Run the enclosed model call without CUDA graph replay: a step that
    carries tree rows has a token count and an attention path (ours, in
    Python) that no captured graph holds. vLLM's graph wrappers call the
    model directly when the forward context's runtime mode is NONE
    (``vllm/compilation/cuda_graph.py``); the steps without trees keep
    vLLM's graphs. A no-op when nothing is captured (the CPU, eager)."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available

    ctx = get_forward_context() if is_forward_context_available() else None
    old = getattr(ctx, "cudagraph_runtime_mode", None)
    if ctx is None or old is None or old == CUDAGraphMode.NONE:
        yield
        return
    ctx.cudagraph_runtime_mode = CUDAGraphMode.NONE
    try:
        yield
    finally:
        ctx.cudagraph_runtime_mode = old


class FusedPreds:
    """Per-request argmax of a fused step's tree rows, read after vLLM's
    logits call (:meth:`get`, once)."""

    def __init__(self, worker: LookaheadWorker, spans) -> None:
        self._worker = worker
        self._spans = spans
        self._preds: list[np.ndarray] | None = None

    def get(self) -> list[np.ndarray]:
        if self._preds is None:
            self._preds = _spread(self._worker.extra_pred(), self._spans)
        return self._preds


def _read_rows(requests: list[TreeRequest], starts: list[int]):
    """The batch rows whose logits are read (int64 tensor, in request
    order) and per request ``(begin, end, nodes, T)`` into them."""
    rows, spans, k = [], [], 0
    for r, s in zip(requests, starts):
        t = len(r.tokens)
        nodes = np.arange(t) if r.read is None else np.asarray(r.read, dtype=np.int64)
        rows.append(s + nodes)
        spans.append((k, k + len(nodes), nodes, t))
        k += len(nodes)
    return torch.from_numpy(np.concatenate(rows).astype(np.int64)), spans


def _spread(pred: np.ndarray, spans) -> list[np.ndarray]:
    """Per request int64 [T]: the read nodes' argmax, -1 elsewhere."""
    out = []
    for a, b, nodes, t in spans:
        full = np.full(t, -1, dtype=np.int64)
        full[nodes] = pred[a:b]
        out.append(full)
    return out


def _argmax(logits: torch.Tensor) -> np.ndarray:
    """int64 [T] argmax of [T, vocab] logits (``max`` is the faster kernel on
    CPU; ties: the first index, like ``argmax``)."""
    return logits.max(dim=-1).indices.cpu().numpy()
