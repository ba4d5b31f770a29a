"""What the machine is and how busy it is, for measuring step costs.

:func:`hardware_id` names what the cost of a step depends on besides the
model (it goes into the key of a cached curve, :mod:`.cost_cache`);
:func:`machine_busy_s` and :class:`LoadProbe` tell how much CPU time other
processes take while something is timed.

Pure Python (Linux ``/proc`` where there is one, the standard library
elsewhere).
"""

from __future__ import annotations

import hashlib
import os
import platform
import time


def hardware_id() -> dict:
    """What the cost of a step depends on, besides the model: the CPU model
    and its instruction-set flags (or the GPU's name), and the cores."""
    hw = {"machine": platform.machine(), "cores": os.cpu_count()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            info = f.read()
        for line in info.splitlines():
            key, _, val = line.partition(":")
            key = key.strip()
            if key == "model name" and "cpu" not in hw:
                hw["cpu"] = val.strip()
            elif key == "flags" and "flags_sha1" not in hw:
                flags = " ".join(sorted(val.split()))
                hw["flags_sha1"] = hashlib.sha1(flags.encode()).hexdigest()[:16]
    except OSError:
        hw["cpu"] = platform.processor() or "unknown"
    return hw


def machine_busy_s() -> float | None:
    """CPU seconds all processes of the machine have been busy (Linux
    ``/proc/stat``), or None where that cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal ...
    vals = [int(x) for x in fields[1:9]]
    busy = vals[0] + vals[1] + vals[2] + vals[5] + vals[6] + vals[7]
    return busy / (os.sysconf("SC_CLK_TCK") or 100)


class LoadProbe:
    """Other processes' CPU load while something runs: machine-wide busy
    time minus this process's own CPU time, in cores (0 where unknown)."""

    def __enter__(self) -> "LoadProbe":
        self._busy, self._own, self._t = machine_busy_s(), time.process_time(), time.perf_counter()
        self.cores = 0.0
        return self

    def __exit__(self, *exc) -> None:
        busy = machine_busy_s()
        wall = time.perf_counter() - self._t
        if busy is None or self._busy is None or wall <= 0:
            return
        other = (busy - self._busy) - (time.process_time() - self._own)
        self.cores = max(0.0, other / wall)
