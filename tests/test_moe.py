"""Behaviour of the MoE layer: equality with a per-token loop, no dropping, bias balancing, restriction."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloom.model.moe import MoE, load_metrics

D, E, K, H = 16, 8, 2, 8


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny; a second OpenMP thread only adds barrier waits on a busy machine
    (the balancing loop took 1-5 s with two threads under load, 0.07 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _moe(**kwargs) -> MoE:
    torch.manual_seed(0)
    return MoE(D, E, K, H, **kwargs)


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


def test_output_and_gradients_equal_a_per_token_reference():
    moe = _moe(n_shared=1)
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


def test_no_token_is_dropped_when_every_token_prefers_one_expert():
    moe = _moe(n_shared=0)
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
    moe = _moe(n_shared=0, bias_update=1e-2)
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


def test_allowed_experts_and_top_k_override():
    moe = _moe(n_shared=1)
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
    for kwargs in ({"seq_balance_weight": 0.1}, {"z_loss_weight": 1e-3}):
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
    _, aux = _moe(seq_balance_weight=0.1, z_loss_weight=1e-3).eval()(x, modality)
    assert aux.item() == 0.0  # training-only losses


def test_gradients_reach_router_used_experts_and_shared_expert_only():
    moe = _moe(n_shared=1)
    moe.expert_bias[5] = -10.0  # expert 5 is never chosen
    y, _ = moe(torch.randn(2, 16, D))
    (y * torch.randn_like(y)).sum().backward()
    assert moe.router.grad.abs().sum() > 0
    assert all(p.grad.abs().sum() > 0 for p in moe.shared.parameters())
    for grad in (moe.experts.gate_up.grad, moe.experts.down.grad):
        used = grad.flatten(1).abs().sum(1) > 0
        assert used.tolist() == [e != 5 for e in range(E)]


def test_experts_reject_counts_for_another_expert_count():
    moe = _moe()
    with pytest.raises(ValueError, match="expert counts"):
        moe.experts(torch.randn(4, D), [2, 2])
