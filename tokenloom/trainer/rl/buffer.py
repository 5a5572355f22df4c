"""Replay buffers between the rollout pool and the trainer: ERNIE 5.0's U-RB and two baselines.

Why the design is as it is.
- Long-tail response lengths make a synchronous loop wait for its slowest response. Buffers that
  instead train on whatever finishes first (APRIL-style, `AprilBuffer`) are fast but biased: short
  responses finish first, so the trained length distribution is skewed short and long, hard answers
  are under-trained. U-RB (`UnbiasedReplayBuffer`) keeps the speed-up without the bias: the pool
  holds `batch_queries * oversample` queries generating in parallel, but a batch is always the next
  `batch_queries` queries *in arrival order*, released only once every response of every one of
  them has finished. What is trained is therefore exactly what a synchronous loop would train on;
  only the policy versions of the tokens differ.
- Responses are never truncated to fit a round: a round gives each unfinished response at most a
  token budget, and what is left continues in later rounds, possibly under newer policies. Every
  token therefore carries its behaviour log-probability and the version that sampled it, which is
  what the off-policy correction and the staleness metrics read.
- One base class holds the queries and their groups; the three kinds differ only in how many
  queries they admit (`wants`) and which complete groups form the next batch (`_next_batch`).
  They share one constructor signature and are chosen by name from `BUFFERS`.
- The state (`to_state`) is plain JSON: held groups with their partial responses, the order in which
  groups completed (APRIL releases by it), the next query index and the batches released so far,
  so a resumed run continues exactly where the uninterrupted one would.
- `simulate` drives a buffer with synthetic response lengths and no model: the tests and the bench
  use it to compare the buffers' trained length distributions and rounds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Query:
    index: int  # arrival order, 0, 1, 2, ...
    prompt: list[int]  # token ids
    payload: dict  # task data (answer, bucket, ...), opaque to the buffer
    hint: list[int] = field(default_factory=list)  # forced at the start of every response (AHRL), never trained

    def to_state(self) -> dict:
        return {"index": self.index, "prompt": list(self.prompt), "payload": self.payload, "hint": list(self.hint)}

    @staticmethod
    def from_state(d: dict) -> Query:
        return Query(int(d["index"]), [int(t) for t in d["prompt"]], dict(d["payload"]), [int(t) for t in d["hint"]])


@dataclass
class Trajectory:
    """One response of a query's group, possibly generated over several rounds and policy versions."""

    query: Query
    member: int  # 0..group_size-1
    tokens: list[int] = field(default_factory=list)  # generated response tokens (hint excluded)
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob per token
    versions: list[int] = field(default_factory=list)  # policy version per token
    finished: bool = False
    rounds: int = 0  # rounds it took part in

    @property
    def key(self) -> tuple[int, int]:
        return (self.query.index, self.member)

    def staleness(self, version: int) -> int:
        """How many versions behind `version` its oldest token is (0 with no tokens)."""
        return version - min(self.versions) if self.versions else 0

    def to_state(self) -> dict:
        return {"query": self.query.to_state(), **self._progress()}

    @staticmethod
    def from_state(d: dict) -> Trajectory:
        return Trajectory._restore(Query.from_state(d["query"]), d)

    def _progress(self) -> dict:
        return {"member": self.member, "tokens": list(self.tokens), "logprobs": list(self.logprobs),
                "versions": list(self.versions), "finished": self.finished, "rounds": self.rounds}

    @staticmethod
    def _restore(query: Query, d: dict) -> Trajectory:
        return Trajectory(query, int(d["member"]), [int(t) for t in d["tokens"]], [float(x) for x in d["logprobs"]],
                          [int(v) for v in d["versions"]], bool(d["finished"]), int(d["rounds"]))


