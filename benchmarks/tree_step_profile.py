"""Where the time of a fused lookahead step goes, per layer.

Runs SmolLM2 with a fixed lookahead tree (N, W, G = 4, 3, 3 by default; no
planner, so every step carries the tree) at batch size 1 on real prompts,
and times, inside the real engine:

* our tree attention per layer call (``TreeAttentionImpl._tree``: gathering
  the paged prefix, the SDPA over prefix + tree, writing the rows back);
* vLLM's own attention per layer call (its rows of the same step);
* both per query row (tree rows per fused step; vLLM's: the newest token
  plus the draft): the work grows with the rows, so this is the like-for-
  like figure of the two kernels;
* the whole engine step (wall time per output step, from vLLM's counters).

    .venv/bin/python benchmarks/tree_step_profile.py [--dtype bfloat16] [--tokens 64]

Prints a table and writes ``benchmarks/results/tree_step_profile.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--tree", default="4,3,3", help="N,W,G")
    p.add_argument("--prompts", type=int, default=2, help="HumanEval + MT-Bench prompts each")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out", default="benchmarks/results/tree_step_profile.json")
    return p.parse_args(argv)


class _Timer:
    def __init__(self):
        self.calls = 0
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        return timed

    def per_call_ms(self):
        return 1e3 * self.seconds / self.calls if self.calls else None


def profile(model: str, dtype: str, tree: tuple[int, int, int], prompts, tokens: int) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_lookahead import get_lookahead_stats, worker

    n, w, g = tree
    llm = LLM(model, dtype=dtype, enforce_eager=True, max_model_len=2048, seed=0,
              kv_cache_memory_bytes=512 << 20, max_num_seqs=4,
              speculative_config={"method": "lookahead", "ngram_size": n, "window_size": w,
                                  "guess_set_size": g, "adaptive": False})
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    ours, theirs = _Timer(), _Timer()
    impl_cls = worker.TreeAttentionImpl
    orig_tree = impl_cls._tree
    impl_cls._tree = ours.wrap(orig_tree)
    # vLLM's own attention of every wrapped layer (its rows of the step)
    wrapped = []
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    layers = runner.vllm_config.compilation_config.static_forward_context
    for layer in layers.values():
        impl = getattr(layer, "impl", None)
        if isinstance(impl, impl_cls):
            inner = impl._inner
            wrapped.append((inner, inner.forward))
            inner.forward = theirs.wrap(inner.forward)
    before = get_lookahead_stats(llm)
    t0 = time.perf_counter()
    outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    wall = time.perf_counter() - t0
    after = get_lookahead_stats(llm)
    impl_cls._tree = orig_tree
    for inner, fwd in wrapped:
        inner.forward = fwd
    steps = after["decode_steps"] - before["decode_steps"]
    tree_tokens = after["lookahead_query_tokens"] - before["lookahead_query_tokens"]
    fused = after["fused_steps"] - before["fused_steps"]
    drafted = after["draft_tokens"] - before["draft_tokens"]
    llm.llm_engine.engine_core.shutdown()
    n_layers = len(wrapped)
    return {
        "dtype": dtype, "tree": list(tree), "layers": n_layers,
        "steps": steps, "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "step_ms": 1e3 * wall / max(steps, 1),
        "tree_tokens_per_step": tree_tokens / max(fused, 1),
        "tree_attention_ms_per_layer": ours.per_call_ms(),
        "tree_attention_ms_per_step": 1e3 * ours.seconds / max(fused, 1),
        "vllm_attention_ms_per_layer": theirs.per_call_ms(),
        # vLLM's own query rows per step: the newest token plus the draft
        "vllm_rows_per_step": 1 + drafted / max(steps, 1),
        "tree_attention_us_per_row_layer":
            1e3 * ours.per_call_ms() / max(tree_tokens / max(fused, 1), 1e-9),
        "vllm_attention_us_per_row_layer":
            1e3 * theirs.per_call_ms() / (1 + drafted / max(steps, 1)),
    }


def main(argv=None) -> int:
    args = _parse(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer
    from vllm.inputs import TokensPrompt

    from vllm_lookahead.tools import chat_prompts, load_humaneval, load_mtbench, prepare_smollm2
    from vllm_lookahead.planner.cost_model import hardware_id

    model = str(prepare_smollm2())
    tok = AutoTokenizer.from_pretrained(model)
    texts = load_humaneval(args.prompts) + chat_prompts(tok, load_mtbench(args.prompts))
    prompts = [TokensPrompt(prompt_token_ids=tok(t, add_special_tokens=False)["input_ids"])
               for t in texts]
    tree = tuple(int(x) for x in args.tree.split(","))
    rows = [profile(model, d, tree, prompts, args.tokens) for d in args.dtype]
    hw = hardware_id()
    print(f"\nfused lookahead step, SmolLM2-135M, batch 1, tree N,W,G = {args.tree}; "
          f"CPU: {hw.get('cpu')}; LD_PRELOAD={os.environ.get('LD_PRELOAD', '') or '(none)'}")
    print(f"{'dtype':10s}{'step ms':>9s}{'tree tok':>9s}{'vLLM tok':>9s}"
          f"{'tree attn ms/layer':>20s}{'tree attn ms/step':>19s}{'vLLM attn ms/layer':>20s}"
          f"{'tree us/row':>13s}{'vLLM us/row':>13s}")
    for r in rows:
        print(f"{r['dtype']:10s}{r['step_ms']:9.1f}{r['tree_tokens_per_step']:9.1f}"
              f"{r['vllm_rows_per_step']:9.1f}"
              f"{r['tree_attention_ms_per_layer']:20.3f}{r['tree_attention_ms_per_step']:19.1f}"
              f"{r['vllm_attention_ms_per_layer']:20.3f}"
              f"{r['tree_attention_us_per_row_layer']:13.1f}"
              f"{r['vllm_attention_us_per_row_layer']:13.1f}")
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"hardware": hw, "ld_preload": os.environ.get("LD_PRELOAD", ""),
                                "rows": rows}, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
