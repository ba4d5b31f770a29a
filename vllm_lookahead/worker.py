"""Runs the lookahead trees inside vLLM's model runner, every attention impl
wrapped by :class:`TreeAttentionImpl`: fused mode appends the trees' tokens to
vLLM's own of a step (the tree rows attend each request's cache, read only),
separate mode runs a second forward over the trees alone."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from vllm.forward_context import set_forward_context
from vllm.logger import init_logger

from vllm_lookahead.branch.kv_layout import PageLayout, probe_page_layout
from vllm_lookahead.branch.tree_attention import TreeAttentionImpl, TreeAttnMetadata

logger = init_logger("vllm." + __name__)  # under "vllm": vLLM configures that logger


@dataclass
class TreeRequest:
    """One request's tree: ``tokens`` int32 ``[T]``, ``positions`` int64 ``[T]``,
    ``mask`` bool ``[T, T]``, after ``context_len`` cached tokens, in row
    ``batch_index`` of the input batch; ``read``: the nodes read (None: all)."""

    tokens: np.ndarray
    positions: np.ndarray
    mask: np.ndarray
    context_len: int
    batch_index: int
    read: np.ndarray | None = None


class TreesUnsupported(RuntimeError):
    """The trees cannot run on this engine's attention backend."""


def unsupported_reason(impl, kv, block_size: int) -> str | None:
    """Why the trees cannot run on a layer's impl and cache (None: they can)."""
    kv_dtype = getattr(impl, "kv_cache_dtype", "auto")
    attn_type = getattr(impl, "attn_type", "decoder")
    problems = [why for bad, why in (
        (getattr(impl, "alibi_slopes", None) is not None, "ALiBi"),
        (getattr(impl, "sinks", None) is not None, "attention sinks"),
        (getattr(impl, "kv_sharing_target_layer_name", None), "KV sharing between layers"),
        (kv_dtype not in ("auto", None), f"kv_cache_dtype={kv_dtype!r}"),
        (attn_type not in ("decoder", "DECODER"), f"attention type {attn_type!r}"),
        (getattr(impl, "head_size", None) is None, "no head_size"),
        (not isinstance(kv, torch.Tensor) or kv.dim() != 4,
         "a KV cache that is not one [blocks, heads, block_size, C] view"),
    ) if bad]
    if not problems and kv.shape[2] != block_size:
        problems.append(f"cache block size {kv.shape[2]} != block table's {block_size}")
    return ", ".join(problems) or None


