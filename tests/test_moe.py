"""Behaviour of the MoE layer: equality with a per-token loop, no dropping, bias balancing, restriction;
the grouped expert path against its per-expert loop twin."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.model import MoEConfig
from tokenloom.model.moe import Experts, GroupedSwiGLU, MoE, load_metrics

D, E, K, H = 16, 8, 2, 8


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny; a second OpenMP thread only adds barrier waits on a busy machine
    (the balancing loop took 1-5 s with two threads under load, 0.07 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=["grouped", "loop"])
def impl(request) -> str:
    """Every layer test runs with both ways of running the experts."""
    return request.param


def _moe(impl: str = "grouped", **kwargs) -> MoE:
    torch.manual_seed(0)
    return MoE(D, MoEConfig(n_experts=E, top_k=K, expert_hidden=H, impl=impl, **kwargs))


def _expert(moe: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    gate, up = (x @ moe.experts.gate_up[e]).chunk(2)
    return (F.silu(gate) * up) @ moe.experts.down[e]


def naive_moe(moe: MoE, x: torch.Tensor, allowed: torch.Tensor | None = None, top_k: int | None = None
              ) -> torch.Tensor:
    """Token by token, routing included: select top-k on sigmoid scores + bias, weight by the scores
    renormalised over the chosen, sum weight * expert(x), add the shared expert."""
    k = top_k or moe.top_k
    rows = []
    for token in x.reshape(-1, x.shape[-1]):
        scores = torch.sigmoid(moe.router @ token)
        choice = scores.detach() + moe.expert_bias
        if allowed is not None:
            choice = torch.where(allowed, choice, torch.tensor(float("-inf")))
        chosen = sorted(range(E), key=lambda e: -float(choice[e]))[:k]
        total = sum(scores[e] for e in chosen)
        out = moe.shared(token) if moe.shared is not None else torch.zeros_like(token)
        for e in chosen:
            out = out + scores[e] / total * _expert(moe, e, token)
        rows.append(out)
    return torch.stack(rows).view_as(x)


def test_output_and_gradients_equal_a_per_token_reference(impl):
    moe = _moe(impl, n_shared_experts=1)
    moe.expert_bias.copy_(torch.linspace(-0.05, 0.05, E))  # the bias steers selection, not weights
    x = torch.randn(2, 10, D, requires_grad=True)
    y, _ = moe(x)
    y_ref = naive_moe(moe, x)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    probe = torch.randn_like(y)
    params = [x, moe.router, moe.experts.gate_up, moe.experts.down, *moe.shared.parameters()]
    grads = torch.autograd.grad((y * probe).sum(), params)
    grads_ref = torch.autograd.grad((y_ref * probe).sum(), params)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)


def test_no_token_is_dropped_when_every_token_prefers_one_expert(impl):
    moe = _moe(impl, n_shared_experts=0)
    moe.expert_bias[3] = 10.0  # expert 3 wins every token's first slot
    seen = {}

    def one_hot_experts(x_sorted, counts):
        seen["counts"] = counts
        expert_of_row = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
        return F.one_hot(expert_of_row, D).float()  # expert e writes a 1 into column e

    moe.dispatcher = one_hot_experts
    x = torch.randn(4, 32, D)
    y, _ = moe(x)
    n = x.shape[0] * x.shape[1]
    assert seen["counts"][3] == n and sum(seen["counts"]) == n * K
    y = y.reshape(n, D)
    assert torch.all((y > 0).sum(-1) == K)  # every token got exactly K distinct experts' outputs
    torch.testing.assert_close(y.sum(-1), torch.ones(n))  # with weights summing to 1
    assert torch.all(y[:, 3] > 0)
    assert moe.last_load.sum() == n * K and moe.last_load[0, 3] == n
    moe.dispatcher = None  # and with the real experts, the overloaded one serves all n tokens
    torch.testing.assert_close(moe(x)[0], naive_moe(moe, x), rtol=1e-5, atol=1e-6)


def test_bias_updates_balance_a_skewed_router_without_gradients():
    moe = _moe(n_shared_experts=0, router_bias_update=1e-2)
    with torch.no_grad():
        moe.router[0] = 0.5  # with inputs of positive mean, expert 0 scores ~1 for every token
    router_before = moe.router.detach().clone()
    violations = []
    for step in range(120):
        x = torch.randn(1, 256, D, generator=torch.Generator().manual_seed(step)) + 1.0
        with torch.no_grad():
            moe(x)
        load = moe.last_load.sum(0)
        violations.append(load_metrics(load)["max_violation"])
        moe.update_bias(load)
    start, end = violations[0], sum(violations[-20:]) / 20
    assert start == pytest.approx(E / K - 1)  # expert 0 took every token: load E/K times the mean
    assert end < start / 2
    assert moe.expert_bias[0] < 0 < moe.expert_bias[1:].min()
    assert torch.equal(moe.router, router_before)


def test_allowed_experts_and_top_k_override(impl):
    moe = _moe(impl, n_shared_experts=1)
    allowed = torch.zeros(E, dtype=torch.bool)
    allowed[[1, 4, 6]] = True
    x = torch.randn(2, 16, D)
    for top_k in (1, 3):
        _, chosen, weights = moe.route(x.reshape(-1, D), allowed, top_k)
        assert chosen.shape == (32, top_k) and bool(allowed[chosen].all())
        torch.testing.assert_close(weights.sum(-1), torch.ones(32))
        y, _ = moe(x, allowed=allowed, top_k=top_k)
        torch.testing.assert_close(y, naive_moe(moe, x, allowed, top_k), rtol=1e-5, atol=1e-6)
        assert moe.last_load.sum() == 32 * top_k and moe.last_load[:, ~allowed].sum() == 0
    with pytest.raises(ValueError, match="cannot pick top-4"):
        moe(x, allowed=allowed, top_k=4)


def test_balance_and_z_losses_are_positive_differentiable_and_off_at_zero_weight():
    x = torch.randn(2, 12, D)
    modality = torch.tensor([[0] * 6 + [1] * 4 + [3] * 2, [2] * 12])
    for kwargs in ({"seq_balance_weight": 0.1}, {"router_z_weight": 1e-3}):
        moe = _moe(**kwargs)
        _, aux = moe(x, modality)
        assert torch.isfinite(aux) and aux > 0
        (grad,) = torch.autograd.grad(aux, moe.router)
        assert grad.abs().sum() > 0
        padded = x.clone()
        padded[0, 10:] = 100.0  # padding tokens (modality 3) do not count
        torch.testing.assert_close(moe(padded, modality)[1], aux)
    _, aux = _moe()(x, modality)
    assert aux.item() == 0.0
    _, aux = _moe(seq_balance_weight=0.1, router_z_weight=1e-3).eval()(x, modality)
    assert aux.item() == 0.0  # training-only losses


def test_gradients_reach_router_used_experts_and_shared_expert_only(impl):
    moe = _moe(impl, n_shared_experts=1)
    moe.expert_bias[5] = -10.0  # expert 5 is never chosen
    y, _ = moe(torch.randn(2, 16, D))
    (y * torch.randn_like(y)).sum().backward()
    assert moe.router.grad.abs().sum() > 0
    assert all(p.grad.abs().sum() > 0 for p in moe.shared.parameters())
    for grad in (moe.experts.gate_up.grad, moe.experts.down.grad):
        used = grad.flatten(1).abs().sum(1) > 0
        assert used.tolist() == [e != 5 for e in range(E)]


def test_experts_reject_counts_for_another_expert_count(impl):
    moe = _moe(impl)
    with pytest.raises(ValueError, match="expert counts"):
        moe.experts(torch.randn(4, D), [2, 2])
    with pytest.raises(ValueError, match="sum to 3"):
        moe.experts(torch.randn(4, D), [1, 2] + [0] * (E - 2))


def test_moe_config_is_validated():
    with pytest.raises(ValueError, match="model.moe.impl"):
        MoEConfig(impl="bmm").validate()
    with pytest.raises(ValueError, match="model.moe.top_k"):
        MoE(D, MoEConfig(n_experts=4, top_k=5))
    with pytest.raises(ValueError, match="n_shared_experts"):
        MoEConfig(n_shared_experts=-1).validate()


# -- the grouped path against its loop twin ----------------------------------------------------


def _twins(n_experts: int, dim: int, hidden: int) -> tuple[Experts, Experts]:
    grouped, loop = Experts(n_experts, dim, hidden, "grouped"), Experts(n_experts, dim, hidden, "loop")
    torch.manual_seed(1)
    for p in grouped.parameters():  # the default init is too small to show gradient differences
        torch.nn.init.normal_(p, std=0.3)
    loop.load_state_dict(grouped.state_dict())
    return grouped, loop


def _run(experts: Experts, x: torch.Tensor, counts: list[int], probe: torch.Tensor, bf16: bool):
    x = x.detach().clone().requires_grad_()
    experts.zero_grad(set_to_none=True)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with context:
        y = experts(x, counts)
    if y.requires_grad:  # the loop returns a constant when no expert has rows
        (y.float() * probe).sum().backward()
    grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in (x, experts.gate_up, experts.down)]
    return y, grads


@settings(max_examples=25, deadline=None)
@given(counts=st.lists(st.sampled_from([0, 0, 1, 2, 5, 9, 17]), min_size=1, max_size=6),
       bf16=st.booleans(), seed=st.integers(0, 2**16))
def test_grouped_experts_equal_the_loop_in_output_and_gradients(counts, bf16, seed):
    """Uneven counts, experts with no rows (and none at all), fp32 tightly, bf16 autocast loosely."""
    grouped, loop = _twins(len(counts), 16, 8)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), 16, generator=g)
    probe = torch.randn(sum(counts), 16, generator=g)
    y_g, grads_g = _run(grouped, x, counts, probe, bf16)
    y_l, grads_l = _run(loop, x, counts, probe, bf16)
    assert y_g.dtype == (torch.bfloat16 if bf16 else torch.float32)
    assert y_l.dtype == y_g.dtype or sum(counts) == 0  # the loop's constant for no rows keeps the input dtype
    tol = {"rtol": 2e-2, "atol": 2e-2} if bf16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(y_g.float(), y_l.float(), **tol)
    for name, got, want in zip(("x", "gate_up", "down"), grads_g, grads_l, strict=True):
        assert got.dtype == want.dtype == torch.float32, name  # weight gradients in the parameters' dtype
        torch.testing.assert_close(got, want, **tol, msg=lambda m, name=name: f"d{name}: {m}")
    for e, n in enumerate(counts):  # an expert without rows gets exactly zero gradient
        if n == 0:
            assert grads_g[1][e].abs().max() == 0 and grads_g[2][e].abs().max() == 0
        elif not bf16:
            assert grads_g[1][e].abs().max() > 0


def test_grouped_experts_take_a_stride_zero_gradient():
    """`y.sum().backward()` hands back an expanded gradient, which grouped_mm refuses as is."""
    grouped, loop = _twins(4, 16, 8)
    counts = [3, 0, 5, 2]
    x = torch.randn(10, 16)
    grads = []
    for experts in (grouped, loop):
        xi = x.clone().requires_grad_()
        experts(xi, counts).sum().backward()
        grads.append((xi.grad, experts.gate_up.grad, experts.down.grad))
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("kernel", "cpu_layouts"), [("grouped_mm", False), ("per_expert", False),
                                                     ("per_expert", True)])
def test_every_grouped_kernel_equals_per_expert_matmuls(dtype, kernel, cpu_layouts):
    """Each kernel and operand layout on any host (which one `Experts` picks depends on the device
    and CPU), with uneven counts, experts without rows, and a stride-0 output gradient."""
    counts = (3, 0, 11, 1, 0, 6)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(sum(counts), 16, generator=g).to(dtype).requires_grad_()
    gate_up = (torch.randn(6, 16, 16, generator=g) * 0.3).to(dtype).requires_grad_()
    down = (torch.randn(6, 8, 16, generator=g) * 0.3).to(dtype).requires_grad_()
    probe = torch.randn(sum(counts), 16, generator=g).to(dtype)
    outs = []
    for e, chunk in enumerate(x.split(counts)):
        gate, up = (chunk @ gate_up[e]).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ down[e])
    y_ref = torch.cat(outs)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-6}
    for loss in (lambda y: (y * probe).sum(), lambda y: y.sum()):
        y = GroupedSwiGLU.apply(x, gate_up, down, counts, kernel, cpu_layouts)
        grads = torch.autograd.grad(loss(y), (x, gate_up, down))
        grads_ref = torch.autograd.grad(loss(y_ref), (x, gate_up, down), retain_graph=True)
        torch.testing.assert_close(y, y_ref, **tol)
        for got, want in zip(grads, grads_ref, strict=True):
            assert got.dtype == dtype
            torch.testing.assert_close(got, want, **tol)
        assert grads[1][1].abs().max() == 0 and grads[2][4].abs().max() == 0  # experts without rows
    with pytest.raises(ValueError, match="kernel"):
        GroupedSwiGLU.apply(x, gate_up, down, counts, "bmm", False)
