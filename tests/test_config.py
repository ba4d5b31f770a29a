"""Unit tests of the user-facing configuration (vllm_lookahead.config) and
of how a speculative config selects it (vllm_lookahead.spellings)."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_lookahead.config import (
    REMOVED,
    LookaheadConfig,
    LookaheadConfigError,
    RequestSettings,
    request_settings,
)
from vllm_lookahead.spellings import (
    METHOD,
    PASSTHROUGH_KEYS,
    PROPOSER_QUALNAME,
    is_lookahead,
    merge_spec_flags,
    split_speculative_config,
)

# Documented ranges (LookaheadConfig docstring). window_size = 0 turns the
# Jacobi branch off and needs prompt_pool.
RANGES = {
    "ngram_size": (2, 16),
    "window_size": (0, 64),
    "guess_set_size": (1, 64),
    "seed": (0, 2**63 - 1),
    "max_tree_tokens": (0, 1 << 20),
    "disable_batch_size": (0, 1 << 20),
    "memory_tokens": (256, 1 << 26),
    "lookup_len": (0, 64),
    "seeded_batch": (0, 1 << 20),
}


def _range_text(field):
    lo, hi = RANGES[field]
    return f"[{lo}, {hi}]"


def test_defaults_valid():
    cfg = LookaheadConfig()
    assert (cfg.ngram_size, cfg.window_size, cfg.guess_set_size) == (4, 3, 3)
    assert cfg.disable_batch_size is None  # never: the planner decides
    assert cfg.prompt_pool is True
    assert cfg.seed == 0
    assert cfg.learn_step_cost == "auto"  # learnt in buckets of 8 requests or more
    assert cfg.lookup_len == 0 and cfg.max_draft_len == cfg.ngram_size
    assert LookaheadConfig(lookup_len=16).max_draft_len == 16
    assert cfg.mode == "fused"
    assert cfg.adaptive is True
    assert cfg.cost_model == "auto"
    assert cfg.shared_memory is True and cfg.memory_tokens == 131072
    assert cfg.parent_latency is True
    assert cfg.seeded_batch == 0  # a seeded request's own n
    assert set(cfg.field_names()) == set(RANGES) | set(REMOVED) | {
        "prompt_pool", "mode", "adaptive", "cost_model", "shared_memory", "parent_latency",
        "learn_step_cost"}
    assert LookaheadConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("field", sorted(RANGES))
def test_range_bounds_accepted(field):
    lo, hi = RANGES[field]
    for v in (lo, hi):
        cfg = LookaheadConfig(**{field: v})
        assert getattr(cfg, field) == v


@pytest.mark.parametrize(
    "field,value",
    [
        ("ngram_size", 1),
        ("ngram_size", 0),
        ("ngram_size", 17),
        ("ngram_size", -4),
        ("window_size", -1),
        ("window_size", 65),
        ("guess_set_size", 0),
        ("guess_set_size", 65),
        ("seed", -1),
        ("seed", 2**63),
    ],
)
def test_out_of_range_rejected(field, value):
    with pytest.raises(LookaheadConfigError) as ei:
        LookaheadConfig(**{field: value})
    msg = str(ei.value)
    assert field in msg
    assert _range_text(field) in msg
    assert str(value) in msg


@pytest.mark.parametrize("field", sorted(RANGES))
@pytest.mark.parametrize("value", ["5", 5.0, True, False, None, [5]])
def test_wrong_type_rejected(field, value):
    if value is None and field == "disable_batch_size":
        assert LookaheadConfig(disable_batch_size=None).disable_batch_size is None  # = auto
        return
    with pytest.raises(LookaheadConfigError) as ei:
        LookaheadConfig(**{field: value})
    msg = str(ei.value)
    assert field in msg
    assert _range_text(field) in msg


@pytest.mark.parametrize("field", ["prompt_pool", "adaptive", "learn_step_cost"])
@pytest.mark.parametrize("value", [1, 0, "true", "yes", None, 1.0])
def test_bool_fields_must_be_bool(field, value):
    with pytest.raises(LookaheadConfigError) as ei:
        LookaheadConfig(**{field: value})
    msg = str(ei.value)
    assert field in msg
    assert "true/false" in msg or "bool" in msg


def test_learn_step_cost_takes_auto():
    assert LookaheadConfig(learn_step_cost="auto").learn_step_cost == "auto"
    for bad in ("Auto", "on", "", 8):
        with pytest.raises(LookaheadConfigError, match="learn_step_cost.*\"auto\""):
            LookaheadConfig(learn_step_cost=bad)


@pytest.mark.parametrize("value", ["auto", "measure", "off"])
def test_cost_model_keywords(value):
    assert LookaheadConfig(cost_model=value).cost_model == value


def test_cost_model_file(tmp_path):
    path = tmp_path / "curve.json"
    path.write_text("{}")
    assert LookaheadConfig(cost_model=str(path)).cost_model == str(path)


@pytest.mark.parametrize("value", ["", "fast", str(1), None, 3, "/no/such/file.json"])
def test_cost_model_bad_values_name_the_field(value):
    with pytest.raises(LookaheadConfigError, match="cost_model"):
        LookaheadConfig(cost_model=value)


def test_config_error_is_value_error():
    assert issubclass(LookaheadConfigError, ValueError)


def test_window_zero_needs_prompt_pool():
    assert LookaheadConfig(window_size=0, prompt_pool=True).window_size == 0
    with pytest.raises(LookaheadConfigError) as ei:
        LookaheadConfig(window_size=0, prompt_pool=False)
    assert "window_size" in str(ei.value) and "prompt_pool" in str(ei.value)


def test_from_dict_unknown_key():
    with pytest.raises(LookaheadConfigError) as ei:
        LookaheadConfig.from_dict({"ngram_size": 4, "lookahead_levels": 3})
    assert "lookahead_levels" in str(ei.value)


def test_frozen():
    cfg = LookaheadConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.ngram_size = 7  # type: ignore[misc]


# --------------------------------------------------------------------------
# split_speculative_config
# --------------------------------------------------------------------------


def test_is_lookahead():
    assert is_lookahead({"method": METHOD})
    assert not is_lookahead({"method": "ngram"})
    assert not is_lookahead({})
    assert not is_lookahead(None)
    assert not is_lookahead("lookahead")
    # The spellings that select ngram in vLLM 0.32, for lookahead.
    assert is_lookahead({"method": "[lookahead]"})
    assert is_lookahead({"model": "[lookahead]"})
    assert is_lookahead({"model": "lookahead", "ngram-size": 3})
    assert is_lookahead({"method": "lookahead", "model": "[lookahead]"})
    assert not is_lookahead({"model": "[ngram]"})
    assert not is_lookahead({"model": "some/lookahead-draft"})
    with pytest.raises(LookaheadConfigError, match="'ngram'"):
        is_lookahead({"method": "ngram", "model": "[lookahead]"})


class _Args:
    def __init__(self, spec_method=None, spec_model=None, spec_tokens=None):
        self.spec_method, self.spec_model, self.spec_tokens = spec_method, spec_model, spec_tokens


def test_merge_spec_flags_like_vllm_without_changing_the_input():
    spec = {"ngram_size": 3}
    merged, names = merge_spec_flags(spec, _Args(spec_model="[lookahead]", spec_tokens=2))
    assert merged == {"ngram_size": 3, "model": "[lookahead]", "num_speculative_tokens": 2}
    assert names == {"model": "--spec-model", "num_speculative_tokens": "--spec-tokens"}
    assert spec == {"ngram_size": 3}
    assert merge_spec_flags(None, _Args()) == (None, {})
    assert merge_spec_flags(None, object()) == (None, {})  # fields missing: none given
    assert merge_spec_flags(None, _Args(spec_method="lookahead"))[0] == {"method": "lookahead"}
    with pytest.raises(ValueError, match=r"--spec-tokens and --speculative-config\['num_speculative_tokens'\]"):
        merge_spec_flags({"num-speculative-tokens": 2}, _Args(spec_tokens=3))


def test_split_names_the_flag_a_bad_value_came_from():
    with pytest.raises(LookaheadConfigError, match="--spec-tokens must be an integer"):
        split_speculative_config({"model": "[lookahead]", "num_speculative_tokens": 0},
                                 {"num_speculative_tokens": "--spec-tokens"})
    with pytest.raises(LookaheadConfigError, match=r"speculative_config\['model'\] = 'x/y'"):
        split_speculative_config({"method": "lookahead", "model": "x/y"})
    out = split_speculative_config({"model": "[lookahead]", "window_size": 2})
    assert out.lookahead.window_size == 2 and out.vllm_kwargs["model"] == PROPOSER_QUALNAME


def test_split_minimal():
    spec = {"method": "lookahead"}
    out = split_speculative_config(spec)
    assert out.lookahead == LookaheadConfig()
    assert out.vllm_kwargs == {
        "method": "custom_class",
        "model": PROPOSER_QUALNAME,
        "num_speculative_tokens": LookaheadConfig().max_draft_len,
    }
    assert spec == {"method": "lookahead"}  # input not mutated


def test_proposer_qualname_importable_path():
    assert PROPOSER_QUALNAME == "vllm_lookahead.proposer.LookaheadProposer"


@pytest.mark.parametrize("n", [2, 3, 7, 16])
def test_split_num_spec_tokens_default_is_n(n):
    out = split_speculative_config({"method": "lookahead", "ngram_size": n, "lookup_len": 0})
    assert out.lookahead.ngram_size == n
    assert out.vllm_kwargs["num_speculative_tokens"] == n
    # our own keys are not passed on to vLLM
    assert "ngram_size" not in out.vllm_kwargs


@pytest.mark.parametrize("n", [2, 4, 6])
def test_split_num_spec_tokens_range(n):
    for k in range(1, n + 1):
        out = split_speculative_config(
            {"method": "lookahead", "ngram_size": n, "lookup_len": 0,
             "num_speculative_tokens": k}
        )
        assert out.vllm_kwargs["num_speculative_tokens"] == k
    for bad in (0, -1, n + 1, n + 10, "2", 2.0, True, 1.5):
        with pytest.raises(LookaheadConfigError) as ei:
            split_speculative_config(
                {"method": "lookahead", "ngram_size": n, "lookup_len": 0,
                 "num_speculative_tokens": bad}
            )
        msg = str(ei.value)
        assert "num_speculative_tokens" in msg
        assert f"[1, {n}] (max(ngram_size, lookup_len)" in msg


@pytest.mark.parametrize("n, look, k", [(4, 16, 16), (4, 0, 4), (4, 3, 4), (6, 24, 24),
                                        (16, 8, 16), (2, 64, 64)])
def test_split_num_spec_tokens_default_is_the_longest_draft(n, look, k):
    """vLLM's draft length defaults to the longest draft lookahead makes:
    a tree's N or an unchecked lookup's ``lookup_len``; it may be set
    lower, not higher."""
    out = split_speculative_config({"method": "lookahead", "ngram_size": n, "lookup_len": look})
    assert out.vllm_kwargs["num_speculative_tokens"] == k
    with pytest.raises(LookaheadConfigError, match=rf"\[1, {k}\]"):
        split_speculative_config({"method": "lookahead", "ngram_size": n, "lookup_len": look,
                                  "num_speculative_tokens": k + 1})


@pytest.mark.parametrize(
    "key", ["lookahead_level", "ngram", "model", "draft_tensor_parallel_size", "prompt_lookup_max"]
)
def test_split_unknown_key_rejected(key):
    with pytest.raises(LookaheadConfigError) as ei:
        split_speculative_config({"method": "lookahead", key: 3})
    assert key in str(ei.value)


def test_split_invalid_value_names_field():
    with pytest.raises(LookaheadConfigError) as ei:
        split_speculative_config({"method": "lookahead", "window-size": 100})
    assert "window_size" in str(ei.value)
    assert _range_text("window_size") in str(ei.value)


def test_split_dashed_keys():
    out = split_speculative_config(
        {
            "method": "lookahead",
            "ngram-size": 6,
            "window-size": 7,
            "guess-set-size": 8,
            "prompt-pool": False,
            "num-speculative-tokens": 3,
            "enforce-eager": True,
        }
    )
    assert out.lookahead == LookaheadConfig(
        ngram_size=6, window_size=7, guess_set_size=8, prompt_pool=False
    )
    assert out.vllm_kwargs["num_speculative_tokens"] == 3
    assert out.vllm_kwargs["enforce_eager"] is True
    assert not any("-" in k for k in out.vllm_kwargs)


@pytest.mark.parametrize(
    "key,value",
    [
        ("enforce_eager", True),
        ("rejection_sample_method", "standard"),
    ],
)
def test_split_passthrough_kept(key, value):
    assert key in PASSTHROUGH_KEYS
    out = split_speculative_config({"method": "lookahead", key: value, "seed": 3})
    assert out.vllm_kwargs[key] == value
    assert out.vllm_kwargs["method"] == "custom_class"
    assert out.vllm_kwargs["model"] == PROPOSER_QUALNAME
    assert out.lookahead.seed == 3
    assert "seed" not in out.vllm_kwargs


def test_split_cannot_override_method_or_model():
    out = split_speculative_config({"method": "lookahead", "enforce_eager": False})
    assert out.vllm_kwargs["method"] == "custom_class"
    with pytest.raises(LookaheadConfigError):
        split_speculative_config({"method": "lookahead", "model": "some/draft"})


# --------------------------------------------------------------------------
# PASSTHROUGH_KEYS against the installed vLLM
# --------------------------------------------------------------------------



def _spec_config_fields() -> set[str]:
    from vllm.config import SpeculativeConfig

    try:
        return {f.name for f in dataclasses.fields(SpeculativeConfig)}
    except TypeError:  # pydantic model that is not a dataclass
        return set(SpeculativeConfig.__dataclass_fields__)


@pytest.fixture(scope="module")
def spec_fields():
    return _spec_config_fields()


def test_speculative_config_fields_sanity(spec_fields):
    # the fields our own kwargs use must exist (and the lookup must work)
    assert {"method", "model", "num_speculative_tokens"} <= spec_fields


@pytest.mark.parametrize("key", sorted(PASSTHROUGH_KEYS))
def test_passthrough_keys_are_speculative_config_fields(key, spec_fields):
    assert key in spec_fields, (
        f"{key!r} is in PASSTHROUGH_KEYS but vLLM's SpeculativeConfig has no such field"
    )


@pytest.mark.parametrize("mode", ["fused", "separate"])
def test_mode_choices(mode):
    assert LookaheadConfig(mode=mode).mode == mode


@pytest.mark.parametrize("value", ["both", "", None, 1, "FUSED"])
def test_bad_mode_rejected(value):
    with pytest.raises(LookaheadConfigError) as ei:
        LookaheadConfig(mode=value)
    msg = str(ei.value)
    assert "mode" in msg and "fused" in msg and "separate" in msg


def test_split_carries_mode_and_load_settings():
    out = split_speculative_config(
        {"method": "lookahead", "mode": "separate", "max-tree-tokens": 64, "disable_batch_size": 8}
    )
    assert out.lookahead.mode == "separate"
    assert out.lookahead.max_tree_tokens == 64
    assert out.lookahead.disable_batch_size == 8
    assert "mode" not in out.vllm_kwargs


# -- per-request settings (SamplingParams.extra_args) -------------------------

ENGINE = LookaheadConfig(ngram_size=5, window_size=6, guess_set_size=4)


def test_request_settings_default_to_engine():
    assert RequestSettings() == request_settings(None, LookaheadConfig())
    for extra in (None, {}, {"other": 1}):
        s = request_settings(extra, ENGINE)
        assert s == RequestSettings(True, 5, 6, 4)


@pytest.mark.parametrize(
    "extra",
    [{"lookahead": False}, {"lookahead": {"enabled": False}}, {"lookahead_enabled": False},
     {"lookahead_enabled": 0}, {"lookahead_enabled": "false"}],
)
def test_request_can_turn_lookahead_off(extra):
    assert request_settings(extra, ENGINE).enabled is False


def test_request_can_lower_settings_nested_and_flat():
    s = request_settings({"lookahead": {"ngram_size": 3, "window_size": 0}}, ENGINE)
    assert (s.enabled, s.ngram_size, s.window_size, s.guess_set_size) == (True, 3, 0, 4)
    s = request_settings({"lookahead_guess_set_size": 1, "lookahead_ngram_size": 2}, ENGINE)
    assert (s.ngram_size, s.window_size, s.guess_set_size) == (2, 6, 1)
    s = request_settings({"lookahead": {"ngram_size": 5, "window_size": 6, "guess_set_size": 4}}, ENGINE)
    assert s == RequestSettings(True, 5, 6, 4)


@pytest.mark.parametrize(
    "extra,field,allowed",
    [
        ({"lookahead": {"ngram_size": 6}}, "ngram_size", "[2, 5]"),
        ({"lookahead": {"ngram_size": 1}}, "ngram_size", "[2, 5]"),
        ({"lookahead": {"window_size": 7}}, "window_size", "[0, 6]"),
        ({"lookahead": {"window_size": -1}}, "window_size", "[0, 6]"),
        ({"lookahead_guess_set_size": 0}, "guess_set_size", "[1, 4]"),
        ({"lookahead": {"guess_set_size": "2"}}, "guess_set_size", "[1, 4]"),
        ({"lookahead": {"ngram_size": True}}, "ngram_size", "[2, 5]"),
    ],
)
def test_bad_request_settings_name_the_field(extra, field, allowed):
    with pytest.raises(LookaheadConfigError) as ei:
        request_settings(extra, ENGINE)
    msg = str(ei.value)
    assert field in msg and allowed in msg and "extra_args" in msg


@pytest.mark.parametrize(
    "extra,needle",
    [
        ({"lookahead": {"window": 2}}, "window"),
        ({"lookahead_foo": 1}, "foo"),
        ({"lookahead": "off"}, "lookahead"),
        ({"lookahead": {"enabled": "no"}}, "enabled"),
    ],
)
def test_bad_request_keys_rejected(extra, needle):
    with pytest.raises(LookaheadConfigError) as ei:
        request_settings(extra, ENGINE)
    assert needle in str(ei.value)


def test_request_window_zero_needs_prompt_pool():
    engine = LookaheadConfig(prompt_pool=False)
    with pytest.raises(LookaheadConfigError, match="prompt_pool"):
        request_settings({"lookahead": {"window_size": 0}}, engine)
    assert request_settings({"lookahead": False}, engine).enabled is False


def test_removed_settings_fail_at_start_naming_what_replaced_them():
    assert set(REMOVED) == {"batch_end", "min_draft_p"}
    for name in REMOVED:
        assert name not in LookaheadConfig().to_dict()
        for value in (False, True, 0):
            with pytest.raises(LookaheadConfigError, match=f"'{name}'.* removed in 0.2.0: the "):
                split_speculative_config({"method": "lookahead", name: value})
            with pytest.raises(LookaheadConfigError, match=name):
                LookaheadConfig.from_dict({name: value})
