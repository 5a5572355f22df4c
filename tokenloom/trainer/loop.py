"""The training loop: one loop, configured, for every model the catalog can feed.

DeepSpeed owns the optimizer step, ZeRO partitioning, gradient clipping and the LR
schedule (and, with `train.expert_parallel`, the expert/data process groups and MoE parameter
groups); this file owns the data stream, the elastic sub-model of each step, the routers'
auxiliary-loss-free bias updates (from loads summed over every rank, so biases stay equal),
the attention mask's intervals (computed once per micro-batch from the row's segment columns
and handed to the model), precision context, logging (per-modality losses, per-layer routing
balance, gradient norm, learning rate, peak memory) and when to checkpoint (`trainer.checkpoints`
writes them atomically). At every checkpoint and at the end it evaluates the full model on the
held-out split (`stream.holdout`, `train.eval_batches` per modality mix, `trainer.evaluate`): the
training losses by modality rest on the few rare-modality targets of recent steps, the held-out
ones on a fixed set of rows that holds every modality of the split. The data comes from
`datasets.loader` (canonical readers, mixture sources, follow segments); its state, gathered from
every rank, is saved inside each DeepSpeed checkpoint (client state), so resuming a run continues
with exactly the batch the interrupted run would have read next, and its losses and weights are
the uninterrupted run's. On another number of ranks the rows are still the same (the readers fix
them) and DeepSpeed's ZeRO shards load through its universal checkpoint. It also switches stages
(`train.stages`: a loader per stage, rows per micro-batch scaled to keep positions per step, the
stage's RoPE base), asks the job for new snapshots in follow mode, and applies progressive
unfreezing (`train.unfreeze_every`).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from tokenloom.contract import IGNORE_INDEX, MODALITIES, MODALITY_SLOTS
from tokenloom.datasets import ShardFile, StreamConfig
from tokenloom.datasets.loader import Source
from tokenloom.model import ModelConfig
from tokenloom.model.elastic import sample_submodel
from tokenloom.model.io import save_model
from tokenloom.model.unified import UnifiedModel, mask_indices, routing_metrics
from tokenloom.trainer import checkpoints
from tokenloom.trainer.config import TrainConfig
from tokenloom.trainer.data import RunData
from tokenloom.trainer.distributed import init_distributed, use_bf16
from tokenloom.trainer.evaluate import by_modality, evaluate, group_by_mix
from tokenloom.trainer.metrics import MetricsLog, peak_memory, plot_loss, plot_routing


@dataclass
class TrainResult:
    steps: int
    first_loss: float
    last_loss: float
    tokens_per_second: float
    tokens_seen: int
    parameters: int
    run_dir: str
    checkpoint: str | None  # the newest checkpoint this invocation wrote
    loss_plot: str | None
    world_size: int = 1
    losses: list[float] = field(default_factory=list)
    modality_loss: dict[str, float | None] = field(default_factory=dict)  # last 10 steps, per target modality
    routing: dict[str, float] = field(default_factory=dict)  # balance over the last 10 steps
    model_dir: str | None = None
    routing_plot: str | None = None
    active_parameters: int = 0
    # the held-out loss at the end: {"step", "rows", <modality>: {"loss", "tokens"[, "reason"]}}
    val_loss: dict = field(default_factory=dict)
    evaluations: list[dict] = field(default_factory=list)  # every held-out evaluation of this invocation
    tokens_by_source: dict[str, int] = field(default_factory=dict)  # training targets per source, whole run
    segments: list[dict] = field(default_factory=list)  # follow mode: snapshots read as segments
    stage: int = 0  # the stage the run ended in (train.stages)
    # the share of the training time spent reading and packing rows (the stream's cost to the step)
    data_share: float = 0.0


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Matrices decay, vectors (norms, biases) do not."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _to_tensors(batch: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """The rows as tensors of their own dtype (`contract.ROW_DTYPE`): no copy on the CPU, half the bytes
    of int64 to an accelerator; the model widens the targets it needs."""
    return {k: torch.from_numpy(v).to(device) for k, v in batch.items()}


def active_parameters(cfg: ModelConfig, total: int) -> int:
    """Parameters one token uses: all but the routed experts it is not sent to."""
    per_expert = 3 * cfg.dim * cfg.moe.expert_hidden
    return total - cfg.n_layers * (cfg.moe.n_experts - cfg.moe.top_k) * per_expert


class StepStats:
    """Per-step sums that every rank contributes to: CE sums and counts per modality, expert loads."""

    KEYS = tuple(f"{kind}_{m}" for kind in ("sum", "count") for m in MODALITIES)

    def __init__(self, layers: int, experts: int, sources: int = 1):
        self.parts = torch.zeros(len(self.KEYS))
        self.loads = torch.zeros(layers, MODALITY_SLOTS, experts)
        self.sources = torch.zeros(sources, dtype=torch.float64)  # training targets per source

    def add(self, parts: dict[str, torch.Tensor], loads: torch.Tensor) -> None:
        self.parts += torch.stack([parts[k].detach().float().cpu() for k in self.KEYS])
        self.loads += loads

    def reduce(self, world: int) -> None:
        if world > 1:
            n, m = len(self.KEYS), self.loads.numel()
            flat = torch.cat([self.parts.double(), self.loads.flatten().double(), self.sources])
            if torch.distributed.get_backend() == "nccl":  # NCCL reduces only CUDA tensors
                flat = flat.to(torch.device("cuda", torch.cuda.current_device()))
            torch.distributed.all_reduce(flat)
            flat = flat.cpu()
            self.parts = flat[:n].float()
            self.loads = flat[n : n + m].float().view_as(self.loads)
            self.sources = flat[n + m :]

    def modality_losses(self) -> dict[str, float | None]:
        n = len(MODALITIES)
        return {f"loss_{m}": (float(self.parts[i] / self.parts[n + i]) if self.parts[n + i] > 0 else None)
                for i, m in enumerate(MODALITIES)}


def train(
    sources: list[Source] | list[ShardFile],
    model_cfg: ModelConfig,
    stream_cfg: StreamConfig,
    train_cfg: TrainConfig,
    run_dir: Path,
    resume_from: Path | None = None,
    progress: bool = True,
    provenance: dict | None = None,
    init_state: dict[str, torch.Tensor] | None = None,
    follow: Callable[[dict[str, int]], list[tuple[str, int, list[ShardFile], list[str]]]] | None = None,
) -> TrainResult:
    """Train for `train_cfg.steps` (or up to `stop_after`), from step 0 or from the checkpoint
    `resume_from` (a checkpoint folder, a run's `checkpoint/` folder or a run folder: its newest
    complete checkpoint). `provenance`: what the job knows of the data and code (dataset, snapshot
    id, vocabulary id, bundle ids, code version), written into every checkpoint's manifest.
    `init_state`: a trained model's state dict to start from (`--init-from`, fine-tuning); a resumed
    checkpoint's weights replace it. `sources`: the datasets (a mixture) or one dataset's files.
    `follow`: called on rank 0 every `train.follow_every` steps with the newest snapshot streamed per
    source; returns the snapshots committed since as (source, snapshot id, files of its new rows,
    sample ids it deleted), each then read once and its deletions no longer read (follow mode)."""
    import deepspeed

    train_cfg.validate()
    model_cfg.validate()
    if sources and isinstance(sources[0], ShardFile):
        sources = [Source("data", tuple(sources))]
    files = [f for s in sources for f in s.files]
    rank, world = init_distributed()
    torch.manual_seed(train_cfg.seed)
    run_dir = Path(run_dir)
    if world > 1:  # every rank writes its ZeRO shard into rank 0's run folder
        holder = [str(run_dir)]
        torch.distributed.broadcast_object_list(holder, src=0)
        run_dir = Path(holder[0])
    configured = asdict(model_cfg)  # as given (a stage's RoPE base is set on the live config by `RunData`)
    data = None
    if resume_from is None:  # a new run's rows: the first windows of files are read while the model and engine are built
        data = RunData(sources, stream_cfg, train_cfg, model_cfg, rank, world, 0, None, run_dir)
        data.loader.prefetch()
    model = UnifiedModel(model_cfg)
    if init_state is not None:  # before expert parallel slices the experts: the state holds all of them
        model.load_state_dict(init_state)
    parameters = sum(p.numel() for p in model.parameters())
    ep = train_cfg.expert_parallel
    if ep > 1:  # before the optimizer and engine exist: this replaces the expert weights by local slices
        from tokenloom.trainer.expert_parallel import apply_expert_parallel, optimizer_param_groups

        apply_expert_parallel(model, ep)
        groups = optimizer_param_groups(model, train_cfg.weight_decay)
    else:
        groups = param_groups(model, train_cfg.weight_decay)
    unfreezing = None
    if train_cfg.unfreeze_every:  # tensor hooks on the full model, before DeepSpeed wraps it
        from tokenloom.trainer.optim import ProgressiveUnfreezing

        unfreezing = ProgressiveUnfreezing(model, train_cfg.unfreeze_every)
    ds_config = train_cfg.deepspeed_config()
    resume_from = checkpoints.find_checkpoint(resume_from) if resume_from is not None else None
    manifest = checkpoints.read_manifest(resume_from) if resume_from is not None else None
    load_dir, load_tag = (resume_from.parent, resume_from.name) if resume_from else (None, None)
    if manifest is not None and int(manifest.get("world_size", world)) != world:
        if ep > 1:
            raise ValueError(f"checkpoint {resume_from} was written by {manifest['world_size']} ranks with expert "
                             f"parallelism; resume it with the same number of ranks (this run has {world})")
        # ZeRO's optimizer shards are per rank: load through DeepSpeed's universal checkpoint
        load_dir, load_tag = resume_from, checkpoints.universal(resume_from, rank, world).name
        ds_config["checkpoint"] = {"load_universal": True}
    if train_cfg.optimizer == "lazy_adamw":  # DeepSpeed wraps it and hands it flat fp32 partitions
        from tokenloom.trainer.optim import LazyAdamW

        optimizer = LazyAdamW(groups, lr=train_cfg.lr, betas=train_cfg.betas)
    else:
        optimizer = torch.optim.AdamW(groups, lr=train_cfg.lr, betas=train_cfg.betas)
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    start_step, client = 0, None
    if resume_from is not None:
        _, client = engine.load_checkpoint(str(load_dir), tag=load_tag)
        if client is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {resume_from}")
        _check_resumable(client, resume_from, world, stream_cfg, files)
        if ep > 1:  # DeepSpeed wrote rank 0's module; put each rank's own expert slices back
            from tokenloom.trainer.expert_parallel import refresh_after_checkpoint_load

            refresh_after_checkpoint_load(engine)
        start_step = int(client["step"])
        # the groups' lr as the scheduler set it at the saved step (a universal load does not restore it)
        for group, lr in zip(engine.optimizer.param_groups, scheduler.get_lr(), strict=True):
            group["lr"] = lr

    bf16 = use_bf16(train_cfg.precision, engine.device)
    autocast = torch.autocast(engine.device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    metrics = MetricsLog(run_dir / "metrics.jsonl", resume_at=start_step if resume_from else None) if rank == 0 else None
    if rank == 0:
        (run_dir / "config.json").write_text(json.dumps(
            {"model": configured, "stream": asdict(stream_cfg), "train": asdict(train_cfg),
             "world_size": world, "bf16_autocast": bf16}, indent=2))
    if data is None:  # a resumed run's rows start where its checkpoint's did
        data = RunData(sources, stream_cfg, train_cfg, engine.module.cfg, rank, world, start_step, client, run_dir)
    losses: list[float] = []
    recent: list[StepStats] = []
    tokens_seen, train_seconds, data_seconds = 0, 0.0, 0.0
    bar = tqdm(total=train_cfg.steps, initial=start_step, desc="train", disable=not progress or rank != 0,
               dynamic_ncols=True)
    end_step = train_cfg.stop_after or train_cfg.steps
    if start_step >= end_step:
        raise ValueError(f"checkpoint is at step {start_step}; nothing to do before step {end_step}")
    late_loads = torch.zeros(model_cfg.n_layers, MODALITY_SLOTS, model_cfg.moe.n_experts)  # the last quarter of the run
    late_from = end_step - max(1, (end_step - start_step) // 4)
    sandwich = model_cfg.elastic.enabled and model_cfg.elastic.sandwich
    window: list[StepStats] = []  # steps since the last log record
    window_grad_norms: list[float] = []
    window_fill: list[float] = []  # per micro-batch: the non-padding share of its rows
    schedule = checkpoints.Schedule(train_cfg.checkpoint_every, train_cfg.checkpoint_every_minutes, world,
                                    engine.device)
    checkpoint: Path | None = None
    evaluations: list[dict] = []
    val_cfg = replace(stream_cfg, split="val")
    no_eval = ("stream.holdout is 0: there is no held-out split to evaluate (set stream.holdout, e.g. 0.1)"
               if stream_cfg.holdout <= 0 else
               "train.eval_batches is 0: held-out evaluation is off" if train_cfg.eval_batches == 0 else None)
    val_groups = group_by_mix(files) if no_eval is None else None

    def held_out_eval(done: int) -> dict:
        """The full model (no elastic cut), in eval mode, at the training precision, on the held-out rows."""
        if no_eval is not None:
            doc = {"step": done, "rows": 0, **by_modality(None, no_eval)}
        else:
            result = evaluate(engine.module, files, val_cfg, train_cfg.eval_batches, train_cfg.micro_batch_size,
                              rank=rank, world_size=world, groups=val_groups, autocast=autocast)
            engine.module.train()
            doc = {"step": done, "rows": result["rows"], **by_modality(result)}
            if metrics is not None:  # logged at the last trained step's index, so a resume keeps it
                metrics.log({"step": done - 1, "eval": "held-out", "steps_done": done, "val_loss": result["loss"],
                             "val_rows": result["rows"],
                             **{f"val_loss_{m}": result[f"loss_{m}"] for m in MODALITIES},
                             **{f"val_tokens_{m}": result[f"tokens_{m}"] for m in MODALITIES}})
        evaluations.append(doc)
        return doc

    def save(at_step: int) -> Path:
        client = {**data.checkpoint_state(), "step": at_step, "world_size": world, "stream": asdict(stream_cfg),
                  "files": [f.path for f in files]}
        manifest = {**(provenance or {}), "files": len(files),
                    "config": {"model": asdict(model_cfg), "stream": asdict(stream_cfg), "train": asdict(train_cfg)}}
        path = checkpoints.save(engine, run_dir / checkpoints.ROOT, at_step, client, manifest, train_cfg.keep_last,
                                rank, world)
        schedule.saved()
        return path
    for step in range(start_step, end_step):
        switched = data.at_step(step)
        if switched is not None and metrics is not None:
            metrics.log(switched)
        if follow is not None and step > start_step and step % train_cfg.follow_every == 0:
            for doc in data.follow(step, _broadcast(follow(data.seen) if rank == 0 else None, world)):
                if metrics is not None:
                    metrics.log({"step": step, "follow": doc})
        if unfreezing is not None:
            unfreezing.at(step)
        t0 = time.perf_counter()
        sub = sample_submodel(model_cfg, step)
        stats = StepStats(model_cfg.n_layers, model_cfg.moe.n_experts, len(sources))
        step_loss = 0.0
        for _ in range(train_cfg.grad_accum):
            t_data = time.perf_counter()
            raw = data.next_batch(step, stats.sources)
            data_seconds += time.perf_counter() - t_data
            window_fill.append(float(raw.pop("fill_ratio").mean()))  # non-padding share of the rows
            batch = _to_tensors(raw, engine.device)
            indices = mask_indices(batch)  # the attention mask's intervals, once per micro-batch
            with autocast:
                loss, parts = engine.module.loss(batch, sub, indices=indices)
                objective = loss
                if sandwich and not sub.full:  # the full model on the same rows; its loss and loads are logged
                    loss, parts = engine.module.loss(batch, None, indices=indices)
                    objective = objective + loss
            engine.backward(objective)
            engine.step()
            stats.add(parts, engine.module.routing_loads())
            step_loss += loss.item() / train_cfg.grad_accum
            tokens_seen += int((batch["labels"] != IGNORE_INDEX).sum()) * world
        stats.reduce(world)
        data.add_counts(stats.sources)
        grad_norm = engine.get_global_grad_norm()  # of this step's update, before clipping
        if grad_norm is not None:
            window_grad_norms.append(float(grad_norm))
        # same loads on every rank: same biases (with the sandwich rule, the full model's loads)
        engine.module.update_router_bias(stats.loads, None if sandwich else sub)
        if step >= late_from:
            late_loads += stats.loads
        train_seconds += time.perf_counter() - t0
        if world > 1:
            holder = torch.tensor([step_loss])
            torch.distributed.all_reduce(holder)
            step_loss = float(holder) / world
        losses.append(step_loss)
        recent = (recent + [stats])[-10:]
        window.append(stats)
        bar.update(1)
        bar.set_postfix(loss=f"{step_loss:.3f}")
        if step % train_cfg.log_every == 0 or step == end_step - 1:
            # per-modality losses over the steps since the last record: images and audio are rare
            merged, window = _merge_recent(window), []
            norms, window_grad_norms = window_grad_norms, []
            fills, window_fill = window_fill, []
            if metrics is not None:
                record = {"step": step, "loss": step_loss, "lr": scheduler.get_last_lr()[0],
                          "grad_norm": norms[-1] if norms else None, "grad_norm_max": max(norms, default=None),
                          "fill_ratio": float(np.mean(fills)), "skipped_samples": data.loader.skipped,
                          "tokens_per_second": tokens_seen / max(train_seconds, 1e-9),
                          "data_share": data_seconds / max(train_seconds, 1e-9), **merged.modality_losses(),
                          **peak_memory(engine.device), "submodel": sub.describe(), "stage": data.stage,
                          "tokens_by_source": dict(data.tokens_by_source),
                          **({"unfrozen_groups": unfreezing.unfrozen()} if unfreezing is not None else {})}
                record.update(routing_metrics(merged.loads))
                metrics.log(record)
        if step + 1 < end_step and schedule.due(step + 1):
            checkpoint = save(step + 1)
            held_out_eval(step + 1)
    bar.close()
    data.close()

    if train_cfg.save_checkpoint:  # the periodic saves stop short of the last step: this one is new
        checkpoint = save(end_step)
    final_eval = held_out_eval(end_step)
    final = _merge_recent(recent)
    routing = _routing_summary(final.loads)
    state = _full_state(engine.module, ep)
    model_dir = plot = routing_plot = None
    if rank == 0:  # the last stage's RoPE base is the model's
        model_dir = str(save_model(state, replace(model_cfg, rope_theta=engine.module.cfg.rope_theta),
                                   run_dir / "model", {"steps": end_step}))
    if metrics is not None:
        metrics.close()
        plot = plot_loss(metrics.records, run_dir / "loss.png")
        routing_plot = plot_routing(late_loads, run_dir / "routing.png",
                                    f"expert load / mean load, steps {late_from}-{end_step - 1} (1 = balanced)")
    return TrainResult(
        steps=end_step - start_step,
        first_loss=losses[0],
        last_loss=float(np.mean(losses[-10:])),
        tokens_per_second=tokens_seen / max(train_seconds, 1e-9),
        tokens_seen=tokens_seen,
        parameters=parameters,
        run_dir=str(run_dir),
        checkpoint=str(checkpoint) if checkpoint else None,
        loss_plot=str(plot) if plot else None,
        world_size=world,
        losses=losses,
        modality_loss=final.modality_losses(),
        routing=routing,
        model_dir=model_dir,
        routing_plot=str(routing_plot) if routing_plot else None,
        active_parameters=active_parameters(model_cfg, parameters),
        val_loss=final_eval,
        evaluations=evaluations,
        tokens_by_source=data.tokens_by_source,
        segments=data.segments,
        stage=data.stage,
        data_share=data_seconds / max(train_seconds, 1e-9),
    )


def _merge_recent(recent: list[StepStats]) -> StepStats:
    out = StepStats(*recent[0].loads.shape[::2])
    for s in recent:
        out.parts += s.parts
        out.loads += s.loads
    return out


def _routing_summary(loads: torch.Tensor) -> dict[str, float]:
    """Mean over layers of each modality's balance (and all modalities together)."""
    per = routing_metrics(loads)
    out: dict[str, float] = {}
    for name in (*MODALITIES, "all"):
        for key in ("load_entropy", "max_violation"):
            values = [v for k, v in per.items() if k.split(".", 1)[1] == f"{name}.{key}"]
            if values:
                out[f"{name}.{key}"] = float(np.mean(values))
    return out


