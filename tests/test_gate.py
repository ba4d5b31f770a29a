"""The pay-off gate (vllm_lookahead.gate), driven by a synthetic cost model."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from vllm_lookahead.gate import ARMS, PayoffGate


def simulate(gate: PayoffGate, cost, steps: int, batch: int = 1, noise: float = 0.0,
             seed: int = 0) -> Counter:
    """Run ``steps`` decisions; ``cost[arm] = (tokens per step, seconds per
    step)``. Returns how often each arm ran."""
    rng = random.Random(seed)
    used = Counter()
    for _ in range(steps):
        arm = gate.decide(batch)
        used[arm] += 1
        tokens, seconds = cost[arm]
        gate.record(batch, arm, tokens, seconds * (1 + noise * rng.uniform(-1, 1)))
    return used


@pytest.mark.parametrize(
    "cost,best",
    [
        # tree: 2 tokens for 1.3x the time; pool 1.3 tokens for 1.05x; off 1.
        ({"tree": (2.0, 1.3), "pool": (1.3, 1.05), "off": (1.0, 1.0)}, "tree"),
        # pool wins (code-like text, the prompt pool hits).
        ({"tree": (1.7, 1.5), "pool": (1.6, 1.05), "off": (1.0, 1.0)}, "pool"),
        # nothing pays (float32 on CPU: extra tokens are expensive).
        ({"tree": (1.7, 1.9), "pool": (1.05, 1.2), "off": (1.0, 1.0)}, "off"),
    ],
)
@pytest.mark.parametrize("noise", [0.0, 0.2])
def test_gate_spends_most_steps_on_the_fastest_arm(cost, best, noise):
    gate = PayoffGate()
    used = simulate(gate, cost, 3000, noise=noise)
    assert set(used) == set(ARMS)  # every arm was tried
    assert used[best] / 3000 > 0.9, used
    assert gate.snapshot()["1"]["best"] == best


def test_gate_probes_every_arm_in_order_first():
    gate = PayoffGate(probe_steps=3)
    seq = [gate.decide(1) for _ in range(9)]
    assert seq == ["tree"] * 3 + ["pool"] * 3 + ["off"] * 3


def test_gate_keeps_batch_sizes_apart():
    gate = PayoffGate()
    cost_small = {"tree": (2.0, 1.2), "pool": (1.2, 1.05), "off": (1.0, 1.0)}
    cost_big = {"tree": (1.5, 2.5), "pool": (1.1, 1.3), "off": (1.0, 1.0)}
    used_small, used_big = Counter(), Counter()
    for _ in range(2000):
        for batch, cost, used in ((1, cost_small, used_small), (12, cost_big, used_big)):
            arm = gate.decide(batch)
            used[arm] += 1
            gate.record(batch, arm, *cost[arm])
    assert used_small.most_common(1)[0][0] == "tree"
    assert used_big.most_common(1)[0][0] == "off"
    assert set(gate.snapshot()) == {"1", "8"}


def test_bucket_is_the_power_of_two_below():
    assert [PayoffGate.bucket_of(n) for n in (0, 1, 2, 3, 4, 7, 8, 15, 16, 17)] == [
        1, 1, 2, 2, 4, 4, 8, 8, 16, 16]


def test_first_measurement_after_a_switch_is_ignored():
    # A catch-up pass makes the first tree step after a switch slow: that
    # step alone must not decide.
    gate = PayoffGate(probe_steps=4)
    cost = {"tree": (2.0, 1.2), "pool": (1.0, 1.0), "off": (1.0, 1.0)}
    first = True
    for _ in range(12):
        arm = gate.decide(1)
        tokens, seconds = cost[arm]
        if arm == "tree" and first:
            seconds, first = 1000.0, False  # would make tree look hopeless
        gate.record(1, arm, tokens, seconds)
    assert gate.decide(1) == "tree"


def test_measurements_of_another_arm_are_ignored():
    gate = PayoffGate(probe_steps=2)
    arm = gate.decide(1)
    gate.record(1, "off", 100, 0.001)  # not the current arm: dropped
    gate.record(1, arm, 7, 1.0)  # a bucket's first measurement: skipped
    gate.record(1, arm, 1, 1.0)
    gate.record(1, arm, 1, 0.0)  # no time: dropped
    b = gate.buckets[1]
    assert (b.tokens, b.seconds) == (1, 1.0)


def test_exploit_phase_doubles_while_the_winner_stays():
    gate = PayoffGate(probe_steps=2, hold_steps=10, max_hold_steps=40)
    cost = {"tree": (2.0, 1.0), "pool": (1.0, 1.0), "off": (1.0, 1.0)}
    holds = []
    for _ in range(400):
        arm = gate.decide(1)
        b = gate.buckets[1]
        if b.best is not None and (not holds or holds[-1] != b.hold):
            holds.append(b.hold)
        gate.record(1, arm, *cost[arm])
    assert holds[:3] == [10, 20, 40]
    assert max(holds) == 40


def test_agree_hook_decides_the_winner():
    calls = []

    def rank0(local):
        calls.append(local)
        return "off"

    gate = PayoffGate(probe_steps=2, agree=rank0)
    cost = {"tree": (3.0, 1.0), "pool": (1.0, 1.0), "off": (1.0, 1.0)}
    used = simulate(gate, cost, 200)
    assert calls and set(calls) == {"tree"}
    assert used["off"] > used["tree"]


@pytest.mark.parametrize("arms", [(), ("tree", "fast")])
def test_bad_arms_are_refused(arms):
    with pytest.raises(ValueError, match="arms"):
        PayoffGate(arms=arms)


def test_small_edges_over_the_pool_guess_do_not_switch():
    # off 3% and tree 4% faster than the pool's guess: within the 5% margins.
    cost = {"tree": (2.08, 2.0), "pool": (1.0, 1.0), "off": (1.0, 0.97)}
    gate = PayoffGate()
    used = simulate(gate, cost, 2000)
    assert used.most_common(1)[0][0] == "pool"
    gate = PayoffGate(margins={})  # no margins: the fastest wins
    used = simulate(gate, cost, 2000)
    assert used.most_common(1)[0][0] == "tree"
