"""One rank of the expert-parallel checks in test_expert_parallel.py (run as a script, one per rank).

    python tests/expert_parallel_worker.py OUT_DIR EP_SIZE     (RANK, WORLD_SIZE, MASTER_* set)

With WORLD_SIZE 1 it is the single-process reference; with 2 ranks and EP_SIZE 2 each rank holds
half of the experts and half of the same global batch. Results go to OUT_DIR as JSON and .pt
files for the test to compare:
  dispatch_{impl}_rank{r}.json  AllToAllDispatch against the local experts (forward and gradients),
                         with the experts run grouped and as a loop (MoEConfig.impl)
  adamw.json             per-step global mean loss and grad norm, ZeRO-1 + AdamW, clipping at 1.0;
                         and the last 3 steps again, resumed from a DeepSpeed checkpoint of step 2
  sgd_{clip}.pt          one SGD step (lr 1): the full parameter update, i.e. the gradient DeepSpeed
                         applied, unclipped and clipped
  unified.json           the real UnifiedModel (text + image + audio rows, MTP, aux losses) trained as
                         tokenloom.trainer.loop does: ZeRO-1 AdamW with the run's LR schedule, the
                         elastic sub-model of each step, router biases from loads summed over ranks
                         (`StepStats`); per-step global losses, per-modality losses and loads
  unified_state.pt       its final `full_state_dict` (experts gathered) and its initial one
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import multimodal_data as mm  # tests/, this script's folder, is on sys.path
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.datasets.stream import pack_row, sample_positions
from tokenloom.model import ModelConfig, MoEConfig, SubModel, UnifiedModel
from tokenloom.model.moe import MoE
from tokenloom.model.unified import mask_indices
from tokenloom.trainer.config import TrainConfig
from tokenloom.trainer.distributed import destroy_process_group, init_distributed
from tokenloom.trainer.expert_parallel import (
    apply_expert_parallel,
    full_state_dict,
    optimizer_param_groups,
    refresh_after_checkpoint_load,
)
from tokenloom.trainer.loop import StepStats

VOCAB, DIM, N_EXPERTS, TOP_K, HIDDEN, N_LAYERS = 64, 32, 4, 2, 32, 2
GLOBAL_BATCH, SEQ = 8, 17
MOE = MoEConfig(n_experts=N_EXPERTS, top_k=TOP_K, expert_hidden=HIDDEN)


class TinyMoELM(nn.Module):
    """Embedding -> residual MoE blocks (pre-RMSNorm) -> head; mean next-token cross-entropy."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norms = nn.ModuleList(nn.RMSNorm(DIM) for _ in range(N_LAYERS))
        self.moes = nn.ModuleList(MoE(DIM, MOE) for _ in range(N_LAYERS))
        self.final_norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def moe_layers(self) -> list[MoE]:
        return list(self.moes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        aux = x.new_zeros(())
        for norm, moe in zip(self.norms, self.moes, strict=True):
            y, a = moe(norm(x))
            x, aux = x + y, aux + a
        logits = self.head(self.final_norm(x))
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) + aux


def global_batch() -> torch.Tensor:
    """Learnable sequences: each row counts up by its own stride from a random start."""
    g = torch.Generator().manual_seed(1234)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 5, (GLOBAL_BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ)) % VOCAB


