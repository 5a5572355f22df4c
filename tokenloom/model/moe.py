"""Fine-grained mixture of experts with a shared expert and auxiliary-loss-free balancing.

Routing (DeepSeek-V3 style, modality-agnostic: the router never sees which modality a token
came from). Each token gets sigmoid affinities s = sigmoid(x W_r) over all E routed experts;
the top-k experts are *selected* on s + b, where b is a per-expert bias that is not trained by
gradients but nudged after every optimizer step (`update_bias`: b_e += u * sign(mean load -
load_e)), and the selected experts are *weighted* by s alone, renormalized over the k chosen.
Optional extras: a sequence-level balance loss (alpha * sum_e f_e P_e per row) and the router
z-loss (mean logsumexp(logits)^2). Every token is processed: there is no capacity and no drop.

Experts are SwiGLU MLPs stored as stacked weights ([E, D, 2H] and [E, H, D]), so one parameter
holds all experts and a rank that owns a slice of them (expert parallelism, applied from the
trainer) holds a slice of each tensor. Tokens are sorted by expert, each expert runs on its
contiguous slice, and the weighted outputs are added back to their tokens.

The expert computation goes through `self.dispatcher(x_sorted, counts)` when the trainer has set
one (an all-to-all dispatcher for expert parallelism; this file knows nothing of process
groups), else through `self.experts`, which runs every expert locally.

Elastic restriction, per forward: `allowed` (bool [E]) limits routing to a subset of experts,
`top_k` overrides k. The statistics of the last forward (expert load per modality, for the
balancing update and the metrics) are kept in `self.last_load`.

Shapes: N tokens, D model dim, E routed experts, H expert hidden size, k experts per token.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

N_MODALITY_SLOTS = 4  # text, image, audio, padding (padding is excluded from the load)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights; `forward` runs expert e on the e-th slice of its input."""

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.n_experts, self.dim, self.hidden = n_experts, dim, hidden
        self.gate_up = nn.Parameter(torch.empty(n_experts, dim, 2 * hidden))
        self.down = nn.Parameter(torch.empty(n_experts, hidden, dim))
        nn.init.normal_(self.gate_up, std=0.02)
        nn.init.normal_(self.down, std=0.02 / math.sqrt(2))

    def forward(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x_sorted [N, D], grouped by expert with counts[e] rows for expert e -> [N, D]."""
        if len(counts) != self.gate_up.shape[0]:
            raise ValueError(f"{len(counts)} expert counts for {self.gate_up.shape[0]} experts")
        # One unbind, not E indexings: the backward of each `param[e]` writes its gradient into a
        # fresh zero tensor of the whole [E, ...] parameter, which made the backward O(E^2) memory
        # traffic (9x the matmul time at E=64); unbind's backward stacks the E slices once.
        gate_up, down = self.gate_up.unbind(0), self.down.unbind(0)
        outs = []
        for e, chunk in enumerate(x_sorted.split(counts)):
            if chunk.shape[0] == 0:
                continue
            gate, up = (chunk @ gate_up[e]).chunk(2, dim=-1)
            outs.append((F.silu(gate) * up) @ down[e])
        if not outs:
            return x_sorted.new_zeros(x_sorted.shape)
        return torch.cat(outs)


class MoE(nn.Module):
    def __init__(self, dim: int, n_experts: int, top_k: int, expert_hidden: int, n_shared: int = 1,
                 bias_update: float = 1e-3, seq_balance_weight: float = 0.0, z_loss_weight: float = 0.0):
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={n_experts}], got {top_k}")
        self.n_experts, self.top_k = n_experts, top_k
        self.bias_update, self.seq_balance_weight, self.z_loss_weight = bias_update, seq_balance_weight, z_loss_weight
        self.router = nn.Parameter(torch.empty(n_experts, dim))
        nn.init.normal_(self.router, std=0.02)
        self.register_buffer("expert_bias", torch.zeros(n_experts))
        self.experts = Experts(n_experts, dim, expert_hidden)
        self.shared = SwiGLU(dim, expert_hidden * n_shared) if n_shared > 0 else None
        # None: every expert runs here; the trainer sets an all-to-all dispatcher (a plain callable,
        # not a module, so the state dict keeps one copy of the weights) for expert parallelism
        self.dispatcher: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None
        self.last_load: torch.Tensor | None = None  # [N_MODALITY_SLOTS, E] token-expert assignments

    # -- routing --------------------------------------------------------------------------
    def route(self, x: torch.Tensor, allowed: torch.Tensor | None = None, top_k: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> (router logits [N, E] fp32, chosen experts [N, k], gate weights [N, k] fp32)."""
        k = top_k or self.top_k
        logits = F.linear(x.float(), self.router.float())
        scores = logits.sigmoid()
        choice = scores.detach() + self.expert_bias
        if allowed is not None:
            if int(allowed.sum()) < k:
                raise ValueError(f"routing restricted to {int(allowed.sum())} experts cannot pick top-{k}")
            choice = choice.masked_fill(~allowed, float("-inf"))
        chosen = choice.topk(k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-9)
        return logits, chosen, weights

    def forward(self, x: torch.Tensor, modality: torch.Tensor | None = None, allowed: torch.Tensor | None = None,
                top_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, L, D], modality [B, L] (0 text, 1 image, 2 audio, 3 padding) -> (y [B, L, D], aux loss)."""
        B, L, D = x.shape
        flat = x.reshape(-1, D)
        logits, chosen, weights = self.route(flat, allowed, top_k)
        k = chosen.shape[-1]
        expert_of = chosen.reshape(-1)
        order = expert_of.argsort(stable=True)
        token_of = order // k
        counts = torch.bincount(expert_of, minlength=self.n_experts)
        y_sorted = (self.dispatcher or self.experts)(flat[token_of], counts.tolist())
        y_sorted = y_sorted * weights.reshape(-1)[order, None].to(y_sorted.dtype)
        y = torch.zeros_like(flat).index_add_(0, token_of, y_sorted.to(flat.dtype))
        if self.shared is not None:
            y = y + self.shared(flat)

        mod = (modality.reshape(-1) if modality is not None
               else torch.zeros(B * L, dtype=torch.long, device=x.device))
        valid = mod < N_MODALITY_SLOTS - 1
        with torch.no_grad():
            slot = mod.repeat_interleave(k) * self.n_experts + expert_of
            self.last_load = torch.bincount(slot, minlength=N_MODALITY_SLOTS * self.n_experts).view(
                N_MODALITY_SLOTS, self.n_experts).float()
        aux = logits.new_zeros(())
        if self.training and self.seq_balance_weight > 0:
            aux = aux + self.seq_balance_weight * self._sequence_balance(logits, chosen, valid, B, L, allowed)
        if self.training and self.z_loss_weight > 0:
            z = torch.logsumexp(logits, dim=-1).square()
            aux = aux + self.z_loss_weight * (z * valid).sum() / valid.sum().clamp_min(1)
        return y.view(B, L, D), aux

    def _sequence_balance(self, logits, chosen, valid, B, L, allowed) -> torch.Tensor:
        """DeepSeek-V3's complementary sequence-wise balance loss, averaged over rows."""
        E, k = self.n_experts, chosen.shape[-1]
        scores = logits.sigmoid()
        if allowed is not None:
            scores = scores * allowed
        probs = scores / scores.sum(-1, keepdim=True).clamp_min(1e-9)
        v = valid.view(B, L, 1).float()
        tokens = v.sum(1).clamp_min(1)  # [B, 1]
        hits = torch.zeros(B * L, E, device=logits.device).scatter_(1, chosen, 1.0).view(B, L, E)
        f = (hits * v).sum(1) * E / (k * tokens)  # [B, E]
        p = (probs.view(B, L, E) * v).sum(1) / tokens
        return (f * p).sum(-1).mean()

    # -- balancing --------------------------------------------------------------------------
    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, allowed: torch.Tensor | None = None) -> None:
        """One auxiliary-loss-free step: raise the bias of under-loaded experts, lower the others.

        `load` [E] counts the tokens each expert received over the step (summed over ranks by
        the caller, so every rank applies the same update). With `allowed` (the step's elastic
        width restriction) only the experts that could be chosen are compared and moved."""
        if self.bias_update <= 0 or float(load.sum()) == 0:
            return
        load = load.float().to(self.expert_bias.device)
        mask = torch.ones_like(load, dtype=torch.bool) if allowed is None else allowed.to(load.device)
        step = self.bias_update * torch.sign(load[mask].mean() - load)
        self.expert_bias += torch.where(mask, step, torch.zeros_like(step))


def load_metrics(load: torch.Tensor) -> dict[str, float]:
    """Balance of one load vector [E] (token assignments per expert)."""
    total = float(load.sum())
    if total <= 0:
        return {"load_entropy": float("nan"), "max_violation": float("nan")}
    p = load / total
    entropy = float(-(p[p > 0] * p[p > 0].log()).sum()) / math.log(load.numel())
    return {"load_entropy": entropy, "max_violation": float(load.max() / load.mean() - 1)}
