"""vLLM plugin entry point (``vllm.general_plugins``), called in every vLLM process: on a
supported vLLM it applies :mod:`vllm_lookahead.patches`, on any other it makes
``method="lookahead"`` fail with a clear message."""

from __future__ import annotations

import logging
import os

#: vLLM releases this plugin is built and tested against.
SUPPORTED_VLLM_VERSIONS = ("0.32.0",)

logger = logging.getLogger("vllm.vllm_lookahead")
#: A removed setting: the Ray executor on vLLM's CPU platform.
RAY_ON_CPU_ENV = "LOOKAHEAD_RAY_ON_CPU"


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "unknown")


def is_supported(version: str) -> bool:
    return version.split("+", 1)[0] in SUPPORTED_VLLM_VERSIONS


def unsupported_message(version: str) -> str:
    return (f"vllm-lookahead supports vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)}, but vLLM "
            f"{version} is installed; install a supported build "
            "(`pip install 'vllm-lookahead[cpu]'` or `'vllm-lookahead[cuda]'`).")


def register() -> None:
    if os.environ.get(RAY_ON_CPU_ENV, "0").strip().lower() in ("1", "true", "yes"):
        raise RuntimeError(
            f"{RAY_ON_CPU_ENV} was removed: vllm-lookahead no longer patches vLLM's Ray "
            "executor for its CPU platform. Unset it and use the multiprocessing executor "
            "(distributed_executor_backend='mp').")
    version = vllm_version()
    if not is_supported(version):
        logger.error(unsupported_message(version))
        _guard_unsupported(version)
        return
    from vllm_lookahead.patches import apply_all

    apply_all()


def _guard_unsupported(version: str) -> None:
    """On an unsupported vLLM, make ``method="lookahead"`` fail clearly."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except Exception:  # pragma: no cover - nothing we can guard
        return
    from vllm_lookahead.spellings import is_lookahead, merge_spec_flags

    orig = getattr(EngineArgs, "create_speculative_config", None)
    if orig is None:
        return

    def create_speculative_config(self, *args, **kwargs):
        try:
            spec, _ = merge_spec_flags(self.speculative_config, self)
        except ValueError:
            spec = self.speculative_config
        if is_lookahead(spec):
            raise RuntimeError(unsupported_message(version))
        return orig(self, *args, **kwargs)

    EngineArgs.create_speculative_config = create_speculative_config
