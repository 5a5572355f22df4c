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
contiguous slice, and the weighted outputs are added back to their tokens. Two ways to run the
experts on their slices (`MoEConfig.impl`), equal in output and gradients (tests/test_moe.py):

    grouped  all experts in one autograd node (`GroupedSwiGLU`) with a hand-written backward that
             writes each weight gradient straight into its [E, ...] tensor: on GPUs one
             `F.grouped_mm` per product over all experts, on CPUs expert by expert with each
             expert's activation between its two products (cache-friendly), and, where ATen
             multiplies bf16 in its own loops (no oneDNN bf16), operands in their fast layout;
    loop     one matmul per expert through autograd: the plain PyTorch twin, kept as the reference.

The loop's backward has to stack E per-expert weight gradients into the stacked parameters
and to split and concatenate the activations; the grouped path does neither.

The expert computation goes through `self.dispatcher(x_sorted, counts)` when the trainer has set
one (an all-to-all dispatcher for expert parallelism; this file knows nothing of process
groups), else through `self.experts`, which runs every expert locally.

Elastic restriction, per forward: `allowed` (bool [E]) limits routing to a subset of experts,
`top_k` overrides k. The statistics of the last forward (expert load per modality, for the
balancing update and the metrics) are kept in `self.last_load`.

Shapes: N tokens, D model dim, E routed experts, H expert hidden size, k experts per token.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.contract import MODALITY_SLOTS, PAD_MODALITY
from tokenloom.model.config import MOE_IMPLS, MoEConfig


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class GroupedSwiGLU(torch.autograd.Function):
    """y = (silu(x W_gate) * (x W_up)) W_down for every expert's rows in one autograd node.

    x [N, D] grouped by expert with counts[e] rows for expert e, gate_up [E, D, 2H], down [E, H, D]
    -> y [N, D]. Experts with no rows are fine: their weight gradients are zero. Only x and the
    pre-activation h = x W_gate_up [N, 2H] are kept for backward; the activation is recomputed
    there. Backward, per expert e on its rows:

        da = dy W_down^T                       dW_down[e] = a^T dy
        dh = [silu'(gate) * da * up, da * silu(gate)]
        dx = dh W_gate_up^T                    dW_gate_up[e] = x^T dh

    with each weight gradient written straight into its [E, ...] tensor (the loop twin's autograd
    stacks E slices instead, and splits and concatenates the activations).

    Two kernels compute the same products. "grouped_mm": one `F.grouped_mm` per product over all
    experts (on GPUs one kernel launch for all experts). "per_expert": plain matmuls expert by
    expert, the activation between each expert's two products, so its rows stay in cache; ATen's
    CPU grouped_mm is itself a loop of matmuls, and this order measured faster on CPUs
    (bench/RESULTS.md). All operands share one dtype (`Experts` casts them for autocast:
    grouped_mm has no autocast rule).

    `cpu_layouts` (per_expert only): give every product a column-major left and a row-major right
    operand (one transposing copy each). On CPUs without oneDNN bf16/fp16 support (AVX2), ATen
    multiplies reduced-precision matrices in its own loops, 5-10x faster in that layout than in
    the row-major one; it changes nothing in what is computed.
    """

    @staticmethod
    def forward(ctx, x, gate_up, down, counts: tuple[int, ...], kernel: str = "grouped_mm",
                cpu_layouts: bool = False):
        if kernel not in ("grouped_mm", "per_expert"):
            raise ValueError(f"GroupedSwiGLU kernel must be grouped_mm or per_expert, got {kernel!r}")
        ctx.counts, ctx.kernel, ctx.cpu_layouts = counts, kernel, cpu_layouts
        if kernel == "grouped_mm":
            offs = _offsets(counts, x.device)
            h = F.grouped_mm(x, gate_up, offs=offs)
            gate, up = h.chunk(2, dim=-1)
            y = F.grouped_mm(F.silu(gate) * up, down, offs=offs)
        else:
            left = _column_major if cpu_layouts else _same
            h, y = x.new_empty(x.shape[0], gate_up.shape[-1]), x.new_empty(x.shape[0], down.shape[-1])
            for e, rows in _expert_rows(counts):
                torch.mm(left(x[rows]), gate_up[e], out=h[rows])
                gate, up = h[rows].chunk(2, dim=-1)
                torch.mm(left(F.silu(gate) * up), down[e], out=y[rows])
        ctx.save_for_backward(x, gate_up, down, h)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, gate_up, down, h = ctx.saved_tensors
        need_x, need_gate_up, need_down = ctx.needs_input_grad[:3]
        grad_y = grad_y.contiguous()  # grouped_mm refuses the stride-0 gradient of a .sum()
        if ctx.kernel == "grouped_mm":
            offs = _offsets(ctx.counts, x.device)
            grad_a = F.grouped_mm(grad_y, down.transpose(-2, -1), offs=offs)
            grad_h, a = _swiglu_backward(h, grad_a)
            grad_down = F.grouped_mm(a.t(), grad_y, offs=offs) if need_down else None
            grad_x = F.grouped_mm(grad_h, gate_up.transpose(-2, -1), offs=offs) if need_x else None
            grad_gate_up = F.grouped_mm(x.t(), grad_h, offs=offs) if need_gate_up else None
            return grad_x, grad_gate_up, grad_down, None, None, None
        left, right = (_column_major, _row_major) if ctx.cpu_layouts else (_same, _same)
        grad_x = torch.empty_like(x) if need_x else None
        grad_gate_up = torch.empty_like(gate_up) if need_gate_up else None
        grad_down = torch.empty_like(down) if need_down else None
        for e, n in enumerate(ctx.counts):  # every expert's slice is written below, or zeroed here
            if n == 0:
                for grad in (grad_gate_up, grad_down):
                    if grad is not None:
                        grad[e].zero_()
        for e, rows in _expert_rows(ctx.counts):
            dy = grad_y[rows]
            grad_h, a = _swiglu_backward(h[rows], left(dy) @ right(down[e].t()))
            if need_down:
                torch.mm(a.t(), dy, out=grad_down[e])
            if need_x:
                torch.mm(left(grad_h), right(gate_up[e].t()), out=grad_x[rows])
            if need_gate_up:
                torch.mm(x[rows].t(), grad_h, out=grad_gate_up[e])
        return grad_x, grad_gate_up, grad_down, None, None, None


