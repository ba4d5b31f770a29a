"""Cost curves on disk, so that a restart reuses the one measured before: one
JSON file per key (:func:`cache_key`: model, dtype, parallel sizes, hardware,
vLLM version). A file that does not parse or holds another key or format
version is ignored with a warning; it never stops the engine."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from vllm_lookahead.planner.cost_model import CACHE_VERSION, CostCurve
from vllm_lookahead.planner.machine import hardware_id

logger = logging.getLogger("vllm.vllm_lookahead.planner.cost_cache")


def cache_key(model: str, dtype: str, tensor_parallel: int, pipeline_parallel: int,
              vllm_version: str, device: str, extra: dict | None = None) -> dict:
    """The key a cached curve is valid under (``device``: "cpu" or a GPU's name)."""
    return {
        "model": str(model), "dtype": str(dtype), "tensor_parallel": int(tensor_parallel),
        "pipeline_parallel": int(pipeline_parallel), "vllm": str(vllm_version),
        "device": str(device),
        "hardware": hardware_id() if device == "cpu" else {"gpu": device},
        **(extra or {}),
    }


class CostCache:
    """Curves in ``directory`` (default ``$VLLM_LOOKAHEAD_CACHE/cost``, else
    ``~/.cache/vllm-lookahead/cost``), each file named by its key's hash."""

    def __init__(self, directory: str | os.PathLike | None = None) -> None:
        base = os.environ.get("VLLM_LOOKAHEAD_CACHE") or os.path.join(
            os.path.expanduser("~"), ".cache", "vllm-lookahead")
        self.dir = Path(directory) if directory is not None else Path(base) / "cost"

    def path(self, key: dict) -> Path:
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return self.dir / f"cost-{digest}.json"

    def load(self, key: dict) -> CostCurve | None:
        return load_curve(self.path(key), key)

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
    """The curve in a file written by :class:`CostCache` or by hand, e.g.
    ``{"version": 2, "curve": {"1": [[1, 0.05], [16, 0.07]]}, "verify":
    {"sampled": {"1": [0.003, 0.0005]}}}`` (seconds; ``verify`` optional, as
    :attr:`CostCurve.verify`). With ``key``, the file's must equal it. None for
    a missing file, and with a warning for a bad one."""
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
