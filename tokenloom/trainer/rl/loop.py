"""The RL loop: rollout rounds into a replay buffer, GSPO + IcePop updates on the DeepSpeed engine.

One step: rollout rounds run until the buffer releases a batch (U-RB: the next `batch_queries`
queries in arrival order, once every response of theirs has finished; each round continues every
unfinished response by at most `round_tokens` tokens, so long answers span rounds and policy
versions), then rewards (the task's verifier), group-normalised advantages, the training engine's
log-probabilities before the update (pi_old), and `updates_per_batch` optimizer steps on the
MISC objective (`trainer.rl.loss`). The new weights go to the rollout actors as the next version.

Resume is exact: a checkpoint (the same atomic writer as pretraining) holds the engine (weights,
ZeRO-1 optimizer, scheduler) and the loop's state: step, the buffer with its partial responses
(tokens, behaviour log-probs, versions), the next query index and the measured pass rates. Queries
are a function of their index and the sampler of a rollout a function of what it continues, so the
rest of the run does not depend on where it was cut.

Hints (AHRL): when on, the starting model's pass rate per bucket is measured first (k samples, no
hints); a new query of a hard bucket starts its responses with a prefix of the reference answer
whose share decays as p_init * exp(-gamma * step * pass_init); hint tokens are context, never
targets. pass@1 is measured without hints, greedily, on held-out queries of every bucket.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from tokenloom.model import ModelConfig
from tokenloom.model.generate import TokenSpace
from tokenloom.model.io import save_model
from tokenloom.model.unified import UnifiedModel
from tokenloom.trainer import checkpoints
from tokenloom.trainer.config import TrainConfig
from tokenloom.trainer.distributed import init_distributed
from tokenloom.trainer.loop import param_groups
from tokenloom.trainer.metrics import MetricsLog
from tokenloom.trainer.rl.buffer import Query, Trajectory, make_buffer
from tokenloom.trainer.rl.config import RLConfig
from tokenloom.trainer.rl.hints import PassRates, hint_fraction, hint_tokens
from tokenloom.trainer.rl.loss import group_advantages, misc_loss, token_entropy
from tokenloom.trainer.rl.policy import response_batch, token_logprobs
from tokenloom.trainer.rl.rollout import RolloutPool, RolloutRequest
from tokenloom.trainer.rl.tasks import TaskItem, get_task, parse_buckets

EVAL_KEY = 10**9  # eval and pass-rate queries' indices start here (never a training query's)


@dataclass
class TextCodec:
    """The model's text tokenizer in unified ids: encode(str) -> ids, decode(ids) -> str; the
    batch forms, where given, take a round's texts in one call (the tokenizer services: one HTTP
    request per round instead of one per reply)."""

    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    encode_batch: Callable[[list[str]], list[list[int]]] | None = None
    decode_batch: Callable[[list[list[int]]], list[str]] | None = None

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        return self.encode_batch(texts) if self.encode_batch else [self.encode(t) for t in texts]

    def decode_many(self, ids: list[list[int]]) -> list[str]:
        return self.decode_batch(ids) if self.decode_batch else [self.decode(i) for i in ids]


@dataclass
class RLResult:
    run_dir: str
    steps: int
    model_dir: str | None
    checkpoint: str | None
    reward_first: float
    reward_last: float
    pass_at_1: dict[str, float] = field(default_factory=dict)  # the last evaluation, per bucket name and "mean"
    pass_at_1_start: dict[str, float] = field(default_factory=dict)  # the run's first evaluation
    plot: str | None = None


def _complete(pool: RolloutPool, contexts: dict[tuple[int, int], list[int]], temperature: float, seed: int,
              max_tokens: int) -> dict[tuple[int, int], list[int]]:
    """Responses to `contexts`, decoded to the end (<eos> or max_tokens) in one round each."""
    reqs = [RolloutRequest(key, ctx, max_tokens) for key, ctx in contexts.items()]
    results, _ = pool.generate(reqs, temperature, seed)
    return {key: ids for key, (ids, _, _) in results.items()}


def run_rl(model_cfg: ModelConfig, init_state: dict[str, torch.Tensor] | None, space: TokenSpace, codec: TextCodec,
           cfg: RLConfig, run_dir: Path, resume_from: Path | None = None, progress: bool = True,
           provenance: dict | None = None) -> RLResult:
    import deepspeed

    cfg.validate()
    task = get_task(cfg.task)
    train_buckets, eval_buckets = parse_buckets(task, cfg.buckets), parse_buckets(task, cfg.eval_buckets)
    bos, eos, pad = (space.specials[k] for k in ("<bos>", "<eos>", "<pad>"))
    init_distributed()
    torch.manual_seed(cfg.seed)
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    model = UnifiedModel(model_cfg)
    if init_state is not None:
        model.load_state_dict(init_state)
    updates = cfg.steps * cfg.updates_per_batch
    rows = cfg.batch_queries * cfg.group_size
    schedule = TrainConfig(steps=updates, micro_batch_size=max(1, rows // cfg.updates_per_batch), lr=cfg.lr,
                           warmup_steps=min(updates, max(1, cfg.warmup_steps * cfg.updates_per_batch)),
                           min_lr_ratio=1.0, weight_decay=cfg.weight_decay, grad_clip=cfg.grad_clip, zero_stage=1)
    optimizer = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=schedule.betas)
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer,
                                                   config=schedule.deepspeed_config())
    device = engine.device
    buffer = make_buffer(cfg.buffer, cfg.batch_queries, cfg.group_size, cfg.oversample)
    rates, start, next_query = PassRates(), 0, 0
    if resume_from is not None:
        resume_from = checkpoints.find_checkpoint(resume_from)
        _, client = engine.load_checkpoint(str(resume_from.parent), tag=resume_from.name)
        if client is None or "rl" not in client:
            raise FileNotFoundError(f"{resume_from} is not an RL checkpoint")
        schedule_only = ("steps", "stop_after", "max_minutes", "eval_every", "eval_queries", "eval_buckets", "checkpoint_every",
                         "keep_last")  # what may change on resume: nothing the training depends on
        theirs = {k: v for k, v in client["rl"].items() if k not in schedule_only}
        ours = {k: v for k, v in asdict(cfg).items() if k in theirs}
        if theirs != ours:
            changed = sorted(k for k in theirs if theirs[k] != ours.get(k))
            raise ValueError(f"checkpoint {resume_from} was written with other RL settings ({', '.join(changed)}); "
                             "resume with the run's own configuration")
        start, next_query = int(client["step"]), int(client["next_query"])
        buffer.load_state(client["buffer"])
        rates.load_state(client["pass_rates"])
    end = cfg.stop_after or cfg.steps
    if start >= end:
        raise ValueError(f"checkpoint is at step {start}; nothing to do before step {end} (raise --steps)")
    t_run = time.perf_counter()  # rl.max_minutes counts from here
    pool = RolloutPool(asdict(model_cfg), space, cfg.rollout_actors, cfg.rollout_weights)
    pool.set_weights(engine.module.state_dict(), start)
    metrics = MetricsLog(run_dir / "metrics.jsonl", resume_at=start if resume_from is not None else None)

    def contexts(items: list[TaskItem]) -> list[list[int]]:
        return [[bos, *ids] for ids in codec.encode_many([it.prompt for it in items])]

    def replies(responses: list[list[int]]) -> list[str]:
        return codec.decode_many([[i for i in ids if i != eos] for ids in responses])

    def complete(items: dict[tuple[int, int], TaskItem], temperature: float) -> dict[tuple[int, int], str]:
        """Each item's reply, decoded to the end in one round."""
        out = _complete(pool, dict(zip(items, contexts(list(items.values())), strict=True)), temperature, cfg.seed,
                        cfg.max_response_tokens)
        return dict(zip(items, replies([out[k] for k in items]), strict=True))

    eval_seconds = [0.0]  # evaluations are not charged to rl.max_minutes: every method gets the same training time

    def evaluate(step: int) -> dict[str, float]:
        """pass@1 per bucket: greedy, no hints, on held-out queries."""
        t_eval = time.perf_counter()
        items = {(EVAL_KEY + b * cfg.eval_queries + i, 0): task.item(cfg.seed, b * cfg.eval_queries + i, (b,), "eval")
                 for b in eval_buckets for i in range(cfg.eval_queries)}  # each bucket its own queries
        out = complete(items, 0.0)
        scores = {b: [] for b in eval_buckets}
        for key, it in items.items():
            scores[it.bucket].append(task.reward(it, out[key]) == 1.0)
        doc = {f"pass1/{task.buckets[b]}": float(np.mean(s)) for b, s in scores.items()}
        doc["pass1"] = float(np.mean([v for s in scores.values() for v in s]))
        metrics.log({"step": step, "eval": "pass@1", **doc})
        eval_seconds[0] += time.perf_counter() - t_eval
        return doc

    if cfg.hints and not rates.to_state().get("counts"):  # pass_init: k samples of the starting model
        probes = {(EVAL_KEY * 2 + b * cfg.hint.samples + i, 0):  # not the held-out evaluation's queries
                  task.item(cfg.seed, EVAL_KEY + b * cfg.hint.samples + i, (b,), "eval")
                  for b in train_buckets for i in range(cfg.hint.samples)}
        out = complete(probes, cfg.temperature)
        for key, it in probes.items():
            rates.record(it.bucket, task.reward(it, out[key]) == 1.0)
        metrics.log({"step": start, "hints": "pass_init",
                     **{f"pass_init/{task.buckets[b]}": rates.rate(b) for b in train_buckets}})

    def make_queries(first: int, count: int, step: int) -> list[Query]:
        items = [task.item(cfg.seed, index, train_buckets, "train") for index in range(first, first + count)]
        encoded = codec.encode_many([it.prompt for it in items] + [it.answer for it in items])
        queries = []
        for k, (item, prompt, reference) in enumerate(zip(items, encoded[:count], encoded[count:], strict=True)):
            hint = hint_tokens(reference, hint_fraction(step, rates.rate(item.bucket), cfg.hint)) if cfg.hints else []
            queries.append(Query(first + k, [bos, *prompt], {"item": asdict(item), "reference": len(reference)}, hint))
        return queries

    # a resumed run's log already holds its first evaluation (an invocation's last one, at its stop
    # step, is dropped with the records after the checkpoint): the log reads as one uninterrupted run
    earlier = [{k: v for k, v in r.items() if k.startswith("pass1")} for r in metrics.records
               if r.get("eval") == "pass@1"]
    first_eval = earlier[0] if earlier else evaluate(start)
    if earlier and cfg.eval_every and start % cfg.eval_every == 0:  # the evaluation the cut run logged at its end
        evaluate(start)
    last_eval = first_eval
    bar = tqdm(total=cfg.steps, initial=start, desc="rl", disable=not progress, dynamic_ncols=True)
    checkpoint = None
    for step in range(start, end):
        t0, rounds, busy = time.perf_counter(), 0, []
        while (batch := buffer.ready()) is None:
            if (want := buffer.wants()) > 0:
                buffer.admit(make_queries(next_query, want, step))
                next_query += want
            reqs, left = [], {}
            for traj in buffer.active():
                key = (traj.query.index, traj.member)
                left[key] = max(1, cfg.max_response_tokens - len(traj.query.hint) - len(traj.tokens))
                reqs.append(RolloutRequest(key, [*traj.query.prompt, *traj.query.hint, *traj.tokens],
                                           min(cfg.round_tokens, left[key])))
            t_round = time.perf_counter()
            results, seconds = pool.generate(reqs, cfg.temperature, cfg.seed)
            busy.append((sum(seconds), (time.perf_counter() - t_round) * len(seconds)))
            for req in reqs:  # a response ends at <eos> or when it has used up max_response_tokens
                ids, lps, finished = results[req.key]
                buffer.record(req.key, ids, lps, step, finished or len(ids) >= left[req.key])
            rounds += 1
        rollout_seconds = time.perf_counter() - t0
        record = _train_step(engine, scheduler, batch, task, replies, cfg, step, device, pad)
        pool.set_weights(engine.module.state_dict(), step + 1)
        record.update({"rounds": rounds, "rollout_seconds": rollout_seconds,
                       # None when the batch was already complete: no round ran in this step
                       "rollout_busy": sum(b for b, _ in busy) / sum(w for _, w in busy) if busy else None,
                       "train_seconds": time.perf_counter() - t0 - rollout_seconds, "in_flight": buffer.in_flight()})
        metrics.log(record)
        bar.update(1)
        bar.set_postfix(reward=f"{record['reward']:.2f}")
        done = step + 1
        if cfg.max_minutes and time.perf_counter() - t_run - eval_seconds[0] >= cfg.max_minutes * 60:
            end = done  # out of wall clock: this step ends the invocation (checkpoint, evaluation, model)
        if cfg.eval_every and done % cfg.eval_every == 0 and done < end:
            last_eval = evaluate(done)
        if done < end and cfg.checkpoint_every and done % cfg.checkpoint_every == 0 or done == end:
            client = {"step": done, "next_query": next_query, "buffer": buffer.to_state(),
                      "pass_rates": rates.to_state(), "rl": asdict(cfg)}
            checkpoint = checkpoints.save(engine, run_dir / checkpoints.ROOT, done, client,
                                          {**(provenance or {}), "rl": asdict(cfg)}, cfg.keep_last, 0, 1)
        if done == end:
            break
    bar.close()
    if end > start:
        last_eval = evaluate(end)
    pool.close()
    metrics.close()
    from tokenloom.trainer.rl.plots import plot_rl

    # the whole run's (a resumed log holds the records before the resume too)
    rewards_seen = [r["reward"] for r in metrics.records if "reward" in r]
    staleness_total: Counter = Counter()
    for r in metrics.records:
        staleness_total.update({int(k): v for k, v in r.get("staleness", {}).items()})
    plot = plot_rl(metrics.records, staleness_total, run_dir / "rl.png")
    model_dir = save_model(engine.module.state_dict(), model_cfg, run_dir / "model", {"steps": end, "rl": cfg.task})
    return RLResult(str(run_dir), end - start, str(model_dir), str(checkpoint) if checkpoint else None,
                    rewards_seen[0] if rewards_seen else float("nan"),
                    float(np.mean(rewards_seen[-5:])) if rewards_seen else float("nan"), last_eval, first_eval,
                    str(plot) if plot else None)