def build(ep_size: int, world: int, optimizer: str, clip: float):
    import deepspeed

    torch.manual_seed(0)
    model = TinyMoELM()
    if world > 1:
        apply_expert_parallel(model, ep_size)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(optimizer_param_groups(model, weight_decay=0.1), lr=1e-2, betas=(0.9, 0.95))
    else:  # no decay, lr 1: the update is exactly the gradient DeepSpeed reduced (and clipped)
        opt = torch.optim.SGD(optimizer_param_groups(model, weight_decay=0.0), lr=1.0)
    config = {"train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
              "gradient_clipping": clip, "zero_optimization": {"stage": 1},
              "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return engine


def train_step(engine, tokens: torch.Tensor, world: int) -> float:
    loss = engine(tokens)
    engine.backward(loss)
    engine.step()
    for moe in engine.module.moe_layers():  # what the trainer does: global loads, one bias update
        load = moe.last_load[:3].sum(0)
        if world > 1:
            torch.distributed.all_reduce(load)
        moe.update_bias(load)
    mean = loss.detach().clone()
    if world > 1:
        torch.distributed.all_reduce(mean)
    return float(mean) / world


def check_dispatch(out: Path, rank: int, impl: str) -> None:
    """AllToAllDispatch equals the local experts: outputs, input grads, expert grads (summed over ranks)."""
    torch.manual_seed(0)
    ref = MoE(DIM, MoEConfig(n_experts=N_EXPERTS, top_k=TOP_K, expert_hidden=HIDDEN, impl=impl))
    holder = nn.ModuleList([copy.deepcopy(ref)])
    info = apply_expert_parallel(holder, ep_size=2)
    ep = holder[0]
    first, last = info.local_experts
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(2, 5 + 3 * rank, DIM, generator=g)  # uneven token counts across ranks
    w = torch.randn(x.shape, generator=g)
    results = {}
    for case, allowed in [("all_experts", None), ("rank1_receives_nothing", torch.tensor([True, True, False, False]))]:
        grads = []
        for moe in (ref, ep):
            moe.zero_grad(set_to_none=False)
            xi = x.clone().requires_grad_(True)
            y, _ = moe(xi, allowed=allowed)
            (y * w).sum().backward()
            grads.append((y.detach(), xi.grad, moe.router.grad.clone(),
                          moe.experts.gate_up.grad.clone(), moe.experts.down.grad.clone()))
        (y_ref, gx_ref, gr_ref, gu_ref, gd_ref), (y_ep, gx_ep, gr_ep, gu_ep, gd_ep) = grads
        for t in (gu_ref, gd_ref):  # an expert's gradient gathers the losses of every rank
            torch.distributed.all_reduce(t)
        results[case] = {
            "assignments": int(ep.last_load.sum()),
            "y": float((y_ep - y_ref).abs().max()),
            "x_grad": float((gx_ep - gx_ref).abs().max()),
            "router_grad": float((gr_ep - gr_ref).abs().max()),
            "gate_up_grad": float((gu_ep - gu_ref[first:last]).abs().max()),
            "down_grad": float((gd_ep - gd_ref[first:last]).abs().max()),
            "expert_grad_scale": float(gu_ref[first:last].abs().max()),
        }
    results["shapes"] = {"gate_up": list(ep.experts.gate_up.shape), "down": list(ep.experts.down.shape)}
    (out / f"dispatch_{impl}_rank{rank}.json").write_text(json.dumps(results))


def main(out: Path, ep_size: int) -> None:
    rank, world = init_distributed()
    if world > 1:
        for impl in ("grouped", "loop"):
            check_dispatch(out, rank, impl)
    check_unified(out, rank, world)
    tokens = global_batch()
    per_rank = GLOBAL_BATCH // world
    local = tokens[rank * per_rank:(rank + 1) * per_rank]

    engine = build(ep_size, world, "adamw", clip=1.0)
    losses, norms = [], []
    for step in range(5):
        if step == 2:
            engine.save_checkpoint(str(out / "checkpoint"), tag="step2")
        losses.append(train_step(engine, local, world))
        norms.append(float(engine.get_global_grad_norm()))
    engine = build(ep_size, world, "adamw", clip=1.0)
    engine.load_checkpoint(str(out / "checkpoint"), tag="step2")
    refresh_after_checkpoint_load(engine)
    resumed = [train_step(engine, local, world) for _ in range(3)]
    if rank == 0:
        (out / "adamw.json").write_text(json.dumps({"losses": losses, "grad_norms": norms, "resumed": resumed}))

    for clip in (0.0, 0.05):
        engine = build(ep_size, world, "sgd", clip=clip)
        before = {k: v.clone() for k, v in full_state_dict(engine.module).items()}
        train_step(engine, local, world)
        after = full_state_dict(engine.module)
        if rank == 0:
            update = {k: before[k] - after[k] for k in before if before[k].is_floating_point()}
            torch.save({"update": update, "grad_norm": float(engine.get_global_grad_norm())}, out / f"sgd_{clip}.pt")
    # Leave the process group before exiting: without this, gloo's threads sometimes outlive the
    # interpreter and a rank aborts at exit ("terminate called without an active exception").
    torch.distributed.barrier()
    destroy_process_group()  # through DeepSpeed: it drops its cached groups


# -- the real model, trained as tokenloom.trainer.loop trains it -------------------------------

UNIFIED_ROWS, UNIFIED_SEQ = 4, 56
# The steps' sub-models: full, elastic width + sparsity (expert 2 gets no rows: rank 1 computes
# for one expert only), elastic depth (layer 0's experts get no gradient), full again.
UNIFIED_SUBMODELS = [SubModel(), SubModel(), SubModel(experts=(0, 1, 3), top_k=1), SubModel(layers=(1,)),
                     SubModel(), SubModel()]


def unified_config() -> ModelConfig:
    moe = MoEConfig(n_experts=4, top_k=2, expert_hidden=32, seq_balance_weight=1e-2, router_z_weight=1e-3,
                    router_bias_update=1e-2)
    return ModelConfig(vocab_size=mm.VOCAB, audio_ranges=mm.AUDIO_RANGES, dim=32, n_layers=2, n_heads=2, moe=moe,
                       mtp=True)


def unified_rows() -> list[dict[str, np.ndarray]]:
    """4 packed rows: rows 0 and 2, and rows 1 and 3, have the same structure with different ids.

    So each half (a rank's micro-batch with 2 ranks) has the same number of targets per
    modality, of MTP targets and of valid (non-padding) positions: every loss term's mean over
    the global batch then equals the mean of the two ranks' means, which is what 2 data-parallel
    ranks optimise."""
    rows = []
    for half in range(2):
        rng = np.random.default_rng(10 + half)
        a = [mm.text_sample(rng, 12), mm.image_sample(rng), mm.audio_sample(rng, frames=6)]
        b = [mm.image_sample(rng, h=2, w=3, caption=3), mm.text_sample(rng, 10), mm.audio_sample(rng, frames=8)]
        for samples in (a, b):
            rows.append(pack_row([sample_positions(t, sg, 2, 4) for t, sg in samples], UNIFIED_SEQ))
    return rows


def as_batch(rows: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    return {k: torch.from_numpy(np.stack([r[k] for r in rows])).long() for k in rows[0]}


def gather_counts(parts: dict[str, torch.Tensor], world: int) -> list[list[float]]:
    """Each rank's count of targets per modality (text, image, audio) in this step."""
    local = torch.stack([parts[f"count_{m}"] for m in ("text", "image", "audio")]).float()
    if world == 1:
        return [local.tolist()]
    every = [torch.empty_like(local) for _ in range(world)]
    torch.distributed.all_gather(every, local)
    return [t.tolist() for t in every]


def check_unified(out: Path, rank: int, world: int) -> None:
    import deepspeed

    rows = unified_rows()
    per_rank = UNIFIED_ROWS // world
    batch = as_batch(rows[rank * per_rank:(rank + 1) * per_rank])
    cfg = unified_config()
    torch.manual_seed(0)
    model = UnifiedModel(cfg)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    train_cfg = TrainConfig(steps=len(UNIFIED_SUBMODELS), micro_batch_size=per_rank, lr=1e-2, warmup_steps=1,
                            expert_parallel=world)
    if world > 1:
        apply_expert_parallel(model, train_cfg.expert_parallel)
    opt = torch.optim.AdamW(optimizer_param_groups(model, train_cfg.weight_decay), lr=train_cfg.lr,
                            betas=train_cfg.betas)
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=opt, config=train_cfg.deepspeed_config())
    indices = mask_indices(batch)  # once per micro-batch, as the trainer does
    steps = []
    # The body of the loop in tokenloom.trainer.loop.train, in fp32 (train.precision=fp32; "auto"
    # would autocast to bf16 on CPUs with AMX). DeepSpeed's WarmupCosineLR gives steps 0 and 1 lr 0,
    # so steps 2-5 (both restricted sub-models among them) update the weights.
    for sub in UNIFIED_SUBMODELS:
        stats = StepStats(cfg.n_layers, cfg.moe.n_experts)
        loss, parts = engine.module.loss(batch, sub, indices=indices)
        engine.backward(loss)
        engine.step()
        stats.add(parts, engine.module.routing_loads())
        stats.reduce(world)
        engine.module.update_router_bias(stats.loads, sub)
        holder = torch.tensor([loss.item(), float(parts["aux"]), float(parts["loss_mtp"])])
        if world > 1:
            torch.distributed.all_reduce(holder)
        loss_mean, aux_mean, mtp_mean = (holder / world).tolist()
        steps.append({"loss": loss_mean, "aux": aux_mean, "mtp": mtp_mean, **stats.modality_losses(),
                      "counts": stats.parts[len(StepStats.KEYS) // 2:].tolist(),
                      "rank_counts": gather_counts(parts, world),
                      "loads": stats.loads.tolist(), "grad_norm": float(engine.get_global_grad_norm()),
                      "lr": scheduler.get_last_lr()[0]})
    state = full_state_dict(engine.module) if world > 1 else engine.module.state_dict()
    if rank == 0:
        (out / "unified.json").write_text(json.dumps({"steps": steps, "world": world}))
        torch.save({"initial": initial, "final": {k: v.detach().clone() for k, v in state.items()}},
                   out / "unified_state.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
