"""The lookahead branch's tree attention on a GPU's KV-cache layouts: checked, then timed.

Pure torch (plus numpy); runs where vLLM is not installed (vLLM's two names
that ``vllm_lookahead.worker`` imports at its top are then stubbed, see
:func:`worker_module`). The per-layer cache views a CUDA engine hands the
branch are rebuilt the way vLLM 0.32 makes them (``create_kv_cache_views``
in ``vllm/v1/kv_cache_interface.py``: a strided view of one shared buffer
per layer, for every ``KVCacheLayout``; tests/test_gpu_tree_check.py holds
them equal to vLLM's own) and filled by a torch writer of the
FlashAttention packing. Then, on ``--device``:

1. correctness, per layout and dtype (float32, bfloat16, and float16 on
   CUDA): the layout probe finds the ``split`` packing; the gather reads
   back exactly what was written (other layers untouched); the worker's
   batched tree attention (``TreeAttentionImpl._tree``) equals the
   per-request reference ``tree_attention`` in float32 (float32: 1e-5 on
   the CPU, 2e-4 on CUDA with TF32 off; bfloat16/float16: 2e-2); every
   tensor it makes is on the device;
2. timing (``--no-time`` skips it), per layer, Llama-3-8B's attention
   (32 query heads, 8 KV heads, head 128, block 16, bfloat16, LBNHC) with
   the default tree: ``_tree`` against one decode row per request through
   ``scaled_dot_product_attention`` over its contiguous prefix, a proxy for
   vLLM's FlashAttention paged decode (not vLLM's kernel).

    python3 benchmarks/gpu_tree_check.py [--device cuda] [--out DIR] [--no-time]

Prints a table, writes ``DIR/gpu_tree_check.json``; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run from a checkout, the package not installed
    sys.path.insert(0, str(REPO))

from vllm_lookahead.attn_mask import build_tree  # noqa: E402
from vllm_lookahead.config import LookaheadConfig  # noqa: E402
from vllm_lookahead.branch.kv_layout import gather_pages, probe_page_layout  # noqa: E402
from vllm_lookahead.planner.machine import hardware_id  # noqa: E402

#: vLLM 0.32's ``KVCacheLayout`` (vllm/v1/kv_cache_layout.py): the physical
#: order, outermost first, of the logical ``[L, B, H, N, C]`` axes.
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
#: the correctness checks' cache: layers, blocks, KV heads, block size, head size; query heads
LAYERS, NB, KVH, BS, HD, H = 3, 12, 2, 16, 128, 8
#: requests of the tree checks: (context length, block ids, tree (N, W, G))
MIXED = [(37, [3, 0, 9], (4, 3, 2)), (5, [7], (3, 2, 0)), (60, [1, 4, 8, 11], (2, 4, 3))]
#: (tree sizes, sliding window, softcap)
TREE_CASES = [("uniform", -1, 0.0), ("mixed", -1, 0.0), ("mixed", 40, 5.0)]
#: timing: Llama-3-8B's attention
T_H, T_KVH, T_HD, T_BS = 32, 8, 128, 16
#: the project's default tree (N, W, G)
TREE = (LookaheadConfig.ngram_size, LookaheadConfig.window_size, LookaheadConfig.guess_set_size)


def worker_module() -> types.ModuleType:
    """``vllm_lookahead.worker``. Where vLLM cannot be imported, its two
    top-level vLLM imports are stubbed first (``_tree`` uses neither): a
    no-op ``set_forward_context`` and ``init_logger = logging.getLogger``."""
    try:
        import vllm.forward_context  # noqa: F401
        import vllm.logger  # noqa: F401
    except ImportError:
        @contextlib.contextmanager
        def set_forward_context(*args, **kwargs):
            yield

        for name, attrs in (("vllm.forward_context", {"set_forward_context": set_forward_context}),
                            ("vllm.logger", {"init_logger": logging.getLogger})):
            stub = types.ModuleType(name)  # stub, only where vLLM is not importable
            stub.__dict__.update(attrs)
            sys.modules.setdefault(name, stub)
    from vllm_lookahead import worker

    return worker


def layer_views(buffer: torch.Tensor, order: tuple[int, ...], num_layers: int, num_blocks: int,
                kv_heads: int, block_size: int, head_size: int) -> list[torch.Tensor]:
    """Per-layer ``[num_blocks, kv_heads, block_size, 2 * head_size]`` views of
    one flat ``buffer`` (>= their total numel), as vLLM's
    ``create_kv_cache_views`` makes them for the layout of physical axis
    ``order``: the logical ``[L, B, H, N, C]`` strides (``compute_layout_strides``,
    unpadded, in elements: C is innermost in every layout), one view per layer."""
    shape = (num_layers, num_blocks, kv_heads, block_size, 2 * head_size)
    strides = [0] * 5
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= shape[dim]
    return list(buffer.as_strided(shape, strides, buffer.storage_offset()).unbind(0))


class FlashWriter:
    """``reshape_and_cache_flash`` in torch: K into ``C[:D]``, V into ``C[D:]``
    of the logical ``[B, H, N, C]`` cache, any strides; ``k``, ``v``
    ``[tokens, H, D]`` (any device), ``slots`` int ``[tokens]``."""

    def __init__(self, head_size: int) -> None:
        self.head_size = head_size

    def __call__(self, k, v, cache, slots):
        kc, vc = cache.transpose(1, 2).split(self.head_size, dim=-1)  # [B, N, H, D]
        slots = slots.to(cache.device).long()
        b, t = slots // cache.shape[2], slots % cache.shape[2]
        kc[b, t] = k.to(cache.device, cache.dtype)
        vc[b, t] = v.to(cache.device, cache.dtype)


def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   ctx_key: torch.Tensor, ctx_value: torch.Tensor, tree_mask: torch.Tensor,
                   positions: torch.Tensor, scale: float, sliding_window: int = -1,
                   softcap: float = 0.0) -> torch.Tensor:
    """The plain one-request reference of the tree attention: ``query``
    ``[T, H, D]`` and the tree's ``key``, ``value`` ``[T, KVH, D]`` over the
    cached ``ctx_key``, ``ctx_value`` ``[KVH, L, D]`` (positions 0..L-1) and
    the tree (``tree_mask`` bool ``[T, T]``, ``positions`` ``[T]``);
    ``sliding_window`` > 0: each query sees that many last positions, itself
    included. ``[T, H, D]`` in the query's dtype."""
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
    scores = torch.matmul(query.transpose(0, 1).float(), k.transpose(1, 2)) * scale
    if softcap and softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [H, T, D]
    return out.transpose(0, 1).to(query.dtype)


