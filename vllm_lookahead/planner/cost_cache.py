"""Cost curves on disk, so a restart reuses the one measured before.

A curve (:class:`~.cost_model.CostCurve`) is cached under a key
(:func:`cache_key`) of model, dtype, parallel sizes, hardware
(:func:`~.machine.hardware_id`) and vLLM version, one JSON file per key
(:class:`CostCache`); :func:`load_curve` reads such a file, or one written by
hand. Pure Python (no torch, no vLLM).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from vllm_lookahead.planner.cost_model import CACHE_VERSION, MIN_POINTS, CostCurve
from vllm_lookahead.planner.machine import hardware_id

logger = logging.getLogger("vllm.vllm_lookahead.planner.cost_cache")


def cache_key(model: str, dtype: str, tensor_parallel: int, pipeline_parallel: int,
              vllm_version: str, device: str, extra: dict | None = None) -> dict:
    """The key a cached curve is valid under."""
    return {
        "model": str(model),
        "dtype": str(dtype),
        "tensor_parallel": int(tensor_parallel),
        "pipeline_parallel": int(pipeline_parallel),
        "vllm": str(vllm_version),
        "device": str(device),
        "hardware": hardware_id() if device == "cpu" else {"gpu": device},
        **(extra or {}),
    }


def default_cache_dir() -> Path:
    base = os.environ.get("VLLM_LOOKAHEAD_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "vllm-lookahead")
    return Path(base) / "cost"


class CostCache:
    """Cost curves on disk, one JSON file per key (named by its hash).

    A file that does not parse, holds another key or another format version
    is ignored with a warning: it never stops the engine.
    """

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        self.dir = Path(directory) if directory is not None else default_cache_dir()

    @staticmethod
    def _digest(key: dict) -> str:
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]

    def path(self, key: dict) -> Path:
        return self.dir / f"cost-{self._digest(key)}.json"

    def load(self, key: dict) -> CostCurve | None:
        """The cached curve of ``key``; None (measure again) also for a
        curve cut shorter than :data:`~.cost_model.MIN_POINTS` sizes at its
        first batch (cached before measurements kept them)."""
        curve = load_curve(self.path(key), key)
        if curve is not None and len(curve.points[min(curve.points)]) < MIN_POINTS:
            return None
        if curve is not None and not curve.verify:
            return None  # cached before the verification costs were measured
        return curve

    def save(self, key: dict, curve: CostCurve) -> Path | None:
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"version": CACHE_VERSION, "key": key,
                                       "curve": curve.to_dict(),
                                       "verify": curve.verify_dict()}, indent=1))
            os.replace(tmp, path)
            return path
        except OSError as e:
            logger.warning("Lookahead: could not write the cost curve to %s: %s", path, e)
            return None


def load_curve(path: str | os.PathLike, key: dict | None = None) -> CostCurve | None:
    """A curve from a file written by :class:`CostCache` (or by hand:
    ``{"version": 2, "curve": {"1": [[1, 0.05], [16, 0.07]]}}``, and
    optionally ``"verify": {"sampled": {"1": [0.003, 0.0005]}}``, seconds,
    a third figure per batch the bonus row a rejected draft saves,
    :attr:`~.cost_model.CostCurve.verify`; version 1 files have no
    ``verify``). With
    ``key``, the file's key must equal it. None, with a warning, for a
    missing key match, a corrupt file or one of another version; None
    silently for a missing file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        logger.warning("Lookahead: ignoring unreadable cost curve %s: %s", path, e)
        return None
    try:
        if data.get("version") not in (1, CACHE_VERSION):
            raise ValueError(f"format version {data.get('version')!r}, want {CACHE_VERSION}")
        if key is not None and data.get("key") != key:
            raise ValueError("it was measured for another model, dtype or machine")
        return CostCurve.from_dict(data["curve"], data.get("verify"))
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        logger.warning("Lookahead: ignoring cost curve %s: %s", path, e)
        return None
