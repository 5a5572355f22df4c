"""Expert parallelism for `tokenloom.model.moe.MoE`, applied from the trainer with DeepSpeed.

The model file stays single-device: every MoE layer runs its expert-sorted token rows through
`layer.dispatcher(x_sorted, counts)` when one is set. `AllToAllDispatch` is that dispatcher: it ships
each row to the rank owning its expert, runs the local experts and ships the results back:

    counts [E] ──all-to-all──► counts received from every source rank [P, E/P]
    rows grouped by expert ──all-to-all (uneven splits)──► rows grouped by (source, local expert)
      ──regroup by local expert──► local Experts ──undo regroup──► all-to-all back ──► y_sorted

Rank r of an expert-parallel group of P ranks owns experts [r E/P, (r+1) E/P): its stacked
`gate_up` [E/P, D, 2H] and `down` [E/P, H, D] are slices of the full tensors, and its local
`Experts` run them as the layer's config says (`model.moe.impl`: grouped or loop), on the rows
they receive grouped by local expert. Router, expert
bias and every dense weight stay replicated, so the balancing update needs nothing new.

DeepSpeed groups ranks as in its own MoE: expert-parallel groups of P consecutive ranks
(all-to-all), and expert-data-parallel groups of the ranks holding the same slice (gradient
reduction and ZeRO partitioning of expert weights). DeepSpeed treats a parameter as an expert
weight when `allreduce` is False, and reduces it in the group named by `group_name`; but its
engine only switches its MoE handling on when the model contains a `deepspeed.moe.layer.MoE`.
So each parallelised layer gets a parameter-free subclass of it as a marker (`ds_moe`): without
it, ZeRO would average the gradients of different experts across the expert-parallel ranks.

Gradient scale (what DeepSpeed does, verified by tests/test_expert_parallel.py): after backward,
an expert weight on rank r holds the sum of the gradients of the losses of all P ranks of its
expert-parallel group (the reverse all-to-all brings them back). DeepSpeed divides it by the
whole data-parallel world size W and sums it over the expert-data-parallel group (W/P ranks), so
it ends as the gradient of the mean loss over all W ranks, exactly as for dense weights.

Call order in the trainer: `init_distributed()`, build the model, `apply_expert_parallel`, the
optimizer from `optimizer_param_groups`, then `deepspeed.initialize`; after
`engine.load_checkpoint`, `refresh_after_checkpoint_load(engine)`; `full_state_dict` gathers the
experts back for export.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from tokenloom.model.moe import MoE

# -- the differentiable all-to-all ------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """Rows [sum(input_splits), ...] -> [sum(output_splits), ...]; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return _exchange(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def _exchange(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Differentiable `all_to_all_single` of rows with uneven split sizes (gloo and nccl both take them)."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


# -- the dispatcher ----------------------------------------------------------------------------


class AllToAllDispatch:
    """Drop-in for `Experts.forward(x_sorted, counts)` when the experts are spread over `ep_size` ranks.

    `experts_local` holds experts [ep_rank * E/P, (ep_rank + 1) * E/P); `counts` are global ([E])
    and `x_sorted` [N, D] is grouped by global expert id. Every rank of the group must call this
    the same number of times in the same order (each call is two collectives forward, two back).
    A plain object, not a module, so that the experts' weights are not registered twice.
    """

    def __init__(self, experts_local: nn.Module, ep_group, ep_size: int, ep_rank: int, n_experts: int):
        if n_experts % ep_size:
            raise ValueError(f"{n_experts} experts cannot be split evenly over {ep_size} expert-parallel ranks")
        self.experts_local, self.ep_group = experts_local, ep_group
        self.ep_size, self.ep_rank, self.n_experts = ep_size, ep_rank, n_experts
        self.n_local = n_experts // ep_size

    def __call__(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        P, L = self.ep_size, self.n_local
        if len(counts) != self.n_experts:
            raise ValueError(f"{len(counts)} expert counts for {self.n_experts} experts")
        send = torch.tensor(counts, dtype=torch.long, device=x_sorted.device).view(P, L)
        recv = torch.empty_like(send)  # recv[s, l]: rows from source rank s for local expert l
        dist.all_to_all_single(recv.view(-1), send.view(-1), group=self.ep_group)
        input_splits, output_splits = send.sum(1).tolist(), recv.sum(1).tolist()

        received = all_to_all(x_sorted, output_splits, input_splits, self.ep_group)
        # received is ordered (source, local expert); the experts want (local expert, source)
        chunk = torch.arange(P * L, device=x_sorted.device).repeat_interleave(recv.view(-1))
        order = (chunk % L * P + chunk // L).argsort(stable=True)
        x_local = received[order]
        if x_local.shape[0] == 0:
            # Nothing to compute here, but this rank must still take part in both backward
            # exchanges: keep the output on the autograd graph (and give the experts zero grads).
            y_local = x_local * 0 + sum(p.sum() * 0 for p in self.experts_local.parameters())
        else:
            y_local = self.experts_local(x_local, recv.sum(0).tolist())
        y_received = torch.empty_like(y_local).index_copy(0, order, y_local)
        return all_to_all(y_received, input_splits, output_splits, self.ep_group)


# -- applying it -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertParallelInfo:
    ep_size: int
    ep_rank: int
    group_name: str  # DeepSpeed's name for the expert and expert-data-parallel groups
    local_experts: tuple[int, int]  # [first, last) global expert ids held here (per layer)
    n_layers: int
    ep_group: object = field(default=None, compare=False, repr=False)
    expert_data_group: object = field(default=None, compare=False, repr=False)


def moe_layers(model: nn.Module) -> list[MoE]:
    if hasattr(model, "moe_layers"):
        return list(model.moe_layers())
    return [m for m in model.modules() if isinstance(m, MoE)]


@functools.cache
def _marker_class():
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    class DeepSpeedMoEMarker(DeepSpeedMoE):
        """Parameter-free stand-in that makes DeepSpeedEngine run its MoE code paths.

        DeepSpeed's own constructor is skipped on purpose: it would build a gate and experts.
        `num_local_experts` is 0 because this marker owns no weights: DeepSpeed's per-expert
        checkpoint files would otherwise be expected on load."""

        def __init__(self, n_experts: int, ep_size: int):
            nn.Module.__init__(self)
            self.num_experts, self.ep_size = n_experts, ep_size
            self.expert_group_name = f"ep_size_{ep_size}"
            self.num_local_experts = 0
            self.enable_expert_tensor_parallelism = False
            self.use_residual = False

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
            pass  # the groups were made by apply_expert_parallel

        def forward(self, *args, **kwargs):
            raise RuntimeError("DeepSpeedMoEMarker only marks a tokenloom MoE layer; it is never called")

    return DeepSpeedMoEMarker


def apply_expert_parallel(model: nn.Module, ep_size: int) -> ExpertParallelInfo:
    """Shard every MoE layer's experts over expert-parallel groups of `ep_size` ranks, in place.

    Needs the process group up (`init_distributed`), and must run before the optimizer and
    `deepspeed.initialize` are made, since it replaces the expert parameters. `ep_size == 1`
    changes nothing (every rank keeps all experts; they are then ordinary data-parallel weights).
    """
    if not dist.is_initialized():
        raise RuntimeError("expert parallelism needs torch.distributed: call init_distributed() first")
    from deepspeed.utils import groups

    world = dist.get_world_size()
    if ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size must divide the world size {world}, got {ep_size}")
    layers = moe_layers(model)
    if not layers:
        raise ValueError("the model has no MoE layers to make expert-parallel")
    for i, layer in enumerate(layers):
        if layer.n_experts % ep_size:
            raise ValueError(f"MoE layer {i} has {layer.n_experts} experts, not divisible by ep_size {ep_size}")
        if isinstance(layer.dispatcher, AllToAllDispatch):
            raise ValueError("apply_expert_parallel was already applied to this model")
    name = f"ep_size_{ep_size}"
    if ep_size == 1:
        n = layers[0].n_experts
        return ExpertParallelInfo(1, 0, name, (0, n), len(layers))

    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size)
    ep_group = groups._get_expert_parallel_group(name)
    ep_rank = dist.get_rank(group=ep_group)
    marker = _marker_class()
    for layer in layers:
        n_local = layer.n_experts // ep_size
        first = ep_rank * n_local
        experts = layer.experts
        for pname in ("gate_up", "down"):
            full = getattr(experts, pname)
            local = nn.Parameter(full.detach()[first:first + n_local].clone(), requires_grad=full.requires_grad)
            local.allreduce = False  # deepspeed.moe.utils.is_moe_param
            local.group_name = name
            setattr(experts, pname, local)
        experts.n_experts = n_local
        layer.dispatcher = AllToAllDispatch(experts, ep_group, ep_size, ep_rank, layer.n_experts)
        layer.add_module("ds_moe", marker(layer.n_experts, ep_size))
    return ExpertParallelInfo(ep_size, ep_rank, name, (first, first + n_local), len(layers), ep_group,
                              groups._get_expert_data_parallel_group(name))


def optimizer_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups (decay for matrices, none for vectors), with expert weights in their own groups.

    DeepSpeed's ZeRO partitions and reduces each group marked `moe` over the expert-data-parallel
    group it names; it only splits groups itself when it builds the optimizer, not for one passed in.
    """
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"name": "decay", "params": decay, "weight_decay": weight_decay},
              {"name": "no_decay", "params": no_decay, "weight_decay": 0.0}]
    groups = split_params_into_different_moe_groups_for_optimizer(groups)
    return [g for g in groups if g["params"]]


# -- checkpoints and export ----------------------------------------------------------------------


def _is_expert_parallel(model: nn.Module) -> bool:
    return any(isinstance(m, MoE) and isinstance(m.dispatcher, AllToAllDispatch) for m in model.modules())


def refresh_after_checkpoint_load(engine) -> None:
    """Call right after `engine.load_checkpoint`: put each rank's own expert slices back in the model.

    DeepSpeed writes the module weights once, from data-parallel rank 0, so every rank loads rank
    0's expert slices into its model; each rank's ZeRO file holds its own fp32 master copy, which
    is restored correctly (`zero_load_from_fp32_weights`, on by default). Copying the master
    copies back into the module makes a resumed run equal the uninterrupted one. No-op without
    expert parallelism."""
    if not _is_expert_parallel(engine.module):
        return
    if not hasattr(engine.optimizer, "update_lp_params"):
        raise NotImplementedError("resuming an expert-parallel run needs ZeRO stage 1 or 2 "
                                  "(the master copies of the expert slices live in the ZeRO files)")
    engine.optimizer.update_lp_params()



def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with every expert slice all-gathered into its full [E, ...] tensor.

    A collective: every rank of the world calls it and gets the same full state dict, which
    loads into the same model built without expert parallelism."""
    state = {k: v for k, v in model.state_dict().items() if ".ds_moe." not in k}
    for prefix, layer in model.named_modules():
        if isinstance(layer, MoE) and isinstance(layer.dispatcher, AllToAllDispatch):
            d = layer.dispatcher
            for pname in ("gate_up", "down"):
                local = getattr(layer.experts, pname).detach().contiguous()
                parts = [torch.empty_like(local) for _ in range(d.ep_size)]
                dist.all_gather(parts, local, group=d.ep_group)
                state[f"{prefix}.experts.{pname}" if prefix else f"experts.{pname}"] = torch.cat(parts)
    return state
