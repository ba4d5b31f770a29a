"""One engine run for tests/test_e2e_distributed.py, in its own process (vLLM's
multiprocessing executor spawns workers, which needs a real ``__main__``).

    python tests/distributed_run.py MODEL SPEC_JSON|none TP mp|ray|none OUT_JSON

With ``ray`` it starts a local Ray instance that declares one ``vllm_cpu``
resource per worker and turns on our opt-in CPU fix
(``LOOKAHEAD_RAY_ON_CPU=1``).

Greedy, float32, eager; four token-id prompts (repetitive, so n-gram drafts
hit), each alone and then all together. Writes the token ids and, with
lookahead, every rank's lookahead statistics.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    base = [rng.randrange(512) for _ in range(40)]
    return [base * 3, base[::-1] * 2, base[5:] * 3, list(range(10, 90))]


def main(model: str, spec_text: str, tp: int, backend: str, out_path: str) -> None:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
    if backend == "ray":
        os.environ["LOOKAHEAD_RAY_ON_CPU"] = "1"
        import ray

        from vllm_lookahead.cpu.ray import RAY_CPU_RESOURCE

        ctx = ray.init(num_cpus=tp, resources={RAY_CPU_RESOURCE: tp}, include_dashboard=False)
        # vLLM's engine core runs in its own process: point it at this
        # instance, as a user points it at theirs.
        os.environ["RAY_ADDRESS"] = ctx.address_info["gcs_address"]
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = None if spec_text == "none" else json.loads(spec_text)
    llm = LLM(model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=2048, seed=0, kv_cache_memory_bytes=64 << 20,
              tensor_parallel_size=tp,
              distributed_executor_backend=None if backend == "none" else backend,
              speculative_config=spec)
    ps = [TokensPrompt(prompt_token_ids=t) for t in prompts()]
    sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    out = {
        "one": [list(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids) for p in ps],
        "batch": [list(o.outputs[0].token_ids) for o in llm.generate(ps, sp, use_tqdm=False)],
    }
    if spec is not None:
        from vllm_lookahead.patches import WORKER_STATS_METHOD

        # vLLM tells the workers about finished requests in the step after
        # they finish; the engine core runs that step on its own, so wait for
        # it (a few steps at most) before reading the per-request state.
        for _ in range(50):
            out["ranks"] = [s for s in llm.collective_rpc(WORKER_STATS_METHOD) if s]
            if all(r["live_requests"] == 0 for r in out["ranks"]):
                break
            time.sleep(0.1)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(out, f)
    sys.stdout.flush()
    os._exit(0)  # skip vLLM's slow teardown of the worker processes


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
