"""Adaptive hints (AHRL): a fading prefix of the reference answer for queries the model cannot yet solve.

Why the design is as it is.
- RL learns nothing from a group whose responses all fail (every advantage is zero). For a hard
  query (its pass rate before RL, `pass_init`, below `hard_below`) the responses therefore start
  with a prefix of the reference solution, forced as context and never trained on, so that some of
  them succeed. The prefix shrinks with training, so the model ends up solving the query alone.
- The seed's schedule is `fraction = p_init * exp(-gamma * step * pass_init)`: the easier a hard
  query already was, the sooner its hint fades. Taken literally it never fades for a query that no
  sample solved (pass_init = 0 gives exp(0) = 1), which are exactly the queries hints exist for, and
  the model would never be asked to answer them unaided. The decay therefore uses
  `max(pass_init, pass_floor)`, with `pass_floor` defaulting to 1 / (2 * samples): zero successes
  in k samples means a rate below about 1/k, and half of that is the usual continuity correction.
  Setting `pass_floor = 0` gives the seed's formula exactly. Hardness is decided on the raw rate.
- pass_init is measured per difficulty bucket (`PassRates`: k samples each, no hints) rather than
  per query: queries are drawn fresh, so a bucket is what has a stable rate. Its state is plain
  JSON so a resumed run keeps the rates it measured at the start.
- A hint never covers the whole reference: the model always writes at least the final token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class HintConfig:
    p_init: float = 1.0  # fraction of the reference solution given at step 0 (hard queries)
    gamma: float = 0.05  # decay rate per step, scaled by the query's pass rate
    hard_below: float = 0.5  # a query (bucket) is "hard" when its pass_init is below this
    samples: int = 8  # k: samples per bucket to measure pass_init
    pass_floor: float | None = None  # the decay's pass rate is at least this; None: 1 / (2 * samples)

    def validate(self) -> None:
        if not 0.0 <= self.p_init <= 1.0:
            raise ValueError(f"hint.p_init is a fraction of the reference, in [0, 1]; got {self.p_init}")
        if not self.gamma >= 0.0:
            raise ValueError(f"hint.gamma must be >= 0 (0: hints never fade); got {self.gamma}")
        if not 0.0 < self.hard_below <= 1.0:
            raise ValueError(f"hint.hard_below is a pass rate in (0, 1]; got {self.hard_below}")
        if not isinstance(self.samples, int) or self.samples < 1:
            raise ValueError(f"hint.samples (k, samples per bucket for pass_init) must be >= 1; got {self.samples}")
        floor = self.pass_floor
        if floor is not None and (isinstance(floor, bool) or not isinstance(floor, int | float) or not 0 <= floor <= 1):
            raise ValueError(f"hint.pass_floor is a pass rate in [0, 1] (or unset: 1 / (2 * samples)); "
                             f"got {self.pass_floor!r}")

    @property
    def floor(self) -> float:
        """The pass rate the decay uses at least."""
        return 1.0 / (2 * self.samples) if self.pass_floor is None else self.pass_floor


def hint_fraction(step: int, pass_init: float, cfg: HintConfig) -> float:
    """Share of the reference to give a new query at `step`: p_init * exp(-gamma * step * max(pass_init, floor))
    when pass_init < hard_below, else 0."""
    if step < 0 or not 0.0 <= pass_init <= 1.0:
        raise ValueError(f"hint_fraction needs step >= 0 and pass_init in [0, 1]; got step={step}, "
                         f"pass_init={pass_init}")
    if pass_init >= cfg.hard_below:
        return 0.0
    return cfg.p_init * math.exp(-cfg.gamma * step * max(pass_init, cfg.floor))


def hint_tokens(reference: list[int], fraction: float) -> list[int]:
    """The first round-half-up(fraction * len(reference)) tokens, and never more than len(reference) - 1."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"hint fraction must be in [0, 1]; got {fraction}")
    n = min(math.floor(fraction * len(reference) + 0.5), len(reference) - 1)
    return list(reference[: max(0, n)])


class PassRates:
    """pass_init per bucket, counted from samples: record(bucket, passed), then rate(bucket)."""

    def __init__(self) -> None:
        self._counts: dict = {}  # bucket -> [passed, seen], in first-seen order

    def record(self, bucket, passed: bool) -> None:
        counts = self._counts.setdefault(bucket, [0, 0])
        counts[0] += int(bool(passed))
        counts[1] += 1

    def rate(self, bucket) -> float:
        if bucket not in self._counts:
            raise ValueError(f"no pass-rate samples for bucket {bucket!r} (measured: {list(self._counts)}); "
                             "record samples of it before asking for its rate")
        passed, seen = self._counts[bucket]
        return passed / seen

    def to_state(self) -> dict:
        return {"counts": [[bucket, passed, seen] for bucket, (passed, seen) in self._counts.items()]}

    def load_state(self, state: dict) -> None:
        counts: dict = {}
        for entry in state["counts"]:
            bucket, passed, seen = entry
            if not 0 <= passed <= seen or seen < 1:
                raise ValueError(f"pass-rate state for bucket {bucket!r} has {passed} passed of {seen} seen")
            counts[bucket] = [int(passed), int(seen)]
        self._counts = counts
