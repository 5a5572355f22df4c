"""The training loop neural tokenizers share: a wall-clock budget, a cosine schedule over it,
periodic checkpoints with exact resume, held-out evaluations, metrics.jsonl and a progress bar.

A tokenizer supplies its model, a batch sampler with a saveable RNG state, the loss of a batch
and an evaluation; the loop owns time, the optimizer and the run folder. Checkpoints are
`torch.save` dictionaries of tensors and plain values, loaded with `weights_only=True`.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch

CHECKPOINT = "checkpoint.pt"
# may differ on resume ("precision": a resumed run keeps the precision its checkpoint records)
BUDGET_KEYS = ("steps", "max_minutes", "eval_every_s", "checkpoint_every_s", "threads", "precision")


@dataclass
class LoopResult:
    steps: int
    elapsed: float  # seconds of training over all invocations of this run
    items_per_second: float  # this invocation's training throughput (batch items)
    final: dict  # the last evaluation


def recipe(config: dict) -> dict:
    """What must match to resume: everything but the budgets and bookkeeping intervals."""
    return {k: v for k, v in json.loads(json.dumps(config)).items() if k not in BUDGET_KEYS}


def learning_rate(cfg, step: int, progress: float) -> float:
    """Linear warmup, then a cosine from lr to lr/10 over the run's progress (0..1)."""
    warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    return cfg.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _truncate_metrics(path: Path, step: int) -> None:
    """On resume: drop what was logged after the checkpoint (those steps are redone)."""
    if path.is_file():
        records = [json.loads(line) for line in path.read_text().splitlines() if line]
        kept = [json.dumps(r) for r in records if r["step"] < step or (r["step"] == step and "loss" in r)]
        path.write_text("".join(line + "\n" for line in kept))


PROBE_MARGIN = 1.2  # "auto" picks bf16 only when a probe step runs at least this much faster


def choose_precision(cfg, device: torch.device, model: torch.nn.Module, sampler, loss_fn, move,
                     companions: dict | None = None, repeats: int = 2) -> tuple[bool, dict]:
    """(bf16 autocast?, how it was chosen) for a new run: `cfg.precision` "bf16" or "fp32" (or the
    older `bf16_autocast = true`) decide; "auto" is bf16 on CUDA and, on a CPU, the faster of the
    two by measurement: forward and backward of one batch under each, best of `repeats` after a
    warm-up, bf16 only when at least PROBE_MARGIN faster (an AMX Xeon trains the visual tokenizer
    1.7x faster in bf16; an AVX2-only EPYC runs bf16 matmuls 7-100x slower). The probe leaves no
    trace: model, companions, sampler and RNG are restored, no optimizer step is taken."""
    precision = getattr(cfg, "precision", "auto")
    if getattr(cfg, "bf16_autocast", False) or precision == "bf16":
        return True, {"precision": precision, "bf16": True, "why": "configured"}
    if precision == "fp32":
        return False, {"precision": precision, "bf16": False, "why": "configured"}
    if device.type == "cuda":
        return True, {"precision": precision, "bf16": True, "why": "cuda"}
    saved_model = {k: v.detach().clone() for k, v in model.state_dict().items()}
    saved_parts = {name: copy.deepcopy(part.state_dict()) for name, part in (companions or {}).items()}
    saved_sampler, saved_rng = sampler.state().clone(), torch.get_rng_state()
    times: dict[bool, float] = {}
    try:
        model.train()
        batch = move(sampler.batch(cfg.batch_size), device)
        for bf16 in (False, True, False, True):  # interleaved: a warm-up each, then the timed pass
            best = float("inf")
            for _ in range(1 if bf16 not in times else repeats):
                t = time.perf_counter()
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                    loss, _ = loss_fn(batch)
                loss.backward()
                best = min(best, time.perf_counter() - t)
                model.zero_grad(set_to_none=True)
            times[bf16] = best
    finally:
        model.load_state_dict(saved_model)
        for name, part in (companions or {}).items():
            part.load_state_dict(saved_parts[name])
        sampler.load_state(saved_sampler)
        torch.set_rng_state(saved_rng)
        model.zero_grad(set_to_none=True)
    bf16 = times[True] * PROBE_MARGIN <= times[False]
    return bf16, {"precision": precision, "bf16": bf16, "why": "probe", "fp32_step_s": round(times[False], 4),
                  "bf16_step_s": round(times[True], 4)}


class Sampler(Protocol):
    """What the loop needs of a batch source: batches and a saveable RNG state."""

    def batch(self, n: int): ...

    def state(self) -> torch.Tensor: ...

    def load_state(self, state: torch.Tensor) -> None: ...