def _train_step(engine, scheduler, batch: list[Trajectory], task, replies, cfg: RLConfig, step: int,
                device: torch.device, pad: int) -> dict:
    """Rewards, advantages, pi_old, then `updates_per_batch` MISC updates; returns the step's record.
    `replies`: the batch's responses (hint included) as text, in one call."""
    items = [TaskItem(**t.query.payload["item"]) for t in batch]
    texts = replies([[*t.query.hint, *t.tokens] for t in batch])
    rewards = torch.tensor([task.reward(it, text) for it, text in zip(items, texts, strict=True)])
    advantages = group_advantages(rewards, torch.tensor([t.query.index for t in batch]))
    rb = response_batch([[*t.query.prompt, *t.query.hint] for t in batch], [t.tokens for t in batch],
                        [t.logprobs for t in batch], [t.versions for t in batch], pad)
    engine.module.eval()
    with torch.no_grad():
        logp_old, _, _ = token_logprobs(engine.module, rb, device)
    engine.module.train()
    n = len(batch)
    bounds = np.linspace(0, n, cfg.updates_per_batch + 1).round().astype(int)
    stats: list[dict] = []
    entropies, losses, norms = [], [], []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        part = rb.rows(slice(a, b))
        logp, logits, aux = token_logprobs(engine.module, part, device)
        mask = part.mask.to(device)
        out = misc_loss(logp, logp_old[a:b], part.logp_infer.to(device), advantages[a:b].to(device), mask,
                        part.modality.to(device), cfg.misc)
        engine.backward(out.loss + aux)
        engine.step()
        entropies.append(float(token_entropy(logits.detach())[mask].mean()))
        losses.append(out.loss.item())
        norm = engine.get_global_grad_norm()
        norms.append(float(norm) if norm is not None else float("nan"))
        stats.append(out.stats)
    lags = (step - rb.versions[rb.mask]).tolist()
    by_bucket: dict[str, list[float]] = {}
    for it, r in zip(items, rewards.tolist(), strict=True):
        by_bucket.setdefault(task.buckets[it.bucket], []).append(r)
    hints = [len(t.query.hint) / max(1, t.query.payload["reference"]) for t in batch[::cfg.group_size]]
    merged = {k: float(np.nanmean([s[k] for s in stats if k in s])) for k in {k for s in stats for k in s}}
    return {"step": step, "version": step, "reward": float(rewards.mean()),
            "solved": float((rewards == 1.0).float().mean()),
            **{f"reward/{k}": float(np.mean(v)) for k, v in sorted(by_bucket.items())},
            "response_tokens": float(rb.mask.sum(1).float().mean()), "loss": float(np.mean(losses)),
            "entropy": float(np.mean(entropies)), "grad_norm": float(np.nanmean(norms)), "lr": scheduler.get_last_lr()[0],
            **merged, "staleness": dict(sorted(Counter(lags).items())),
            "hint_fraction": float(np.mean(hints)), "hinted_queries": float(np.mean([h > 0 for h in hints])),
            "queries": sorted({t.query.index for t in batch})}
