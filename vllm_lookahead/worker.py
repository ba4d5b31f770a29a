"""Runs the lookahead branch inside vLLM's model runner.

One batched, tree-masked forward of the *target* model over the trees of all
running requests. Every attention layer's ``impl`` is wrapped once by
:class:`TreeAttentionImpl`: during our pass (recognised by its metadata type)
it computes :func:`tree_attention` over the request's paged KV cache, read
only; during vLLM's own forwards it hands the call to the original impl
untouched. The pass sets an empty slot mapping, so vLLM's
``unified_kv_cache_update`` writes nothing: the verifier's KV stays exact.
"""

from __future__ import annotations

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
)

logger = init_logger(__name__)


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

    def __init__(self, inner, layer_name: str, group: int, layout: BlockLayout) -> None:
        self._inner = inner
        self._layer_name = layer_name
        self._group = group
        self._layout = layout

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        if not isinstance(attn_metadata, TreeAttnMetadata):
            return self._inner.forward(
                layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs
            )
        m = attn_metadata
        inner = self._inner
        softcap = float(getattr(inner, "logits_soft_cap", 0) or 0)
        window = getattr(inner, "sliding_window", -1)
        window = -1 if window is None else int(window)
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
                m.positions[s:e],
                inner.scale,
                sliding_window=window,
                softcap=softcap,
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
            layer.impl = TreeAttentionImpl(impl, name, group_of[name], layouts[key])
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

    @torch.inference_mode()
    def run(self, requests: list[TreeRequest]) -> list[np.ndarray]:
        """One tree-masked forward over all requests' trees.

        Returns, per request, int64 [T] the target's argmax at every node.
        """
        sizes = [len(r.tokens) for r in requests]
        ends = np.cumsum(sizes).tolist()
        starts = [e - s for e, s in zip(ends, sizes)]
        input_ids = torch.from_numpy(np.concatenate([r.tokens for r in requests]).astype(np.int32))
        positions = torch.from_numpy(np.concatenate([r.positions for r in requests]).astype(np.int64))
        per_req_blocks = [self.block_ids(r.batch_index, r.context_len) for r in requests]
        meta = TreeAttnMetadata(
            starts=starts,
            ends=ends,
            context_lens=[r.context_len for r in requests],
            masks=[torch.from_numpy(r.mask.copy()) for r in requests],
            positions=positions,
            gather={},
            block_ids=[[b[g] for b in per_req_blocks] for g in range(self.num_groups)],
        )
        model = self.runner.model
        total = int(ends[-1])
        with set_forward_context(meta, self.vllm_config, num_tokens=total, slot_mapping={}):
            hidden = model(input_ids=input_ids, positions=positions)
        logits = model.compute_logits(hidden)
        pred = logits.argmax(dim=-1).numpy()
        return [pred[s:e] for s, e in zip(starts, ends)]
