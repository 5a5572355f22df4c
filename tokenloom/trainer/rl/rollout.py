"""Rollout workers: copies of the policy that continue responses, a round's token budget at a time.

Why the design is as it is.
- A worker is a Ray actor (`RolloutPool`) holding its own copy of the model; `set_weights(state,
  version)` installs the trainer's weights (one object in Ray's store per version, shared by every
  actor) and every token it samples carries that version, so a response continued over rounds
  records which policy wrote each token.
- Numerics differ from the trainer's on purpose (`rollout_weights="bf16"`: the copy's weights are
  rounded to bfloat16, computed in fp32 so a CPU without bf16 units stays fast): the
  train/inference mismatch that IcePop gates is then real, as between an inference engine and a
  trainer, and is measured (mismatch KL) rather than assumed zero.
- Decoding is `model.generate` (KV cache, the training visibility rules), text only. Responses of
  one query that share their whole context (its group in the first round) decode as one batch; each
  batch's sampler is seeded by what it continues (run seed, version, first trajectory, context
  length), so the tokens do not depend on how many actors there are or which one gets the work,
  and a resumed run samples exactly what the uninterrupted one did.
- A worker reports its busy seconds, so the loop can show the pool's busy fraction.
- An actor that dies (killed, out of memory) is restarted by Ray without weights; it refuses to
  sample until the pool has sent it the current version, and the round runs again with the same
  seeds, so the run goes on with the tokens it would have had.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from tokenloom.model.generate import Chunk, Cursor, Request, SamplingConfig, TokenSpace, generate


@dataclass
class RolloutRequest:
    key: tuple[int, int]  # (query index, member)
    context: list[int]  # <bos>, prompt, hint and the response so far
    limit: int  # at most this many new tokens (the round's budget or what the response has left)


def text_chunk_of(ids: list[int], batch: int) -> Chunk:
    """A text-only context as positions: t = 0..n-1, one causal segment, repeated over `batch` rows."""
    n = len(ids)
    t = np.arange(n)
    return Chunk.from_columns(np.asarray(ids)[:, None], np.zeros(n), np.stack([t, t, t], 1), np.zeros(n),
                              np.zeros(n), np.zeros(n), batch)


def round_weights(state: dict[str, torch.Tensor], weights: str) -> dict[str, torch.Tensor]:
    """The rollout copy's weights: as trained ("fp32") or rounded to bfloat16 ("bf16")."""
    if weights == "fp32":
        return state
    return {k: v.to(torch.bfloat16).to(v.dtype) if v.is_floating_point() else v for k, v in state.items()}


def sampler_seed(seed: int, version: int, key: tuple[int, int], length: int) -> int:
    return int(np.random.SeedSequence([seed, version, key[0], key[1], length]).generate_state(1)[0])


class RolloutWorker:
    """One policy copy: `set_weights`, then `generate` continues a round's requests."""

    def __init__(self, model_cfg: dict, space: TokenSpace, weights: str = "bf16", threads: int = 1):
        from tokenloom.model.io import config_from_dict
        from tokenloom.model.unified import UnifiedModel

        if threads:
            torch.set_num_threads(threads)
        self.model = UnifiedModel(config_from_dict(model_cfg)).eval()
        self.space, self.weights, self.version = space, weights, -1

    def set_weights(self, state: dict[str, torch.Tensor], version: int) -> int:
        self.model.load_state_dict(round_weights(state, self.weights))
        self.version = version
        return version

    def generate(self, requests: list[RolloutRequest], temperature: float, seed: int) -> dict:
        """-> {"results": {key: (new tokens, their log-probs, finished)}, "seconds": busy time, "version"}.
        A response finishes when it samples `<eos>`; one that reaches its limit without it continues
        next round (the loop decides when its total length ends it)."""
        if self.version < 0:  # a restarted actor: its constructor's random weights must never sample
            raise RuntimeError("this rollout worker holds no policy weights (restarted?)")
        started = time.perf_counter()
        eos = self.space.specials["<eos>"]
        groups: dict[tuple[int, ...], list[RolloutRequest]] = {}
        for req in requests:
            groups.setdefault((req.key[0], req.limit, *req.context), []).append(req)
        results = {}
        for members in groups.values():
            first = members[0]
            prompt = text_chunk_of(first.context, len(members))
            sampling = SamplingConfig(temperature=temperature,
                                      seed=sampler_seed(seed, self.version, first.key, len(first.context)))
            made = generate(self.model, self.space, prompt, Cursor.after(prompt),
                            Request("text", max_new_tokens=first.limit), sampling)
            for row, req in enumerate(members):
                ids, logprobs = made.ids[row], made.logprobs[row]
                results[req.key] = (ids, logprobs, bool(ids) and ids[-1] == eos)
        return {"results": results, "seconds": time.perf_counter() - started, "version": self.version}