class LookaheadWorker:
    """The trees of one model runner, made once the KV cache exists: learns
    every layer's cache layout with the backend's own writer and wraps the
    attention impls, or raises :class:`TreesUnsupported`, nothing wrapped."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.vllm_config = runner.vllm_config
        self.device = torch.device(getattr(runner, "device", "cpu"))
        #: the trees of a fused forward while it runs, else None
        self.fused_meta: TreeAttnMetadata | None = None
        # fused step: the read tree rows' hidden states until vLLM's logits
        # call (patch 12) takes them, per tree (read nodes, T), the argmax
        self._extra_rows: torch.Tensor | None = None
        self._spans: list = []
        self._preds: list[np.ndarray] | None = None
        groups = runner.kv_cache_config.kv_cache_groups
        self.num_groups = len(groups)
        group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        layouts: dict[tuple, PageLayout] = {}
        wrap = []
        for name, layer in self.vllm_config.compilation_config.static_forward_context.items():
            impl = getattr(layer, "impl", None)
            if impl is None or name not in group_of:
                continue
            kv = layer.kv_cache[0] if isinstance(layer.kv_cache, (list, tuple)) else layer.kv_cache
            why = unsupported_reason(impl, kv,
                                     runner.input_batch.block_table[group_of[name]].block_size)
            if why is None:
                key = (kv.dtype, tuple(kv.shape[1:]), kv.stride()[1:], impl.head_size,
                       getattr(layer, "isa", None), type(impl).__name__)
                try:  # the backend's own cache writer, on a scratch page
                    if key not in layouts:
                        layouts[key] = probe_page_layout(
                            kv, impl.head_size, lambda k, v, cache, slots, layer=layer,
                            impl=impl: impl.do_kv_cache_update(layer, k, v, cache, slots))
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
        logger.info("Lookahead: tree attention over the paged KV cache on %d layers "
                    "(backend %s, page layout %s, device %s)", len(wrap),
                    ", ".join(sorted({type(impl._inner).__name__ for _, impl in wrap})),
                    ", ".join(self.layouts), self.device)

    def _metadata(self, requests: list[TreeRequest], offset: int = 0):
        """The trees' input ids, positions and metadata, rows from ``offset``."""
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
        return torch.from_numpy(ids).to(self.device), torch.from_numpy(pos).to(self.device), meta

    @torch.inference_mode()
    def run(self, requests: list[TreeRequest]) -> list[np.ndarray]:
        """Separate mode: one forward over the trees, nothing cached. Per
        request int64 ``[T]``: the argmax at the nodes it reads, else -1."""
        input_ids, positions, meta = self._metadata(requests)
        model = self.runner.model
        with set_forward_context(meta, self.vllm_config, num_tokens=int(input_ids.shape[0]),
                                 slot_mapping={}):
            hidden = model(input_ids=input_ids, positions=positions)
        rows, spans = _read_rows(requests, meta.starts)
        logits = model.compute_logits(hidden.index_select(0, rows.to(hidden.device)))
        return _spread(_argmax(logits), spans)

    def fused_forward(self, forward, requests: list[TreeRequest], input_ids, positions,
                      **kwargs):
        """Fused mode: ``forward`` (the runner's model call) with the trees'
        tokens appended; returns vLLM's rows of the hidden states."""
        n = int(input_ids.shape[0])
        ids, pos, meta = self._metadata(requests, offset=n)
        ids = torch.cat([input_ids, ids.to(input_ids.device, input_ids.dtype)])
        pos = torch.cat([positions, pos.to(positions.device, positions.dtype)])
        self.fused_meta = meta
        self._extra_rows = self._preds = None
        try:
            with graphs_off():
                hidden = forward(input_ids=ids, positions=pos, **kwargs)
        finally:
            self.fused_meta = None
        rows, self._spans = _read_rows(requests, meta.starts)
        self._extra_rows = hidden.index_select(0, rows.to(hidden.device))
        return hidden[:n]

    def take_extra_rows(self) -> torch.Tensor | None:
        """Patch 12: the read tree rows, for vLLM's logits call."""
        rows, self._extra_rows = self._extra_rows, None
        return rows

    def put_extra_logits(self, logits: torch.Tensor | None) -> None:
        if logits is not None:
            self._preds = _spread(_argmax(logits), self._spans)

    def fused_preds(self) -> list[np.ndarray]:
        """Per tree of the last fused step, int64 ``[T]``: the argmax at the
        nodes it reads, else -1 (computed here where vLLM's logits call did not)."""
        if self._preds is None:
            rows = self.take_extra_rows()
            if rows is None:
                raise RuntimeError("lookahead: the tree rows' logits were lost")
            with torch.inference_mode():
                self._preds = _spread(_argmax(self.runner.model.compute_logits(rows)),
                                      self._spans)
        return self._preds


@contextlib.contextmanager
def graphs_off():
    """The enclosed model call without CUDA graph replay (no captured graph
    holds tree rows): vLLM's graph wrappers run eagerly under runtime mode NONE."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available

    ctx = get_forward_context() if is_forward_context_available() else None
    old = getattr(ctx, "cudagraph_runtime_mode", None)
    if old is not None:
        ctx.cudagraph_runtime_mode = CUDAGraphMode.NONE
    try:
        yield
    finally:
        if old is not None:
            ctx.cudagraph_runtime_mode = old


def _read_rows(requests: list[TreeRequest], starts: list[int]):
    """The forward's rows whose logits are read (int64) and per request ``(read nodes, T)``."""
    spans = [(np.arange(len(r.tokens)) if r.read is None else np.asarray(r.read, np.int64),
              len(r.tokens)) for r in requests]
    rows = np.concatenate([s + nodes for s, (nodes, _) in zip(starts, spans)]).astype(np.int64)
    return torch.from_numpy(rows), spans


def _spread(pred: np.ndarray, spans) -> list[np.ndarray]:
    """Per request int64 ``[T]``: the read nodes' argmax, -1 elsewhere."""
    out, k = [], 0
    for nodes, t in spans:
        out.append(np.full(t, -1, dtype=np.int64))
        out[-1][nodes] = pred[k:k + len(nodes)]
        k += len(nodes)
    return out


def _argmax(logits: torch.Tensor) -> np.ndarray:
    """int64 ``[T]`` argmax of ``[T, vocab]`` logits (``max``: faster on the CPU, same ties)."""
    return logits.max(dim=-1).indices.cpu().numpy()