def run_training(model: torch.nn.Module, cfg, run_dir: Path, sampler: Sampler,
                 loss_fn: Callable[[object], tuple[torch.Tensor, dict]],
                 evaluate: Callable[[str], dict], *, device: torch.device, identity: dict | None = None,
                 resume: bool = False, progress: bool = True, stop_after: int = 0, desc: str = "training",
                 to_device: Callable[[object, torch.device], object] | None = None,
                 companions: dict | None = None) -> LoopResult:
    """Train `model` in place until `cfg.steps` or `cfg.max_minutes`, then evaluate once more.

    `loss_fn(batch)` returns (loss, scalars to log); `evaluate(tag)` returns scalars and may
    write pictures named by `tag` ("step000120", "final"). `identity` holds whatever else
    must match for a resume (e.g. the architecture variant). `stop_after` ends this invocation
    after that many steps, as an interruption would, without changing the schedule.
    `companions` are other stateful parts of the run that `loss_fn` updates itself (e.g. a
    discriminator and its optimizer, a loss balancer's averages): anything with
    `state_dict()`/`load_state_dict()`, saved in every checkpoint and restored on resume.
    """
    from tqdm.auto import tqdm

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay)
    identity = json.loads(json.dumps(identity or {}))
    step, elapsed = 0, 0.0
    ckpt_path = run_dir / CHECKPOINT
    if resume and not ckpt_path.is_file():
        raise ValueError(f"nothing to resume: {run_dir} has no {CHECKPOINT}")
    if not resume and ckpt_path.is_file():
        raise ValueError(f"{run_dir} already holds a training run: resume it or choose another run folder")
    if resume:
        state = torch.load(ckpt_path, weights_only=True, map_location=device)
        if recipe(state["config"]) != recipe(asdict(cfg)) or state.get("identity", {}) != identity:
            raise ValueError(f"checkpoint in {run_dir} was made with another config; use a new run directory")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state(state["sampler"].cpu())
        saved = state.get("companions", {})
        if set(saved) != set(companions or {}):
            raise ValueError(f"checkpoint in {run_dir} holds {sorted(saved)} beside the model, this run needs "
                             f"{sorted(companions or {})}; use a new run directory")
        for name, part in (companions or {}).items():
            part.load_state_dict(saved[name])
        step, elapsed = int(state["step"]), float(state["elapsed"])
        _truncate_metrics(run_dir / "metrics.jsonl", step)
    budget = cfg.max_minutes * 60.0
    move = to_device or (lambda b, d: b.to(d, non_blocking=True))
    if resume:  # the run keeps the precision it started with (checkpoints before the probe: the old rule)
        bf16 = bool(state.get("bf16", getattr(cfg, "bf16_autocast", False) or device.type == "cuda"))
    else:  # the probe's time is the run's: charged to its budget
        t0 = time.perf_counter()
        bf16, how = choose_precision(cfg, device, model, sampler, loss_fn, move, companions)
        elapsed = time.perf_counter() - t0
        (run_dir / "precision.json").write_text(json.dumps(how, indent=1) + "\n")
        if progress:
            print(f"{desc}: {'bf16 autocast' if bf16 else 'fp32'} ({how['why']}"
                  + (f": a step {how['fp32_step_s']:.3g} s in fp32, {how['bf16_step_s']:.3g} s in bf16"
                     if how["why"] == "probe" else "") + ")", file=sys.stderr)

    def checkpoint() -> None:
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "sampler": sampler.state(),
                    "step": step, "elapsed": elapsed, "config": json.loads(json.dumps(asdict(cfg))), "bf16": bf16,
                    "identity": identity,
                    "companions": {name: part.state_dict() for name, part in (companions or {}).items()}}, tmp)
        tmp.replace(ckpt_path)

    metrics = (run_dir / "metrics.jsonl").open("a")
    bar = tqdm(total=round(budget), initial=min(round(elapsed), round(budget)), unit="s", disable=not progress,
               desc=desc)
    start, last_ckpt, last_eval, items = time.perf_counter() - elapsed, elapsed, elapsed, 0
    run_start_elapsed, first_step = elapsed, step
    model.train()
    while step < cfg.steps and elapsed < budget and not (stop_after and step - first_step >= stop_after):
        batch = move(sampler.batch(cfg.batch_size), device)
        lr = learning_rate(cfg, step, max(step / cfg.steps, elapsed / budget))
        for group in optimizer.param_groups:
            group["lr"] = lr
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, logged = loss_fn(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        step += 1
        items += cfg.batch_size
        elapsed = time.perf_counter() - start
        bar.update(min(round(elapsed), round(budget)) - bar.n)
        record = {"step": step, "elapsed": round(elapsed, 2), "loss": float(loss.detach()), "lr": lr, **logged}
        bar.set_postfix(step=step, **{k: f"{v:.4g}" for k, v in record.items() if k in ("loss", *logged)})
        if elapsed - last_eval >= cfg.eval_every_s:
            record.update({f"heldout_{k}": v for k, v in evaluate(f"step{step:06d}").items()})
            last_eval = elapsed
            model.train()
        metrics.write(json.dumps(record) + "\n")
        if elapsed - last_ckpt >= cfg.checkpoint_every_s:
            checkpoint()
            last_ckpt = elapsed
    bar.close()
    checkpoint()
    final = evaluate("final")
    metrics.write(json.dumps({"step": step, "elapsed": round(elapsed, 2),
                              **{f"heldout_{k}": v for k, v in final.items()}}) + "\n")
    metrics.close()
    return LoopResult(step, elapsed, items / max(elapsed - run_start_elapsed, 1e-9), final)