class RolloutPool:
    """`actors` Ray actors (0: one worker in this process), fed the same weights; a round's requests
    are dealt out by trajectory so that a group stays on one actor."""

    def __init__(self, model_cfg: dict, space: TokenSpace, actors: int, weights: str, num_cpus: float = 1.0):
        self.actors, self.retries = actors, 0
        self.restart_seconds = 180.0  # how long a round waits for Ray to bring a dead actor back
        if actors == 0:
            self.workers = [RolloutWorker(model_cfg, space, weights, threads=0)]
            return
        import ray

        remote = ray.remote(num_cpus=num_cpus, max_restarts=2)(RolloutWorker)
        self.workers = [remote.remote(model_cfg, space, weights) for _ in range(actors)]

    def set_weights(self, state: dict[str, torch.Tensor], version: int) -> None:
        state = {k: v.detach().cpu().clone() for k, v in state.items()}
        if self.actors == 0:
            self.workers[0].set_weights(state, version)
            return
        import ray

        self._weights = (ray.put(state), version)  # kept to re-send to an actor Ray restarted
        ray.get([w.set_weights.remote(*self._weights) for w in self.workers])

    def generate(self, requests: list[RolloutRequest], temperature: float, seed: int) -> tuple[dict, list[float]]:
        """-> (results by key, each worker's busy seconds)."""
        by_query: dict[int, list[RolloutRequest]] = {}
        for req in requests:
            by_query.setdefault(req.key[0], []).append(req)
        shares: list[list[RolloutRequest]] = [[] for _ in self.workers]
        for i, reqs in enumerate(by_query.values()):  # whole queries, dealt round-robin
            shares[i % len(self.workers)].extend(reqs)
        if self.actors == 0:
            outs = [self.workers[0].generate(shares[0], temperature, seed)]
        else:
            outs = self._remote_generate(shares, temperature, seed)
        results = {}
        for out in outs:
            results.update(out["results"])
        seconds = [out["seconds"] for out in outs] + [0.0] * (len(self.workers) - len(outs))
        return results, seconds

    def _remote_generate(self, shares: list[list[RolloutRequest]], temperature: float, seed: int) -> list[dict]:
        """Each actor's share; an actor that died is restarted by Ray (`max_restarts`) without weights:
        the pool sends it the current version and runs the round again (same seeds: same tokens)."""
        import ray
        from ray.exceptions import RayError

        deadline, failed = time.monotonic() + self.restart_seconds, False
        while True:
            try:
                if failed:  # after a failure: every actor gets the current weights (a restarted one has none)
                    ray.get([w.set_weights.remote(*self._weights) for w in self.workers])
                return ray.get([w.generate.remote(s, temperature, seed)
                                for w, s in zip(self.workers, shares, strict=True) if s])
            except RayError:  # the actor died, is restarting (importing torch), or came back without weights
                if time.monotonic() > deadline:
                    raise
                failed = True
                self.retries += 1
                time.sleep(2.0)

    def close(self) -> None:
        if self.actors:
            import ray

            for w in self.workers:
                ray.kill(w)