def gather_sequence(cache: torch.Tensor, block_ids, length: int, layout):
    """Dense K and V ``[H, length, D]`` of one sequence in ``block_ids``
    (``kv_layout.gather_pages`` over its blocks)."""
    bs, kvh, hd = layout.block_size, layout.num_kv_heads, layout.head_size
    nb = max(-(-length // bs), 1)
    ids = torch.as_tensor(block_ids[:nb], dtype=torch.int64, device=cache.device).view(1, nb)
    k = torch.empty(1, kvh, nb * bs, hd, dtype=cache.dtype, device=cache.device)
    v = torch.empty_like(k)
    gather_pages(cache, ids, layout, k, v)
    return k[0, :, :length], v[0, :, :length]


def slots(block_ids, length: int, bs: int) -> torch.Tensor:
    """int64 ``[length]`` flat cache slots of a sequence's tokens in ``block_ids``."""
    t = torch.arange(length)
    return (torch.as_tensor(block_ids, dtype=torch.int64)[t // bs] * bs + t % bs).long()


def step_meta(reqs, offset: int, bs: int, device="cpu"):
    """The step's ``TreeAttnMetadata``: ``reqs`` (context length, block ids,
    (N, W, G)), tree rows from ``offset``; and the rows' end."""
    starts, ends, lens, masks, pos, blocks = [], [], [], [], [], []
    row = offset
    for length, blk, (n, w, g) in reqs:
        tree = build_tree(n, w, g)
        starts.append(row)
        row += tree.num_nodes
        ends.append(row)
        lens.append(length)
        masks.append(tree.mask.copy())
        pos.append(length + tree.depth.astype(np.int64))
        blocks.append(np.append(np.asarray(blk, dtype=np.int64), 0))  # tables are padded
    meta = worker_module().TreeAttnMetadata(
        starts=starts, ends=ends, context_lens=lens, masks=masks,
        positions=np.concatenate(pos), blocks=[(bs, blocks)], device=torch.device(device),
        offset=offset)
    return meta, row


def tree_meta(reqs, offset, cache_writer, cache, bs, device="cpu"):
    """Write each request's random prefix (global torch RNG, CPU) into
    ``cache`` with ``cache_writer`` and build the step's metadata
    (:func:`step_meta`): ``(meta, rows' end, per request float32 CPU (K,
    V) [length, KVH, D])``."""
    kvh, hd = cache.shape[1], cache_writer.head_size
    prefixes = []
    for length, blk, _ in reqs:
        k = torch.randn(length, kvh, hd).to(cache.dtype)
        v = torch.randn(length, kvh, hd).to(cache.dtype)
        cache_writer(k, v, cache, slots(blk, length, bs))
        prefixes.append((k.float(), v.float()))
    meta, row = step_meta(reqs, offset, bs, device)
    return meta, row, prefixes


def _max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference (inf where either is NaN)."""
    d = (a.float() - b.float()).abs().nan_to_num(nan=float("inf"))
    return float(d.max()) if d.numel() else 0.0


def check(device: torch.device, layout: str, dtype: torch.dtype) -> list[dict]:
    """Probe, gather and tree checks on ``layout``'s layer-1 and layer-2 views
    of ``dtype``: one dict per check (``passed``, ``max_err``, ``tol``)."""
    row = {"layout": layout, "dtype": str(dtype).removeprefix("torch.")}
    g = torch.Generator().manual_seed(0)
    numel = LAYERS * NB * KVH * BS * 2 * HD
    buffer = torch.randn(numel, generator=g).to(device, dtype)  # garbage where nothing is written
    views = layer_views(buffer, LAYOUTS[layout], LAYERS, NB, KVH, BS, HD)
    cache, writer = views[1], FlashWriter(HD)
    lay = probe_page_layout(cache, HD, writer)
    out = [{**row, "check": "probe", "passed": lay.name == "split" and lay.k_off.device == device,
            "found": lay.name}]

    before = [views[0].clone(), views[2].clone()]
    err, ok = 0.0, True
    for length, blocks in [(40, [5, 1, 6]), (16, [3]), (17, [0, 7]), (1, [2])]:
        k = torch.randn(length, KVH, HD, generator=g).to(device, dtype)
        v = torch.randn(length, KVH, HD, generator=g).to(device, dtype)
        writer(k, v, cache, slots(blocks, length, BS))
        gk, gv = gather_sequence(cache, torch.tensor(blocks + [0]), length, lay)
        err = max(err, _max_err(gk, k.transpose(0, 1)), _max_err(gv, v.transpose(0, 1)))
        ok &= gk.device == gv.device == device
    ok &= torch.equal(views[0], before[0]) and torch.equal(views[2], before[1])
    out.append({**row, "check": "gather", "passed": ok and err == 0.0, "max_err": err, "tol": 0.0})

    torch.manual_seed(1)
    tol = 1e-5 if dtype == torch.float32 and device.type == "cpu" else (
        2e-4 if dtype == torch.float32 else 2e-2)
    offset = 5  # fused: the tree rows follow vLLM's own rows
    for sizes, window, softcap in TREE_CASES:
        reqs = MIXED if sizes == "mixed" else [(n, b, TREE) for n, b, _ in MIXED]
        meta, total, prefixes = tree_meta(reqs, offset, writer, views[2], BS, device)
        query = torch.randn(total, H, HD).to(device, dtype)
        key = torch.randn(total, KVH, HD).to(device, dtype)
        value = torch.randn(total, KVH, HD).to(device, dtype)
        inner = SimpleNamespace(scale=HD**-0.5, logits_soft_cap=softcap, sliding_window=window)
        impl = worker_module().TreeAttentionImpl(inner, "layer", 0, lay, owner=None)
        res = torch.full((total, H, HD), 7.0, dtype=dtype, device=device)
        res = impl._tree(meta, query, key, value, views[2], res)
        ok = (res.device == meta.pages(0)[0].device == meta.float_mask(0, window, dtype).device
              == device and bool(torch.all(res[:offset] == 7.0)))  # vLLM's rows left alone
        err = 0.0
        for r, (s, e) in enumerate(zip(meta.starts, meta.ends)):
            ck, cv = (p.to(device).transpose(0, 1) for p in prefixes[r])
            ref = tree_attention(query[s:e].float(), key[s:e].float(), value[s:e].float(), ck, cv,
                                 torch.from_numpy(meta.masks[r]),
                                 torch.from_numpy(meta.positions[s - offset:e - offset]),
                                 inner.scale, sliding_window=window, softcap=softcap)
            err = max(err, _max_err(res[s:e], ref))
        out.append({**row, "check": f"tree {sizes} window={window} softcap={softcap}",
                    "passed": ok and err <= tol, "max_err": err, "tol": tol})
    return out


def run_checks(device: torch.device) -> list[dict]:
    """Every layout and dtype's checks (an exception is a failed check); on
    the CPU on one thread (tiny matmuls: several OpenMP threads on a loaded
    machine are many times slower)."""
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if device.type == "cuda" else [])
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    out = []
    try:
        for layout in LAYOUTS:
            for dtype in dtypes:
                try:
                    out += check(device, layout, dtype)
                except Exception as e:  # noqa: BLE001 -- reported, the other checks still run
                    out.append({"layout": layout, "dtype": str(dtype).removeprefix("torch."),
                                "check": "error", "passed": False, "error": repr(e)})
    finally:
        torch.set_num_threads(threads)
    return out


def median_ms(fn, device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median wall time of ``fn()`` in ms (CUDA events on CUDA)."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    torch.cuda.synchronize(device)
    events = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        events.append((a, b))
    torch.cuda.synchronize(device)
    return statistics.median(a.elapsed_time(b) for a, b in events)


def layer_step(device: torch.device, batch: int, context: int):
    """One layer's tree-attention call for ``batch`` requests of ``context``
    cached tokens (scattered blocks, LBNHC, bfloat16): ``(run, meta)``,
    ``run()`` being ``TreeAttentionImpl._tree`` on random rows."""
    nblk = -(-context // T_BS)
    dt = torch.bfloat16
    buffer = torch.randn(batch * nblk * T_KVH * T_BS * 2 * T_HD, device=device, dtype=dt)
    cache = layer_views(buffer, LAYOUTS["LBNHC"], 1, batch * nblk, T_KVH, T_BS, T_HD)[0]
    lay = probe_page_layout(cache, T_HD, FlashWriter(T_HD))
    ids = np.random.default_rng(0).permutation(batch * nblk).reshape(batch, nblk)
    meta, total = step_meta([(context, list(b), TREE) for b in ids], batch, T_BS, device)
    q = torch.randn(total, T_H, T_HD, device=device, dtype=dt)
    kv = torch.randn(total, T_KVH, T_HD, device=device, dtype=dt)
    out = torch.empty_like(q)
    inner = SimpleNamespace(scale=T_HD**-0.5, logits_soft_cap=0.0, sliding_window=-1)
    impl = worker_module().TreeAttentionImpl(inner, "layer", 0, lay, owner=None)
    return (lambda: impl._tree(meta, q, kv, kv, cache, out)), meta


def time_layer(device: torch.device, batch: int, context: int, iters: int) -> dict:
    """:func:`layer_step` timed, and the decode proxy beside it."""
    run, meta = layer_step(device, batch, context)
    tree_ms = median_ms(run, device, iters)
    q1 = torch.randn(batch, T_H, 1, T_HD, device=device, dtype=torch.bfloat16)
    k1 = torch.randn(batch, T_KVH, context, T_HD, device=device, dtype=torch.bfloat16)
    decode_ms = median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
        q1, k1, k1, scale=T_HD**-0.5, enable_gqa=True), device, iters)
    rows = meta.t_max
    return {"batch": batch, "context": context, "tree": list(TREE), "tree_rows": rows,
            "tree_ms": tree_ms, "decode_sdpa_ms": decode_ms, "ratio": tree_ms / decode_ms,
            "tree_us_per_row": 1e3 * tree_ms / (batch * rows)}


#: timing: Llama-3-8B's linear layers (hidden, intermediate)
T_HIDDEN, T_INTER = 4096, 14336


def step_cost(device: torch.device, batch: int, context: int, iters: int) -> dict:
    """What the default tree adds to one decoder layer's step, Llama-3-8B's
    shapes, bfloat16, random weights: a plain step is ``batch`` rows through
    the layer's linear layers (QKV, O, gate/up, down) and one decode row's
    attention each (the SDPA proxy); a fused tree step is ``batch * (1 +
    tree rows)`` rows through the same linear layers, the same decode
    attention and :func:`layer_step`'s tree attention. Each part is timed on
    its own (eager, one stream; norms, rotary embeddings and activations
    left out) and the parts added up."""
    dt = torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)
    ws = [torch.randn(o, i, device=device, dtype=dt, generator=g) * i**-0.5
          for o, i in ((T_H * T_HD + 2 * T_KVH * T_HD, T_HIDDEN), (T_HIDDEN, T_H * T_HD),
                       (2 * T_INTER, T_HIDDEN), (T_HIDDEN, T_INTER))]

    def linears(rows: int):
        x = torch.randn(rows, T_HIDDEN, device=device, dtype=dt)
        h = torch.randn(rows, T_H * T_HD, device=device, dtype=dt)
        m = torch.randn(rows, T_INTER, device=device, dtype=dt)

        def run():
            torch.nn.functional.linear(x, ws[0])
            torch.nn.functional.linear(h, ws[1])
            torch.nn.functional.linear(x, ws[2])
            torch.nn.functional.linear(m, ws[3])
        return run

    tree, meta = layer_step(device, batch, context)
    q1 = torch.randn(batch, T_H, 1, T_HD, device=device, dtype=dt)
    k1 = torch.randn(batch, T_KVH, context, T_HD, device=device, dtype=dt)
    decode = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
        q1, k1, k1, scale=T_HD**-0.5, enable_gqa=True)
    rows = meta.t_max
    lin1 = median_ms(linears(batch), device, iters)
    lin_t = median_ms(linears(batch * (1 + rows)), device, iters)
    dec = median_ms(decode, device, iters)
    tre = median_ms(tree, device, iters)
    plain, fused = lin1 + dec, lin_t + dec + tre
    return {"batch": batch, "context": context, "tree_rows": rows,
            "linear_plain_ms": lin1, "linear_tree_ms": lin_t, "decode_ms": dec,
            "tree_attention_ms": tre, "plain_step_ms": plain, "tree_step_ms": fused,
            "tree_step_over_plain": fused / plain}


def profile_layer(device: torch.device, batch: int, context: int, iters: int = 10) -> str:
    """torch.profiler's table (by device time) of :func:`layer_step`."""
    from torch.profiler import ProfilerActivity, profile

    run, _ = layer_step(device, batch, context)
    for _ in range(3):
        run()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(iters):
            run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    return (f"{iters} calls, batch {batch}, context {context}\n"
            + prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=60))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="benchmarks/results", help="folder of gpu_tree_check.json")
    p.add_argument("--no-time", action="store_true", help="correctness checks only")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--iters", type=int, default=20, help="timed runs per median")
    p.add_argument("--step-cost", action="store_true",
                   help="also time a whole decoder layer's step with and without the "
                        "tree (step_cost) at --batches x --contexts")
    p.add_argument("--profile", type=int, nargs=2, metavar=("BATCH", "CONTEXT"), default=None,
                   help="also write torch.profiler's table of one such layer call to "
                        "DIR/gpu_tree_profile.txt")
    return p.parse_args(argv)


def _vllm_importable() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv=None) -> int:
    args = _parse(argv)
    device = torch.empty(0, device=args.device).device
    if device.type == "cuda":  # fp32 checks in full fp32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        name = torch.cuda.get_device_name(device)
    else:
        name = hardware_id().get("cpu", "unknown CPU")
    t0 = time.perf_counter()
    with torch.inference_mode():
        checks = run_checks(device)
    check_s = time.perf_counter() - t0
    passed = all(c["passed"] for c in checks)
    print(f"\ntree attention on vLLM 0.32's KV-cache layouts; device {device} ({name}), "
          f"torch {torch.__version__}")
    for c in checks:
        err = f"max err {c['max_err']:.2e} (tol {c['tol']:.0e})" if "max_err" in c else \
            c.get("found", c.get("error", ""))
        print(f"  {'ok  ' if c['passed'] else 'FAIL'} {c['layout']:6s} {c['dtype']:9s} "
              f"{c['check']:34s} {err}")
    print(f"{sum(c['passed'] for c in checks)}/{len(checks)} checks passed in {check_s:.1f} s",
          flush=True)
    with torch.inference_mode():
        rows = [] if args.no_time else [time_layer(device, b, c, args.iters)
                                        for c in args.contexts for b in args.batches]
    if rows:
        print("\nper layer, bfloat16, Llama-3-8B attention (32 q / 8 kv heads, head 128, "
              "block 16), LBNHC; 'decode' = SDPA of 1 row per request over its contiguous "
              "prefix, a proxy for FlashAttention's paged decode, NOT vLLM's kernel")
        print(f"{'batch':>6s}{'context':>8s}{'tree rows':>10s}{'tree ms':>10s}"
              f"{'decode ms':>11s}{'tree/decode':>12s}{'tree us/row':>12s}")
        for r in rows:
            print(f"{r['batch']:6d}{r['context']:8d}{r['tree_rows']:10d}{r['tree_ms']:10.3f}"
                  f"{r['decode_sdpa_ms']:11.3f}{r['ratio']:12.2f}{r['tree_us_per_row']:12.2f}")
    steps = []
    if args.step_cost and not args.no_time:
        with torch.inference_mode():
            steps = [step_cost(device, b, c, args.iters)
                     for c in args.contexts for b in args.batches]
        print("\none decoder layer, Llama-3-8B shapes, bfloat16, random weights, eager: "
              "the linear layers and attention of a plain step and of a fused step with "
              "the default tree (parts timed apart and added)")
        print(f"{'batch':>6s}{'context':>8s}{'plain ms':>10s}{'tree ms':>10s}{'ratio':>8s}"
              f"{'lin 1':>8s}{'lin 1+T':>9s}{'decode':>8s}{'tree att':>10s}")
        for r in steps:
            print(f"{r['batch']:6d}{r['context']:8d}{r['plain_step_ms']:10.3f}"
                  f"{r['tree_step_ms']:10.3f}{r['tree_step_over_plain']:8.2f}"
                  f"{r['linear_plain_ms']:8.3f}{r['linear_tree_ms']:9.3f}{r['decode_ms']:8.3f}"
                  f"{r['tree_attention_ms']:10.3f}")
    path = Path(args.out) / "gpu_tree_check.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "device": str(device), "device_name": name, "torch": torch.__version__,
        "cuda": torch.version.cuda, "vllm_importable": _vllm_importable(),
        "passed": passed, "check_seconds": check_s, "checks": checks,
        "timing_note": "median of --iters runs after 3 warm-up runs, per layer; decode_sdpa_ms: "
                       "torch SDPA of one query row per request over a contiguous prefix, a "
                       "proxy for FlashAttention's paged decode, not vLLM's kernel",
        "timing": rows, "step_cost": steps}, indent=2))
    print(f"wrote {path}")
    if args.profile:
        with torch.inference_mode():
            table = profile_layer(device, *args.profile)
        (Path(args.out) / "gpu_tree_profile.txt").write_text(table)
        print(table)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
