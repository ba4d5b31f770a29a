"""Pay-off gate: per engine step, run the lookahead tree only where it pays.

Whether lookahead speeds decoding up depends on the hardware (what an extra
query token costs in a forward), the dtype, the batch and the text. Instead of
guessing from a cost model, the gate measures: it tries each way of running a
step ("arm") for a few steps, keeps the one with the most generated tokens
per second, and now and then tries the others again.

Arms:

* ``"tree"``: full lookahead (Jacobi window + candidate check, a checked
  draft);
* ``"pool"``: no tree, the n-gram pool's guess as an unchecked draft (prompt
  lookup, no extra query tokens besides the draft's);
* ``"off"``: no tree and no draft (a vanilla step).

The arm only decides how many tokens a step can gain and what it costs:
vLLM's verifier decides which tokens come out, so outputs never depend on
the gate (greedy outputs stay identical to vanilla).

Measurements are kept per *bucket*, the number of decoding requests rounded
down to a power of two (1, 2, 4, 8, ...), since both the gain and the cost
of extra tokens change with the batch. A step's measurement is the time from
the proposer call that chose its arm to the next proposer call (the forward,
sampling and the proposer itself) and the tokens the step produced. Steps
with prefills are not measured (the proposer does not call :meth:`record`
for them).

This module is pure Python: the clock is the caller's, so tests drive it with
a synthetic cost model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ARMS = ("tree", "pool", "off")


@dataclass
class _Bucket:
    arm: str
    queue: list[str]
    left: int  # decisions left in the current phase
    hold: int  # length of the next exploit phase
    rates: dict[str, float] = field(default_factory=dict)  # tokens/s per arm
    tokens: float = 0.0  # measured in the current phase
    seconds: float = 0.0
    skip: int = 0  # measurements to ignore (just switched arm)
    best: str | None = None


class PayoffGate:
    """Chooses the arm of each step from measured tokens/s.

    Per bucket: probe every arm for ``probe_steps`` steps (tree first), then
    exploit the fastest for ``hold_steps`` steps, then probe the others
    again. While the same arm stays the fastest, the exploit phase doubles
    (up to ``max_hold_steps``), so a clear winner costs little exploring.
    The first measurement of a bucket and after a switch is skipped (the
    first tree step runs a catch-up pass). A probe's rate is blended into
    the arm's estimate (``ema`` weight for the new figure).

    Args:
        arms: the arms to choose from (a subset of :data:`ARMS`, in probing
            order).
        probe_steps, hold_steps, max_hold_steps: phase lengths in steps.
        ema: weight of the newest phase's rate in an arm's estimate.
        margins: how much faster than the pool's guess an arm must measure
            to be chosen (default 5% for "tree" and "off"). The pool's guess
            is the safe middle: a step without a match drafts nothing (a
            vanilla step) and a short probe of a text-dependent gain is
            noisy, so a small measured edge is not worth a switch.
        agree: called with the locally fastest arm at the end of each probing
            round and returning the arm to use. Tensor-parallel ranks measure
            different times but must run the same arm (the tree tokens take
            part in the model's collectives): the proposer passes a
            broadcast of rank 0's choice. Phase boundaries fall on the same
            steps on every rank (they count steps, not time), so every rank
            calls it at the same step.
    """

    def __init__(self, arms=ARMS, probe_steps: int = 8, hold_steps: int = 64,
                 max_hold_steps: int = 256, ema: float = 0.5, agree=None,
                 margins=None) -> None:
        unknown = [a for a in arms if a not in ARMS]
        if not arms or unknown:
            raise ValueError(f"arms must be a non-empty subset of {ARMS}, got {list(arms)}")
        self.arms = tuple(arms)
        self.probe_steps = probe_steps
        self.hold_steps = hold_steps
        self.max_hold_steps = max_hold_steps
        self.ema = ema
        self.agree = agree
        self.margins = {"tree": 0.05, "off": 0.05} if margins is None else dict(margins)
        self.buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(num_decoding: int) -> int:
        """1, 2, 4, 8, ...: the largest power of two <= ``num_decoding``."""
        return 1 << (max(int(num_decoding), 1).bit_length() - 1)

    def decide(self, num_decoding: int) -> str:
        """The arm of the next step, for a batch of ``num_decoding`` requests."""
        key = self.bucket_of(num_decoding)
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = _Bucket(
                arm=self.arms[0], queue=list(self.arms[1:]), left=self.probe_steps,
                hold=self.hold_steps, skip=1,
            )
        if b.left <= 0:
            self._next_phase(b)
        b.left -= 1
        return b.arm

    def record(self, num_decoding: int, arm: str, tokens: int, seconds: float) -> None:
        """What a step run with ``arm`` produced, and how long it took."""
        b = self.buckets.get(self.bucket_of(num_decoding))
        if b is None or b.arm != arm or seconds <= 0:
            return
        if b.skip > 0:
            b.skip -= 1
            return
        b.tokens += tokens
        b.seconds += seconds

    def _next_phase(self, b: _Bucket) -> None:
        if b.seconds > 0:
            rate = b.tokens / b.seconds
            old = b.rates.get(b.arm)
            b.rates[b.arm] = rate if old is None else (1 - self.ema) * old + self.ema * rate
        b.tokens = b.seconds = 0.0
        if b.queue:  # probing
            self._switch(b, b.queue.pop(0), self.probe_steps)
            return
        known = {a: r / (1 + self.margins.get(a, 0.0)) for a, r in b.rates.items()}
        best = max(known, key=known.get) if known else self.arms[0]
        if self.agree is not None:
            best = self.agree(best)
        if best == b.best:
            b.hold = min(b.hold * 2, self.max_hold_steps)
        else:
            b.hold = self.hold_steps
        b.best = best
        b.queue = [a for a in self.arms if a != best]
        self._switch(b, best, b.hold)

    @staticmethod
    def _switch(b: _Bucket, arm: str, steps: int) -> None:
        if arm != b.arm:
            b.skip = 1
        b.arm = arm
        b.left = steps

    def snapshot(self) -> dict:
        """Per bucket: the current arm and the measured tokens/s per arm."""
        return {
            str(k): {"arm": b.arm, "best": b.best,
                     "tokens_per_s": {a: round(r, 2) for a, r in b.rates.items()}}
            for k, b in sorted(self.buckets.items())
        }
