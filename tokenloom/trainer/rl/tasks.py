"""Verifiable tasks for RL post-training: procedurally generated, with a reward a program checks.

Why these tasks. RL needs a reward that is right by construction, queries of graded difficulty (so
that pass@1 per bucket shows what RL adds beyond the SFT start, and hints have hard queries to
help), and answers short enough that a small model learns them on two CPU cores. Digit sorting,
multi-digit addition and countdown-style arithmetic have all three; the difficulty bucket is the
number of digits or operands.

Format. A query is a prompt string ending in ``=``; the answer starts with a space and is followed
by the model's ``<eos>``, so that a byte-level BPE splits ``prompt + answer`` exactly where it
splits the two apart (the pre-tokenizer cuts before every space). Supervised records
(`sft_records`) are ``prompt + answer`` lines for ingestion: the SFT model RL starts from is
trained on the easy buckets.

Reward (the seed's verifiable scheme): 1 for an exact (or, for countdown, any valid) answer, 0.1
for a well-formed but wrong one, 0 otherwise. Queries are a pure function of (seed, index, split):
a resumed run draws exactly the queries the uninterrupted one would have.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

EXACT, WELL_FORMED, WRONG = 1.0, 0.1, 0.0
SPLITS = {"train": 0, "eval": 1, "sft": 2}


@dataclass(frozen=True)
class TaskItem:
    prompt: str  # ends with "="
    answer: str  # the reference answer, starting with a space
    bucket: int  # difficulty bucket (0: easiest)


class Task:
    """A registry entry: `make(rng, bucket)` draws an item; `reward(item, response)` scores a response."""

    name = ""
    buckets: tuple[str, ...] = ()

    def make(self, rng: np.random.Generator, bucket: int) -> TaskItem:
        raise NotImplementedError

    def reward(self, item: TaskItem, response: str) -> float:
        raise NotImplementedError

    def item(self, seed: int, index: int, buckets: tuple[int, ...], split: str = "train") -> TaskItem:
        """Query `index` of a run: its bucket cycles through `buckets`; its content is seeded by (seed, index, split)."""
        if not buckets or any(not 0 <= b < len(self.buckets) for b in buckets):
            raise ValueError(f"task {self.name} has buckets 0..{len(self.buckets) - 1} ({', '.join(self.buckets)}), "
                             f"got {list(buckets)}")
        rng = np.random.default_rng([seed, index, SPLITS[split]])
        return self.make(rng, buckets[index % len(buckets)])


class SortDigits(Task):
    """``sort 3 9 1 =`` -> `` 1 3 9``; bucket b sorts b + 3 digits."""

    name = "sort"
    buckets = ("3 digits", "4 digits", "5 digits", "6 digits")
    _form = re.compile(r"^( \d)+$")

    def make(self, rng, bucket):
        digits = rng.integers(0, 10, size=bucket + 3)
        return TaskItem("sort " + " ".join(map(str, digits)) + " =", "".join(f" {d}" for d in sorted(digits)), bucket)

    def reward(self, item, response):
        if response == item.answer:
            return EXACT
        return WELL_FORMED if self._form.match(response) and len(response) == len(item.answer) else WRONG


class AddNumbers(Task):
    """``add 47+385 =`` -> `` 432``; bucket b adds two numbers of up to b + 1 digits."""

    name = "add"
    buckets = ("1 digit", "2 digits", "3 digits", "4 digits")
    _form = re.compile(r"^ \d+$")

    def make(self, rng, bucket):
        a, b = (int(x) for x in rng.integers(0, 10 ** (bucket + 1), size=2))
        return TaskItem(f"add {a}+{b} =", f" {a + b}", bucket)

    def reward(self, item, response):
        if response == item.answer:
            return EXACT
        return WELL_FORMED if self._form.match(response) else WRONG


class Countdown(Task):
    """``countdown 3 5 7 to 22 =`` -> an expression over the numbers, each used once, with + - *
    and no parentheses, worth the target (`` 3*5+7``); bucket b uses b + 2 numbers. Any valid
    expression earns the full reward, not only the reference."""

    name = "countdown"
    buckets = ("2 numbers", "3 numbers", "4 numbers")
    _form = re.compile(r"^ \d+([+*-]\d+)*$")

    def make(self, rng, bucket):
        numbers = [int(x) for x in rng.integers(1, 10, size=bucket + 2)]
        ops = [str(o) for o in rng.choice(["+", "-", "*"], size=len(numbers) - 1)]
        expression = str(numbers[0]) + "".join(o + str(n) for o, n in zip(ops, numbers[1:], strict=True))
        target = _evaluate(expression)
        shown = sorted(numbers)
        return TaskItem(f"countdown {' '.join(map(str, shown))} to {target} =", f" {expression}", bucket)

    def reward(self, item, response):
        if not self._form.match(response):
            return WRONG
        numbers = sorted(int(x) for x in re.findall(r"\d+", response))
        wanted = [int(x) for x in item.prompt.split(" to ")[0].split()[1:]]
        target = int(item.prompt.split(" to ")[1].rstrip(" ="))
        return EXACT if numbers == sorted(wanted) and _evaluate(response.strip()) == target else WELL_FORMED


def _evaluate(expression: str) -> int:
    """+ - * over non-negative integers with the usual precedence (no eval())."""
    total = 0
    for term in re.split(r"(?=[+-])", expression):
        sign = -1 if term.startswith("-") else 1
        product = 1
        for factor in term.lstrip("+-").split("*"):
            product *= int(factor)
        total += sign * product
    return total


TASKS: dict[str, Task] = {t.name: t for t in (SortDigits(), AddNumbers(), Countdown())}


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; tasks: {', '.join(sorted(TASKS))}")
    return TASKS[name]


def parse_buckets(task: Task, text: str | tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """`0,1,2` (or a sequence) -> bucket indices, checked against the task's buckets; empty: all."""
    if isinstance(text, str):
        items = [t for t in text.replace(" ", "").split(",") if t]
        try:
            chosen = tuple(int(t) for t in items)
        except ValueError:
            raise ValueError(f"buckets are comma-separated numbers, got {text!r}") from None
    else:
        chosen = tuple(int(t) for t in text)
    chosen = chosen or tuple(range(len(task.buckets)))
    if any(not 0 <= b < len(task.buckets) for b in chosen):
        raise ValueError(f"task {task.name} has buckets 0..{len(task.buckets) - 1} ({', '.join(task.buckets)}), "
                         f"got {list(chosen)}")
    return chosen


def sft_records(task: Task, count: int, buckets: tuple[int, ...], seed: int = 0) -> list[dict]:
    """`count` supervised records {"text": prompt + answer} from the task's "sft" split."""
    return [{"text": (it := task.item(seed, i, buckets, "sft")).prompt + it.answer, "bucket": it.bucket}
            for i in range(count)]