class ReplayBuffer:
    """Queries in flight, each a group of `group_size` trajectories; subclasses choose admission and release."""

    name = ""

    def __init__(self, batch_queries: int, group_size: int, oversample: int):
        for what, value in (("batch_queries", batch_queries), ("group_size", group_size), ("oversample", oversample)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name or 'replay'} buffer: {what} must be a positive integer, got {value!r}")
        self.batch_queries, self.group_size, self.oversample = batch_queries, group_size, oversample
        self._groups: dict[int, list[Trajectory]] = {}  # query index -> its group, in index order
        self._completed: list[int] = []  # indices of held queries whose group has finished, in completion order
        self.next_index = 0  # a newly admitted query's index must be at least this
        self.released = 0  # batches released so far

    @property
    def capacity(self) -> int:
        """Queries in flight at most."""
        return self.batch_queries * self.oversample

    def wants(self) -> int:
        """How many new queries the buffer would admit now."""
        return max(0, self.capacity - len(self._groups))

    def admit(self, queries: list[Query]) -> None:
        """Add `group_size` empty trajectories per query; indices must rise above every earlier one."""
        if len(queries) > self.wants():
            raise ValueError(f"{self.name} buffer admits {self.wants()} queries now "
                             f"({len(self._groups)} of {self.capacity} in flight), got {len(queries)}")
        for q in queries:
            if q.index < self.next_index:
                raise ValueError(f"query index {q.index} is not above the last admitted ({self.next_index - 1}): "
                                 "queries must arrive in increasing index order")
            self._groups[q.index] = [Trajectory(q, m) for m in range(self.group_size)]
            self.next_index = q.index + 1

    def active(self) -> list[Trajectory]:
        """Unfinished trajectories to continue this round, in (query index, member) order."""
        return [t for index in sorted(self._groups) for t in self._groups[index] if not t.finished]

    def record(self, traj_id: tuple[int, int], tokens: list[int], logprobs: list[float], version: int,
               finished: bool) -> None:
        """Append one round's output to trajectory (query index, member); `version` sampled all these tokens."""
        index, member = traj_id
        if index not in self._groups or not 0 <= member < self.group_size:
            raise ValueError(f"trajectory {tuple(traj_id)} is not in the buffer (never admitted, or already released)")
        traj = self._groups[index][member]
        if traj.finished:
            raise ValueError(f"trajectory {tuple(traj_id)} has already finished; it takes no more tokens")
        if len(tokens) != len(logprobs):
            raise ValueError(f"trajectory {tuple(traj_id)}: {len(tokens)} tokens but {len(logprobs)} log-probs")
        if traj.versions and version < traj.versions[-1]:
            raise ValueError(f"trajectory {tuple(traj_id)}: version {version} is older than its last token's "
                             f"({traj.versions[-1]}); versions never go back")
        traj.tokens.extend(int(t) for t in tokens)
        traj.logprobs.extend(float(x) for x in logprobs)
        traj.versions.extend([int(version)] * len(tokens))
        traj.rounds += 1
        if finished:
            traj.finished = True
            if all(t.finished for t in self._groups[index]):
                self._completed.append(index)

    def ready(self) -> list[Trajectory] | None:
        """The next training batch (batch_queries * group_size trajectories) or None; removes it from the buffer."""
        indices = self._next_batch()
        if indices is None:
            return None
        taken = set(indices)
        self._completed = [i for i in self._completed if i not in taken]
        self.released += 1
        return [t for i in indices for t in self._groups.pop(i)]

    def _next_batch(self) -> list[int] | None:
        """Query indices of the next batch, in the order they are trained, or None."""
        raise NotImplementedError

    def in_flight(self) -> int:
        """Queries held, finished or not."""
        return len(self._groups)

    def to_state(self) -> dict:
        return {"buffer": self.name, "batch_queries": self.batch_queries, "group_size": self.group_size,
                "oversample": self.oversample, "next_index": self.next_index, "released": self.released,
                "completed": list(self._completed),
                "groups": [{"query": g[0].query.to_state(), "members": [t._progress() for t in g]}
                           for _, g in sorted(self._groups.items())]}

    def load_state(self, state: dict) -> None:
        """Replace the contents with `state` (from `to_state` of a buffer of the same kind and sizes)."""
        ours = {"buffer": self.name, "batch_queries": self.batch_queries, "group_size": self.group_size,
                "oversample": self.oversample}
        theirs = {k: state.get(k) for k in ours}
        if theirs != ours:
            raise ValueError(f"buffer state was saved by {theirs}, this buffer is {ours}; "
                             "load it into a buffer made with the same name and sizes")
        groups: dict[int, list[Trajectory]] = {}
        for g in state["groups"]:
            query = Query.from_state(g["query"])
            groups[query.index] = [Trajectory._restore(query, m) for m in g["members"]]
        self._groups = groups
        self._completed = [int(i) for i in state["completed"]]
        self.next_index, self.released = int(state["next_index"]), int(state["released"])


