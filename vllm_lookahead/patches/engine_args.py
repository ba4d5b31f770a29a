"""Patches of vLLM's engine arguments: the ``lookahead`` spellings, CLI flags,
request validation."""

from __future__ import annotations

from vllm.exceptions import VLLMValidationError

from vllm_lookahead.patches.registry import wraps

#: Our second name of vLLM's ``--spec-model`` (vLLM's old spelling).
SPECULATIVE_MODEL_FLAG = "--speculative-model"


class LookaheadRequestError(VLLMValidationError, ValueError):
    """A request's bad lookahead setting: vLLM's validation error (HTTP 400)."""


@wraps("vllm.engine.arg_utils:EngineArgs.create_speculative_config", "engine args",
       "Every spelling that selects lookahead (`method`, `--spec-method`, `model=\"[lookahead]\"`) "
       "becomes vLLM's `custom_class` with our proposer; our keys are validated into "
       "`LookaheadConfig` and carried in `additional_config`; pipeline parallelism refused.")
def lookahead_method(orig, self, *args, **kwargs):
    from vllm_lookahead.config import ADDITIONAL_CONFIG_KEY, LookaheadConfigError
    from vllm_lookahead.spellings import (SPEC_FLAGS, is_lookahead, merge_spec_flags,
                                          split_speculative_config)

    spec = self.speculative_config
    merged, names = merge_spec_flags(spec, self)
    if not is_lookahead(merged):
        return orig(self, *args, **kwargs)
    split = split_speculative_config(merged, names)
    pp = getattr(self, "pipeline_parallel_size", 1) or 1
    if pp > 1:
        raise LookaheadConfigError(
            f"speculative_config['method'] = 'lookahead' does not support pipeline_parallel_size"
            f"={pp}: vLLM 0.32 runs speculative decoding on a single pipeline stage only. "
            "Use tensor_parallel_size instead.")
    self.additional_config = {**(self.additional_config or {}),
                              ADDITIONAL_CONFIG_KEY: split.lookahead.to_dict()}
    flags = {attr: getattr(self, attr, None) for _, _, attr in SPEC_FLAGS}
    self.speculative_config = dict(split.vllm_kwargs)
    for attr in flags:  # merged above; vLLM must not merge them again
        setattr(self, attr, None)
    try:
        return orig(self, *args, **kwargs)
    finally:
        self.speculative_config = spec
        for attr, value in flags.items():
            setattr(self, attr, value)


@wraps("vllm.engine.arg_utils:EngineArgs.add_cli_args", "engine args",
       "`--spec-method` also accepts `lookahead`; `--speculative-model` is a second name of "
       "`--spec-model` (reaches `vllm serve`: plugins load before its parser).")
def cli_spellings(orig, parser, *args, **kwargs):
    from vllm_lookahead.spellings import METHOD

    parser = orig(parser, *args, **kwargs)
    actions = parser._option_string_actions
    method = actions.get("--spec-method")
    if method is not None and method.choices is not None and METHOD not in method.choices:
        method.choices = [*method.choices, METHOD]  # a copy: vLLM caches its list
    model = actions.get("--spec-model")
    if model is not None and SPECULATIVE_MODEL_FLAG not in actions:
        model.option_strings.append(SPECULATIVE_MODEL_FLAG)
        actions[SPECULATIVE_MODEL_FLAG] = model
        model.help = f"{model.help or ''} \"[lookahead]\" selects lookahead decoding."
    return parser


@wraps("vllm.v1.engine.input_processor:InputProcessor._validate_params", "requests",
       "A request's lookahead settings (`SamplingParams.extra_args`) are checked on arrival: "
       "a bad value is that request's error (HTTP 400).")
def validate_request_settings(orig, self, params, *args, **kwargs):
    from vllm.sampling_params import SamplingParams

    from vllm_lookahead.config import (ADDITIONAL_CONFIG_KEY, LookaheadConfig,
                                       LookaheadConfigError, request_settings)

    result = orig(self, params, *args, **kwargs)
    extra = params.extra_args if isinstance(params, SamplingParams) else None
    engine = (self.vllm_config.additional_config or {}).get(ADDITIONAL_CONFIG_KEY)
    if extra and engine is not None:
        try:
            request_settings(extra, LookaheadConfig.from_dict(engine))
        except LookaheadConfigError as e:
            raise LookaheadRequestError(str(e), parameter="extra_args") from None
    return result
