"""What the machine is (:func:`hardware_id`, part of a cached curve's key) and
how busy other processes keep it while something is timed (:func:`timed_under_load`)."""

from __future__ import annotations

import hashlib
import os
import platform
import time
from typing import Callable


def hardware_id() -> dict:
    """What a step's cost depends on besides the model: the CPU model and a
    hash of its instruction-set flags, the architecture and the cores."""
    hw = {"machine": platform.machine(), "cores": os.cpu_count()}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        hw["cpu"] = platform.processor() or "unknown"
        return hw
    for key, _, val in (line.partition(":") for line in lines):
        if key.strip() == "model name" and "cpu" not in hw:
            hw["cpu"] = val.strip()
        elif key.strip() == "flags" and "flags_sha1" not in hw:
            flags = " ".join(sorted(val.split()))
            hw["flags_sha1"] = hashlib.sha1(flags.encode()).hexdigest()[:16]
    return hw


def machine_busy_s() -> float | None:
    """CPU seconds all processes have been busy (``/proc/stat``); None where
    that cannot be read."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    # user nice system idle iowait irq softirq steal
    user, nice, system, _, _, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / (os.sysconf("SC_CLK_TCK") or 100)


def timed_under_load(fn: Callable[[], object]) -> tuple[float, float]:
    """Seconds ``fn()`` took and the other processes' CPU load meanwhile (the
    machine's busy time less this process's), in cores (0 where unknown)."""
    busy, own, t0 = machine_busy_s(), time.process_time(), time.perf_counter()
    fn()
    took, busy_after = time.perf_counter() - t0, machine_busy_s()
    if busy is None or busy_after is None or took <= 0:
        return took, 0.0
    return took, max(0.0, (busy_after - busy - (time.process_time() - own)) / took)
