"""LazyAdamW: AdamW that leaves alone every element whose gradient is exactly zero in a step.

An elastic step trains a sub-model (layers skipped, routing restricted to some experts), so the
parameters outside it get a gradient of exactly zero. Plain AdamW still decays their moments,
applies weight decay to them and moves them on stale moments, so the parameters the full model
needs drift while nobody trains them, and the full model's held-out loss pays for it. Here an
element with a zero gradient gets no update at all (moments, weight decay and value untouched),
and its bias correction counts its own updates, so when it is trained again it takes the step a
fresh AdamW with that many steps would take. Elements with a nonzero gradient follow AdamW.

The mask is element-wise (`grad != 0`), not per parameter, because under DeepSpeed ZeRO the
optimizer sees one flat fp32 partition per group in which trained and skipped parameters sit
side by side; a parameter whose `grad` is None counts as all zero. A gradient that is exactly
zero for another reason (a dead unit, an unused embedding row) also freezes its element, which is
what a zero gradient asks for once weight decay is taken out.

Memory: one more fp32 tensor per parameter (`element_steps`, the per-element update count) on top
of AdamW's two moments, and a few parameter-sized temporaries during `step`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch


class LazyAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's arguments and update (decoupled weight decay), element-wise lazy.

    State per parameter: `exp_avg`, `exp_avg_sq`, `element_steps` (float32, updates of each
    element) and `step` (a scalar tensor, calls to `step`, for code that reads it as AdamW's)."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must each lie in [0, 1), got {betas}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    def _state_for(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["element_steps"] = torch.zeros_like(p, dtype=torch.float32,
                                                      memory_format=torch.preserve_format)
        elif "element_steps" not in state:  # torch AdamW state (old checkpoint): each element took each step
            state["element_steps"] = torch.full_like(p, float(state["step"]), dtype=torch.float32)
        return state

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                state = self._state_for(p)
                state["step"] += 1
                if p.grad is None:  # all zero: nothing of this parameter moves
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("LazyAdamW does not take sparse gradients; use dense ones")
                self._update(p, grad, state, lr, beta1, beta2, eps, wd)
        return loss

    @staticmethod
    def _update(p: torch.Tensor, grad: torch.Tensor, state: dict, lr: float, beta1: float, beta2: float,
                eps: float, wd: float) -> None:
        trained = grad != 0
        if not bool(trained.any()):  # a skipped layer's tensor whose grad was zeroed, not freed
            return
        exp_avg, exp_avg_sq, steps = state["exp_avg"], state["exp_avg_sq"], state["element_steps"]
        # Every change is a product with the 0/1 gate, so an untrained element gets +-0 and keeps its
        # bits. Two scratch tensors, reused, and in-place ops: on CPU each fresh parameter-sized
        # tensor costs page faults worth more than its arithmetic.
        gate = trained.to(torch.promote_types(p.dtype, torch.float32))  # also holds the bias corrections
        steps.add_(gate)
        scratch = torch.empty_like(p)
        if wd != 0:
            p.sub_(torch.mul(p, gate, out=scratch), alpha=lr * wd)
        exp_avg.add_(torch.sub(grad, exp_avg, out=scratch).mul_(gate), alpha=1 - beta1)  # AdamW's lerp
        exp_avg_sq.add_(torch.mul(grad, grad, out=scratch).sub_(exp_avg_sq).mul_(gate), alpha=1 - beta2)
        bias2_sqrt = _bias_correction(steps, beta2, out=gate).sqrt_()  # the gate's last use was above
        denom = torch.sqrt(exp_avg_sq, out=scratch).div_(bias2_sqrt).add_(eps)
        update = torch.div(exp_avg, _bias_correction(steps, beta1, out=gate), out=gate).div_(denom)
        update.masked_fill_(trained.logical_not_(), 0)  # fill, not *gate: 0/0 is nan if eps=0
        p.sub_(update, alpha=lr)


def _bias_correction(steps: torch.Tensor, beta: float, out: torch.Tensor) -> torch.Tensor:
    """1 - beta**n per element, into `out`, as -expm1(n log beta): accurate in float32, where
    1 - 0.999**1 loses digits. Elements never updated (n = 0) get 1 - beta, not 0: their update is
    dropped, but must not be 0/0 on the way."""
    if beta == 0:
        return out.fill_(1)
    return torch.mul(steps, math.log(beta), out=out).expm1_().neg_().clamp_(min=1 - beta)


class ProgressiveUnfreezing:
    """Fine-tuning's progressive unfreezing: the last transformer layer (with the final norm and the
    output heads) trains from the first step, one more layer below it every `every` steps, the
    embedding (tied to the output head's text/media rows) last.

    A frozen parameter's gradient is replaced by zeros in a tensor hook, before DeepSpeed reduces
    it into ZeRO's flat buffers, so LazyAdamW leaves its elements untouched (no moment decay, no
    weight decay, no update) and gradient clipping does not count it. Call `at(step)` before each
    step's forward."""

    def __init__(self, model: torch.nn.Module, every: int):
        if every < 1:
            raise ValueError(f"progressive unfreezing needs every >= 1, got {every}")
        self.every, self.step = every, 0
        n_layers = len(model.blocks)
        self.group_of: dict[str, int] = {}
        for name, p in model.named_parameters():
            if name.startswith("blocks."):
                group = n_layers - 1 - int(name.split(".")[1])
            elif name.startswith("embed."):
                group = n_layers
            else:  # the final norm and the heads train with the last layer
                group = 0
            self.group_of[name] = group
            if p.requires_grad:
                p.register_hook(self._hook(group))
        self.groups = n_layers + 1

    def _hook(self, group: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            return grad if self.trainable(group) else torch.zeros_like(grad)

        return hook

    def at(self, step: int) -> None:
        self.step = step

    def unfrozen(self, step: int | None = None) -> int:
        """Groups trained at `step` (default: the current one)."""
        return min(self.groups, 1 + (self.step if step is None else step) // self.every)

    def trainable(self, group: int) -> bool:
        return group < self.unfrozen()