def _full_state(model: UnifiedModel, ep: int) -> dict[str, torch.Tensor]:
    """The model's state dict with every expert (gathered from the expert-parallel ranks)."""
    if ep > 1:
        from tokenloom.trainer.expert_parallel import full_state_dict

        return full_state_dict(model)  # a collective: every rank calls it
    return model.state_dict()


def _check_resumable(client: dict, path: Path, world: int, stream_cfg: StreamConfig, files: list[ShardFile]) -> None:
    """A stream position means something only for the same data, stream settings and ranks."""
    missing = [key for key in ("data", "step", "world_size", "stream", "files") if key not in client]
    if missing:
        raise ValueError(f"checkpoint {path} was not written by `tokenloom train` (it lacks {missing})")
    readers = client["stream"].get("readers", 0)
    if not readers or readers % world:
        raise ValueError(f"checkpoint {path} streamed with stream.readers = {readers}; it resumes on a number of "
                         f"ranks that divides that (this run has {world})")
    if client["stream"] != asdict(stream_cfg):
        raise ValueError(f"checkpoint {path} streamed with {client['stream']}, this run with {asdict(stream_cfg)}; "
                         "resume with the same stream.* settings")
    if client["files"] != [f.path for f in files]:
        raise ValueError(f"checkpoint {path} trained on another snapshot's files; pass --at with the snapshot it used "
                         "(see source.json in its run folder)")


def _broadcast(value, world: int):
    """Rank 0's `value` on every rank."""
    if world == 1:
        return value
    holder = [value]
    torch.distributed.broadcast_object_list(holder, src=0)
    return holder[0]
