"""The patch registry (vllm_lookahead.patches): its rules on a stand-in module,
the declared patches against the installed vLLM, the table, and the switch
that keeps vLLM's own CPU sampler."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
import types
from pathlib import Path

import pytest

from vllm_lookahead import patches
from vllm_lookahead.patches import registry
from vllm_lookahead.patches.registry import ALWAYS, CPU, CPU_SAMPLER, Patch

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def fake(monkeypatch):
    """A stand-in vLLM module with a function and a class, and an empty registry."""
    mod = types.ModuleType("fake_vllm_mod")
    mod.twice = lambda x: 2 * x

    class Box:
        def get(self, x):
            return x

        @staticmethod
        def make(x):
            return [x]

    mod.Box = Box
    monkeypatch.setitem(sys.modules, "fake_vllm_mod", mod)
    monkeypatch.setattr(registry, "PATCHES", [])
    monkeypatch.setattr(registry, "APPLIED", {})
    return mod


def test_a_wrapper_calls_the_original_and_revert_restores_it(fake):
    orig_twice, orig_get = fake.twice, fake.Box.get

    @registry.wraps("fake_vllm_mod:twice", "test", "adds one")
    def plus_one(orig, x):
        return orig(x) + 1

    @registry.wraps("fake_vllm_mod:Box.get", "test", "negates")
    def negate(orig, self, x):
        return -orig(self, x)

    @registry.wraps("fake_vllm_mod:Box.make", "test", "a tuple")
    def as_tuple(orig, x):
        return tuple(orig(x))

    @registry.replaces("fake_vllm_mod:Box.new", "test", "a new method")
    def new(self):
        return "new"

    assert [p.name for p in registry.PATCHES] == ["plus_one", "negate", "as_tuple", "new"]
    for p in registry.PATCHES:
        p.apply()
    assert fake.twice(3) == 7 and fake.Box().get(2) == -2 and fake.Box().new() == "new"
    assert fake.Box.make(1) == (1,) and fake.Box().make(1) == (1,)  # still a staticmethod
    assert registry.PATCHES[0].original is orig_twice
    assert registry.PATCHES[3].original is None
    for p in registry.PATCHES:
        p.revert()
    assert fake.twice is orig_twice and fake.Box.get is orig_get
    assert fake.Box.make(1) == [1] and not hasattr(fake.Box, "new")
    assert registry.APPLIED == {}


def test_a_target_takes_one_patch(fake):
    first = registry.declare("first", "fake_vllm_mod:twice", "test", "one", ALWAYS,
                             lambda orig: orig)
    second = registry.declare("second", "fake_vllm_mod:twice", "test", "two", ALWAYS,
                              lambda orig: orig)
    first.apply()
    with pytest.raises(RuntimeError, match="already patched by 'first'"):
        first.apply()
    with pytest.raises(RuntimeError, match="fake_vllm_mod:twice is already patched"):
        second.apply()


def test_declared_patches_fit_the_installed_vllm():
    declared = patches.declared()
    assert len({p.target for p in declared}) == len(declared)  # one patch a target
    assert len({p.name for p in declared}) == len(declared)
    for p in declared:
        assert isinstance(p, Patch) and p.area and p.when.label
        assert p.doc and "\n" not in p.doc, p.name
        owner, attr = p._owner()  # the module and class exist
        new = p.name in ("lookahead_stats", "lookahead_clear_memory")
        assert new or hasattr(owner, attr), p.target
    names = {p.name: p for p in declared}
    for name in ("expand_kernel_impl", "save_seeded_generators", "rewind_seeded_generators"):
        assert names[name].when is CPU  # bug fixes: always on on the CPU
    assert {p.name for p in declared if p.when is CPU_SAMPLER} == {
        "top_p_from_window", "sample_recovered_tokens", "defer_top_k_top_p",
        "verify_until_rejection", "lazy_bonus_tokens"}


def test_the_table_lists_every_patch(capsys):
    runpy.run_module("vllm_lookahead.patches", run_name="__main__")
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| # | patch | target | area | when |")
    rows = lines[2:]
    assert len(rows) == len(patches.declared())
    for i, (row, p) in enumerate(zip(rows, patches.declared()), 1):
        assert row.startswith(f"| {i} | `{p.name}` | `{p.target}` | {p.area} | {p.when.label} |")


def test_cpu_sampler_switch(monkeypatch):
    monkeypatch.setattr(registry, "on_cpu", lambda: True)
    monkeypatch.delenv(registry.CPU_SAMPLER_ENV, raising=False)
    assert CPU_SAMPLER.holds()
    monkeypatch.setenv(registry.CPU_SAMPLER_ENV, "0")
    assert not CPU_SAMPLER.holds()
    monkeypatch.setattr(registry, "on_cpu", lambda: False)
    monkeypatch.setenv(registry.CPU_SAMPLER_ENV, "1")
    assert not CPU_SAMPLER.holds()


# apply_all with the switch off, then on: in a fresh process (applying here
# would change vLLM for the other tests).
CHILD = """
import json, os
os.environ["VLLM_LOOKAHEAD_CPU_SAMPLER"] = "0"
import vllm.v1.sample.rejection_sampler as rs
from vllm_lookahead import patches
from vllm_lookahead.cpu import sampling
from vllm.utils import cpu_triton_utils
vllm_top_p = rs.apply_top_k_top_p
off = [p.name for p in patches.apply_all()]
state = [rs.apply_top_k_top_p is vllm_top_p, sampling.LAZY_VERIFY,
         cpu_triton_utils._expand_kernel_impl.__module__]
del os.environ["VLLM_LOOKAHEAD_CPU_SAMPLER"]
on = [p.name for p in patches.apply_all()]
print(json.dumps({"off": off, "on": on, "state": state,
                  "after": [rs.apply_top_k_top_p is vllm_top_p, sampling.LAZY_VERIFY]}))
"""


def test_switch_off_keeps_vllms_cpu_sampler():
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the CPU platform's patches")
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    speedups = {p.name for p in patches.declared() if p.when is CPU_SAMPLER}
    assert not speedups & set(out["off"])
    assert {"expand_kernel_impl", "rewind_seeded_generators", "lookahead_method"} <= set(out["off"])
    assert out["state"] == [True, False, "vllm_lookahead.cpu.patches"]
    assert set(out["on"]) == speedups  # the rest was applied once, not again
    assert out["after"] == [False, True]
