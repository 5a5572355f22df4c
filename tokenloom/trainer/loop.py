"""The training loop: one loop, configured, for every model the catalog can feed.

DeepSpeed owns the optimizer step, ZeRO partitioning, gradient clipping and the LR
schedule; this file owns the data stream, precision context, logging and checkpoints. The
data stream's state is saved inside each DeepSpeed checkpoint (client state), so resuming
a run continues with exactly the batch the interrupted run would have read next.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from tokenloom.datasets import ShardFile, StreamConfig, TokenStream
from tokenloom.model import ModelConfig, Transformer
from tokenloom.trainer.config import TrainConfig
from tokenloom.trainer.distributed import init_distributed
from tokenloom.trainer.metrics import MetricsLog, plot_loss


@dataclass
class TrainResult:
    steps: int
    first_loss: float
    last_loss: float
    tokens_per_second: float
    tokens_seen: int
    parameters: int
    run_dir: str
    checkpoint: str | None
    loss_plot: str | None
    world_size: int = 1
    losses: list[float] = field(default_factory=list)


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _to_tensors(batch: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(v).to(device=device, dtype=torch.long) for k, v in batch.items()}


def train(
    files: list[ShardFile],
    model_cfg: ModelConfig,
    stream_cfg: StreamConfig,
    train_cfg: TrainConfig,
    run_dir: Path,
    resume_from: Path | None = None,
    progress: bool = True,
) -> TrainResult:
    import deepspeed

    train_cfg.validate()
    model_cfg.validate()
    rank, world = init_distributed()
    torch.manual_seed(train_cfg.seed)
    run_dir = Path(run_dir)
    if world > 1:  # every rank writes its ZeRO shard into rank 0's run folder
        holder = [str(run_dir)]
        torch.distributed.broadcast_object_list(holder, src=0)
        run_dir = Path(holder[0])
    model = Transformer(model_cfg)
    optimizer = torch.optim.AdamW(_param_groups(model, train_cfg.weight_decay), lr=train_cfg.lr,
                                  betas=train_cfg.betas)
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer,
                                                   config=train_cfg.deepspeed_config())
    stream = TokenStream(files, stream_cfg, rank=rank, world_size=world)
    start_step = 0
    if resume_from is not None:
        _, client = engine.load_checkpoint(str(resume_from))
        if client is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {resume_from}")
        _check_resumable(client, resume_from, world, stream_cfg, files)
        stream.load_state_dict(client["data"][str(rank)])
        start_step = int(client["step"])

    metrics = MetricsLog(run_dir / "metrics.jsonl") if rank == 0 else None
    if rank == 0:
        (run_dir / "config.json").write_text(json.dumps(
            {"model": asdict(model_cfg), "stream": asdict(stream_cfg), "train": asdict(train_cfg),
             "world_size": world}, indent=2))
    autocast = (torch.autocast(engine.device.type, dtype=torch.bfloat16) if train_cfg.bf16_autocast
                else contextlib.nullcontext())
    batches = stream.batches(train_cfg.micro_batch_size)
    losses: list[float] = []
    tokens_seen, train_seconds = 0, 0.0
    bar = tqdm(total=train_cfg.steps, initial=start_step, desc="train", disable=not progress or rank != 0,
               dynamic_ncols=True)
    end_step = train_cfg.stop_after or train_cfg.steps
    if start_step >= end_step:
        raise ValueError(f"checkpoint is at step {start_step}; nothing to do before step {end_step}")
    for step in range(start_step, end_step):
        t0 = time.perf_counter()
        step_loss = 0.0
        for _ in range(train_cfg.grad_accum):
            batch = _to_tensors(next(batches), engine.device)
            with autocast:
                loss = engine.module.loss(batch)
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / train_cfg.grad_accum
            tokens_seen += int((batch["labels"] != -100).sum()) * world
        train_seconds += time.perf_counter() - t0
        losses.append(step_loss)
        bar.update(1)
        bar.set_postfix(loss=f"{step_loss:.3f}")
        if metrics is not None and (step % train_cfg.log_every == 0 or step == end_step - 1):
            metrics.log({"step": step, "loss": step_loss, "lr": scheduler.get_last_lr()[0],
                         "tokens_per_second": tokens_seen / max(train_seconds, 1e-9)})
    bar.close()

    checkpoint = None
    if train_cfg.save_checkpoint:
        checkpoint = str(run_dir / "checkpoint")
        engine.save_checkpoint(checkpoint, client_state={
            "data": _gather_states(stream, world), "step": end_step, "world_size": world,
            "stream": asdict(stream_cfg), "files": [f.path for f in files]})
    plot = None
    if metrics is not None:
        metrics.close()
        plot = plot_loss(metrics.records, run_dir / "loss.png")
    return TrainResult(
        steps=end_step - start_step,
        first_loss=losses[0],
        last_loss=float(np.mean(losses[-10:])),
        tokens_per_second=tokens_seen / max(train_seconds, 1e-9),
        tokens_seen=tokens_seen,
        parameters=sum(p.numel() for p in model.parameters()),
        run_dir=str(run_dir),
        checkpoint=checkpoint,
        loss_plot=str(plot) if plot else None,
        world_size=world,
        losses=losses,
    )


def _check_resumable(client: dict, path: Path, world: int, stream_cfg: StreamConfig, files: list[ShardFile]) -> None:
    """A stream position means something only for the same data, stream settings and ranks."""
    missing = [key for key in ("data", "step", "world_size", "stream", "files") if key not in client]
    if missing:
        raise ValueError(f"checkpoint {path} was not written by `tokenloom train` (it lacks {missing})")
    if client["world_size"] != world:
        raise ValueError(f"checkpoint {path} was written by {client['world_size']} ranks; resume it with the same "
                         f"number (this run has {world})")
    if client["stream"] != asdict(stream_cfg):
        raise ValueError(f"checkpoint {path} streamed with {client['stream']}, this run with {asdict(stream_cfg)}; "
                         "resume with the same stream.* settings")
    if client["files"] != [f.path for f in files]:
        raise ValueError(f"checkpoint {path} trained on another snapshot's files; pass --at with the snapshot it used "
                         "(see source.json in its run folder)")


def _gather_states(stream: TokenStream, world: int) -> dict:
    """Every rank's stream state, keyed by rank, so any rank can resume from the checkpoint."""
    state = stream.state_dict()
    if world == 1:
        return {"0": state}
    gathered: list[dict | None] = [None] * world
    torch.distributed.all_gather_object(gathered, state)
    return {str(r): s for r, s in enumerate(gathered)}