def _offsets(counts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """grouped_mm's `offs`: int32 [E], the end row of each expert's group."""
    return torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)


def _expert_rows(counts: tuple[int, ...]):
    """(expert, its slice of rows) for every expert with rows."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, slice(start, start + n)
        start += n


def _swiglu_backward(h: torch.Tensor, grad_a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h = [gate, up] [n, 2H] and the gradient of a = silu(gate) * up -> (gradient of h, a)."""
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate)
    return torch.cat([torch.ops.aten.silu_backward(grad_a * up, gate), grad_a * act], dim=-1), act * up


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix [N, K], stored column by column."""
    return t.t().contiguous().t()


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous()


@functools.cache
def _aten_multiplies_in_loops(dtype: torch.dtype) -> bool:
    """Whether this CPU's reduced-precision matmuls run in ATen's own loops (no oneDNN support),
    asked once at the first call, never at import."""
    check = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
    if check is None:
        return False
    try:
        return not (torch.backends.mkldnn.is_available() and getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # the probe moved: keep the default layouts
        return False


class Experts(nn.Module):
    """E SwiGLU experts as stacked weights; `forward` runs expert e on the e-th slice of its input."""

    def __init__(self, n_experts: int, dim: int, hidden: int, impl: str = "grouped"):
        super().__init__()
        if impl not in MOE_IMPLS:
            raise ValueError(f"expert impl must be one of {MOE_IMPLS}, got {impl!r}")
        self.n_experts, self.dim, self.hidden, self.impl = n_experts, dim, hidden, impl
        self.gate_up = nn.Parameter(torch.empty(n_experts, dim, 2 * hidden))
        self.down = nn.Parameter(torch.empty(n_experts, hidden, dim))
        nn.init.normal_(self.gate_up, std=0.02)
        nn.init.normal_(self.down, std=0.02 / math.sqrt(2))

    def forward(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x_sorted [N, D], grouped by expert with counts[e] rows for expert e -> [N, D]."""
        if len(counts) != self.gate_up.shape[0]:
            raise ValueError(f"{len(counts)} expert counts for {self.gate_up.shape[0]} experts")
        if sum(counts) != x_sorted.shape[0]:
            raise ValueError(f"expert counts sum to {sum(counts)}, but {x_sorted.shape[0]} rows were given")
        return self._grouped(x_sorted, counts) if self.impl == "grouped" else self._loop(x_sorted, counts)

    def _grouped(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
        device = x_sorted.device.type
        # matmuls under autocast run in its dtype; grouped_mm is not on autocast's list, so cast here
        # (the casts are autograd ops: the weight gradients arrive in the parameters' dtype)
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x_sorted.dtype
        if device == "cpu":
            kernel, cpu_layouts = "per_expert", _aten_multiplies_in_loops(dtype)
        else:
            # grouped_mm wants strides of whole 16-byte units: D and H multiples of 8 (in bf16)
            aligned = (self.dim * 2) % 16 == 0 and (self.hidden * 2) % 16 == 0
            kernel, cpu_layouts = ("grouped_mm" if aligned else "per_expert"), False
        return GroupedSwiGLU.apply(x_sorted.to(dtype), self.gate_up.to(dtype), self.down.to(dtype), tuple(counts),
                                   kernel, cpu_layouts)

    def _loop(self, x_sorted: torch.Tensor, counts: list[int]) -> torch.Tensor:
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
    """One MoE feed-forward: router, E routed SwiGLU experts (top-k per token) and shared experts."""

    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Parameter(torch.empty(cfg.n_experts, dim))
        nn.init.normal_(self.router, std=0.02)
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
        self.experts = Experts(cfg.n_experts, dim, cfg.expert_hidden, cfg.impl)
        self.shared = SwiGLU(dim, cfg.expert_hidden * cfg.n_shared_experts) if cfg.n_shared_experts > 0 else None
        # None: every expert runs here; the trainer sets an all-to-all dispatcher (a plain callable,
        # not a module, so the state dict keeps one copy of the weights) for expert parallelism
        self.dispatcher: Callable[[torch.Tensor, list[int]], torch.Tensor] | None = None
        self.last_load: torch.Tensor | None = None  # [MODALITY_SLOTS, E] token-expert assignments

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
        """x [B, L, D], modality [B, L] (contract.MODALITY_IDS, PAD_MODALITY for padding) -> (y [B, L, D], aux loss)."""
        B, L, D = x.shape
        flat = x.reshape(-1, D)
        logits, chosen, weights = self.route(flat, allowed, top_k)
        k = chosen.shape[-1]
        expert_of = chosen.reshape(-1)
        order = expert_of.argsort(stable=True)
        token_of = order // k
        counts = torch.bincount(expert_of, minlength=self.n_experts)
        y_sorted = (self.dispatcher or self.experts)(flat.index_select(0, token_of), counts.tolist())
        y_sorted = y_sorted * weights.reshape(-1)[order, None].to(y_sorted.dtype)
        y = torch.zeros_like(flat).index_add_(0, token_of, y_sorted.to(flat.dtype))
        if self.shared is not None:
            y = y + self.shared(flat)

        mod = (modality.reshape(-1) if modality is not None
               else torch.zeros(B * L, dtype=torch.long, device=x.device))
        valid = mod < PAD_MODALITY
        with torch.no_grad():
            slot = mod.repeat_interleave(k) * self.n_experts + expert_of
            self.last_load = torch.bincount(slot, minlength=MODALITY_SLOTS * self.n_experts).view(
                MODALITY_SLOTS, self.n_experts).float()
        aux = logits.new_zeros(())
        if self.training and self.cfg.seq_balance_weight > 0:
            aux = aux + self.cfg.seq_balance_weight * self._sequence_balance(logits, chosen, valid, B, L, allowed)
        if self.training and self.cfg.router_z_weight > 0:
            z = torch.logsumexp(logits, dim=-1).square()
            aux = aux + self.cfg.router_z_weight * (z * valid).sum() / valid.sum().clamp_min(1)
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
        if self.cfg.router_bias_update <= 0 or float(load.sum()) == 0:
            return
        load = load.float().to(self.expert_bias.device)
        mask = torch.ones_like(load, dtype=torch.bool) if allowed is None else allowed.to(load.device)
        step = self.cfg.router_bias_update * torch.sign(load[mask].mean() - load)
        self.expert_bias += torch.where(mask, step, torch.zeros_like(step))


def load_metrics(load: torch.Tensor) -> dict[str, float]:
    """Balance of one load vector [E] (token assignments per expert)."""
    total = float(load.sum())
    if total <= 0:
        return {"load_entropy": float("nan"), "max_violation": float("nan")}
    p = load / total
    entropy = float(-(p[p > 0] * p[p > 0].log()).sum()) / math.log(load.numel())
    return {"load_entropy": entropy, "max_violation": float(load.max() / load.mean() - 1)}
