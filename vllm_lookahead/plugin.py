"""vLLM plugin entry point (``vllm.general_plugins``), called in every vLLM process: on a
supported vLLM it applies :mod:`vllm_lookahead.patches`, on any other it makes
``method="lookahead"`` fail with a clear message."""

from __future__ import annotations

import logging

#: vLLM releases this plugin is built and tested against.
SUPPORTED_VLLM_VERSIONS = ("0.32.0",)

logger = logging.getLogger("vllm.vllm_lookahead")


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
