"""`method: "lookahead"` through vLLM's own entry points: accepted by
`EngineArgs` and `LLM`, and every bad setting fails at start-up with a message
that names the field."""

from __future__ import annotations

import pytest

from tests.engine_utils import engine, proposer

pytestmark = pytest.mark.e2e


def _engine_config(spec, tiny_model_path):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(tiny_model_path),
        skip_tokenizer_init=True,
        speculative_config=spec,
        kv_cache_memory_bytes=64 << 20,
    )
    return args, args.create_engine_config()


def test_engine_args_accept_lookahead(tiny_model_path):
    spec = {"method": "lookahead", "ngram_size": 3, "window_size": 2, "guess_set_size": 1}
    args, cfg = _engine_config(spec, tiny_model_path)
    sc = cfg.speculative_config
    assert sc.method == "custom_class"
    assert sc.model == "vllm_lookahead.proposer.LookaheadProposer"
    # the longest draft: a tree's (its confirmed (N-1)-gram + the next
    # token, N); an unchecked lookup of lookup_len (default 0: N) no longer
    assert sc.num_speculative_tokens == 3
    assert cfg.additional_config["lookahead"] == {
        "ngram_size": 3, "window_size": 2, "guess_set_size": 1, "prompt_pool": True, "seed": 0,
        "mode": "fused", "max_tree_tokens": 0, "disable_batch_size": None,
        "adaptive": True, "cost_model": "auto", "shared_memory": True, "memory_tokens": 131072,
        "lookup_len": 0, "parent_latency": True, "learn_step_cost": "auto",
        "seeded_batch": 0,
    }
    assert args.speculative_config == spec  # the user's dict is left as given


def test_defaults_are_documented_values(tiny_model_path):
    from vllm_lookahead.config import LookaheadConfig

    _, cfg = _engine_config({"method": "lookahead"}, tiny_model_path)
    assert cfg.additional_config["lookahead"] == LookaheadConfig().to_dict()


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"ngram_size": 1}, "ngram_size"),
        ({"ngram_size": 17}, "ngram_size"),
        ({"window_size": -1}, "window_size"),
        ({"guess_set_size": 0}, "guess_set_size"),
        ({"guess_set_size": "5"}, "guess_set_size"),
        ({"prompt_pool": "yes"}, "prompt_pool"),
        ({"num_speculative_tokens": 17, "ngram_size": 4}, "num_speculative_tokens"),
        ({"bogus": 1}, "bogus"),
        ({"prompt_lookup_max": 3}, "prompt_lookup_max"),
        ({"cost_model": "/no/such/curve.json"}, "cost_model"),
        ({"cost_model": 3}, "cost_model"),
        ({"min_draft_p": 2}, "min_draft_p"),
        ({"batch_end": False}, "batch_end"),
    ],
)
def test_bad_settings_fail_at_start_naming_the_field(spec, field, tiny_model_path):
    from vllm import LLM

    with pytest.raises(ValueError, match=field):
        LLM(str(tiny_model_path), skip_tokenizer_init=True,
            speculative_config={"method": "lookahead", **spec},
            kv_cache_memory_bytes=64 << 20)


def test_llm_runs_lookahead_on_tiny_model(tiny_model_path):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_lookahead.planner.cost_model import BATCH_LADDER

    spec = {"method": "lookahead", "ngram_size": 3, "window_size": 3, "guess_set_size": 2}
    with engine(tiny_model_path, spec, skip_tokenizer_init=True, max_num_seqs=4,
                kv_cache_memory_bytes=64 << 20) as llm:
        prompt = TokensPrompt(prompt_token_ids=list(range(10, 40)))
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32,
                                                    ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 32
        st = proposer(llm).get_stats()
        assert st["config"]["ngram_size"] == 3 and st["mode"] == "fused"
        # Whether trees run is the planner's call on this machine's measured
        # cost (the fixed-shape tests cover the tree itself).
        # The planner (on by default) planned every request-step, with a
        # step-cost curve measured at start-up or reused from the cache.
        assert sum(st["shape_steps"].values()) == sum(st["arm_steps"].values()) > 0
        # "measured-under-load": other processes kept the CPU busy while it
        # was timed (CI runners do), so it was used but not cached.
        assert st["cost_model"]["source"] in ("measured", "measured-under-load", "cached")
        assert st["cost_model"]["curve_ms"]["1"][0][0] == 1
        # vLLM's verifier timed with it, per kind of request and batch size:
        # (first draft token, each next one, the bonus row a rejected draft
        # saves, what a step pays once where any request drafts: 0 at batch
        # 1) (a cached curve holds it too: a cache without it is measured
        # anew)
        verify = st["cost_model"]["verify_ms"]
        assert set(verify) == {"sampled", "greedy", "seeded"}
        ladder = {str(b) for b in BATCH_LADDER if b <= 4}  # up to max_num_seqs=4
        for table in verify.values():
            assert set(table) == ladder
            assert all(len(v) == 4 and min(v) >= 0 for v in table.values())
            assert table["1"][3] == 0.0
        # greedy and seeded bonus rows are never skipped: no bonus credit
        assert all(v[2] == 0.0 for v in verify["greedy"].values())
        assert all(v[2] == 0.0 for v in verify["seeded"].values())
        # (Which kind costs more is a timing, measured in the benchmarks, not
        # asserted here: under load it can read either way.)
        # No hard-coded batch-size cutoff any more: the planner decides.
        assert st["disable_batch_size"] == 0
        prompts = [TokensPrompt(prompt_token_ids=list(range(10 + i, 40))) for i in range(3)]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                     use_tqdm=False)
        assert proposer(llm).get_stats()["steps_off"] == 0


def test_pipeline_parallel_fails_at_start_with_a_clear_message(tiny_model_path):
    """vLLM 0.32 crashes later with any speculative method and PP > 1 on CPU
    ('CPUModelRunner' object has no attribute 'drafter'); lookahead refuses
    it while the configuration is built, naming the setting."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(tiny_model_path), skip_tokenizer_init=True,
                      speculative_config={"method": "lookahead"},
                      pipeline_parallel_size=2, kv_cache_memory_bytes=64 << 20)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2") as ei:
        args.create_engine_config()
    assert "tensor_parallel_size" in str(ei.value)
