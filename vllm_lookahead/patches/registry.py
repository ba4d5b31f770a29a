"""The patch registry: a :class:`Patch` replaces or adds one attribute of vLLM, its target
(``module:Qual.name``), keeping the original (what a wrapper calls); one patch a target.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

#: ``0`` keeps vLLM's own CPU sampler and verifier (no :mod:`vllm_lookahead.cpu` speed-ups).
CPU_SAMPLER_ENV = "VLLM_LOOKAHEAD_CPU_SAMPLER"


class When(NamedTuple):
    """Where a patch applies: its label in the table and the test."""

    label: str
    holds: Callable[[], bool]


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


ALWAYS = When("always", lambda: True)
CPU = When("CPU", on_cpu)
CPU_SAMPLER = When(f"CPU, unless `{CPU_SAMPLER_ENV}=0`",
                   lambda: on_cpu() and os.environ.get(CPU_SAMPLER_ENV, "1").strip() != "0")

#: Every declared patch, in the order ``apply_all`` applies them.
PATCHES: list[Patch] = []
#: target -> the patch applied to it in this process.
APPLIED: dict[str, Patch] = {}
_MISSING = object()


@dataclass(eq=False)
class Patch:
    name: str
    target: str
    area: str
    doc: str
    when: When
    make: Callable[[Any], Any]  # the original (None: a new attribute) -> its replacement
    original: Any = None
    _saved: Any = _MISSING

    def _owner(self) -> tuple[Any, str]:
        module, _, qual = self.target.partition(":")
        *path, attr = qual.split(".")
        owner = importlib.import_module(module)
        for name in path:
            owner = getattr(owner, name)
        return owner, attr

    def apply(self) -> None:
        if self.target in APPLIED:
            raise RuntimeError(f"{self.target} is already patched by "
                               f"{APPLIED[self.target].name!r}: a target takes one patch")
        owner, attr = self._owner()
        self._saved = vars(owner).get(attr, _MISSING)
        self.original = getattr(owner, attr, None)
        new = self.make(self.original)
        setattr(owner, attr, staticmethod(new) if isinstance(self._saved, staticmethod) else new)
        APPLIED[self.target] = self

    def revert(self) -> None:
        """Put the original back (tests)."""
        if APPLIED.get(self.target) is not self:
            return
        owner, attr = self._owner()
        if self._saved is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, self._saved)
        del APPLIED[self.target]


def declare(name: str, target: str, area: str, doc: str, when: When,
            make: Callable[[Any], Any]) -> Patch:
    p = Patch(name, target, area, doc, when, make)
    PATCHES.append(p)
    return p


def wraps(target: str, area: str, doc: str, when: When = ALWAYS, name: str = ""):
    """Declare ``fn(original, *args, **kwargs)`` as the target's wrapper."""

    def deco(fn):
        def make(orig):
            return functools.wraps(orig)(lambda *a, **k: fn(orig, *a, **k))

        declare(name or fn.__name__, target, area, doc, when, make)
        return fn

    return deco


def replaces(target: str, area: str, doc: str, when: When = ALWAYS):
    """Declare ``fn`` as what replaces (or adds) the target."""

    def deco(fn):
        declare(fn.__name__, target, area, doc, when, lambda orig: fn)
        return fn

    return deco