class UnbiasedReplayBuffer(ReplayBuffer):
    """U-RB: `batch_queries * oversample` queries in flight; batches are consecutive queries in arrival order."""

    name = "urb"

    def _next_batch(self) -> list[int] | None:
        first = sorted(self._groups)[: self.batch_queries]
        done = set(self._completed)
        if len(first) == self.batch_queries and all(i in done for i in first):
            return first
        return None


class SyncBuffer(UnbiasedReplayBuffer):
    """The synchronous loop: one batch in flight; nothing new starts until it has been released."""

    name = "sync"

    @property
    def capacity(self) -> int:
        return self.batch_queries

    def wants(self) -> int:
        return self.batch_queries if not self._groups else 0


class AprilBuffer(ReplayBuffer):
    """APRIL-style: like U-RB in flight, but the first `batch_queries` groups to complete form the batch."""

    name = "april"

    def _next_batch(self) -> list[int] | None:
        if len(self._completed) >= self.batch_queries:
            return self._completed[: self.batch_queries]
        return None


BUFFERS: dict[str, type[ReplayBuffer]] = {"urb": UnbiasedReplayBuffer, "sync": SyncBuffer, "april": AprilBuffer}


def make_buffer(name: str, batch_queries: int, group_size: int, oversample: int) -> ReplayBuffer:
    if name not in BUFFERS:
        raise ValueError(f"unknown replay buffer {name!r}; choose one of {', '.join(BUFFERS)}")
    return BUFFERS[name](batch_queries, group_size, oversample)


def simulate(buffer: ReplayBuffer, response_length: Callable[[int, int], int], budget: int, batches: int,
             queries: int | None = None) -> list[list[Trajectory]]:
    """Drive `buffer` with synthetic responses until `batches` more batches have come out.

    Mirrors the RL loop's step: take a ready batch if there is one; otherwise admit new queries
    (indices continue from `buffer.next_index`, at most `queries` in all when given) and run a round in
    which every active trajectory gets min(budget, what it has left) tokens, where its length is
    `response_length(query index, member)`. A token's id is its position in the response, its
    log-prob 0.0, its version the number of batches released so far, so a resumed buffer continues
    exactly. Returns fewer batches when the query stream runs dry and nothing is left to generate.
    """
    if budget < 1 or batches < 0:
        raise ValueError(f"simulate needs budget >= 1 and batches >= 0, got budget={budget}, batches={batches}")
    out: list[list[Trajectory]] = []
    while len(out) < batches:
        if (batch := buffer.ready()) is not None:
            out.append(batch)
            continue
        want = buffer.wants() if queries is None else min(buffer.wants(), max(0, queries - buffer.next_index))
        start = buffer.next_index
        buffer.admit([Query(i, [], {}) for i in range(start, start + want)])
        active = buffer.active()
        if not active:
            break
        for traj in active:
            length = response_length(traj.query.index, traj.member)
            if length < 0:
                raise ValueError(f"response_length{traj.key} = {length}; lengths must be >= 0")
            have = len(traj.tokens)
            n = min(budget, length - have)
            buffer.record(traj.key, list(range(have, have + n)), [0.0] * n, buffer.released, have + n >= length)
    return out
