"""LazyAdamW: AdamW wherever gradients are nonzero; elements with a zero gradient stay exactly as they
are (values and moments) and resume with their own step count; its state round-trips; and it does
the same as DeepSpeed's ZeRO-1 client optimizer, where it sees flat fp32 partitions."""

from __future__ import annotations

import copy
import math
import socket

import pytest
import torch

from tokenloom.trainer.optim import LazyAdamW

BETAS, EPS = (0.9, 0.999), 1e-8


def _groups(params: list[torch.Tensor]) -> list[dict]:
    return [{"params": params[:2], "weight_decay": 0.1},
            {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}]


def _params(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).requires_grad_() for shape in ((7, 5), (5,), (3, 4), (1,))]


def _set_grads(params: list[torch.Tensor], gen: torch.Generator) -> None:
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def test_equals_adamw_when_every_gradient_is_nonzero():
    lazy_params, ref_params = _params(0), _params(0)
    lazy = LazyAdamW(_groups(lazy_params), lr=1e-2, betas=BETAS, eps=EPS, weight_decay=0.05)
    ref = torch.optim.AdamW(_groups(ref_params), lr=1e-2, betas=BETAS, eps=EPS, weight_decay=0.05)
    gen_a, gen_b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for _ in range(20):
        _set_grads(lazy_params, gen_a)
        _set_grads(ref_params, gen_b)
        lazy.step()
        ref.step()
    for a, b in zip(lazy_params, ref_params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(lazy.state[a][key], ref.state[b][key], rtol=1e-6, atol=1e-9)
    assert float(lazy.state[lazy_params[0]]["step"]) == 20


def _adam_step(p: float, m: float, v: float, g: float, n: int, lr: float,
               wd: float) -> tuple[float, float, float]:
    """One AdamW step of a scalar at its n-th update, by hand, in float64."""
    b1, b2 = BETAS
    p *= 1 - lr * wd
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    p -= lr * (m / (1 - b1**n)) / (math.sqrt(v / (1 - b2**n)) + EPS)
    return p, m, v


def _snapshot(opt: LazyAdamW, p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"value": p.detach().clone(), **{k: v.clone() for k, v in opt.state[p].items() if v.ndim}}


def test_zero_gradient_elements_do_not_move_and_resume_with_their_own_step_count():
    lr, wd = 1e-2, 0.1
    w = torch.tensor([0.5, -1.0, 2.0, 0.25], requires_grad=True)
    skipped = torch.nn.Parameter(torch.tensor([3.0]))  # grad None in the skipped steps
    opt = LazyAdamW([w, skipped], lr=lr, betas=BETAS, eps=EPS, weight_decay=wd)
    grads = [0.3, -0.7, 1.1, 0.4, -0.2, 0.9]
    # element 0 and `skipped` train in steps 0, 1, 5; element 1 in every step; elements 2, 3 never
    train_first = {0, 1, 5}
    expect = {"w0": (0.5, 0.0, 0.0), "w1": (-1.0, 0.0, 0.0), "s": (3.0, 0.0, 0.0)}  # (value, m, v)
    counts = {"w0": 0, "w1": 0}
    for step, g in enumerate(grads):
        on = step in train_first
        w.grad = torch.tensor([g if on else 0.0, -g, 0.0, 0.0])
        skipped.grad = torch.tensor([g]) if on else None
        w_before = _snapshot(opt, w) if step else None
        s_before = _snapshot(opt, skipped) if step else None
        opt.step()
        w_after, s_after = _snapshot(opt, w), _snapshot(opt, skipped)
        frozen = [2, 3] if on else [0, 2, 3]
        for key in ("value", "exp_avg", "exp_avg_sq", "element_steps"):  # bit for bit, values and moments
            start = w_before[key] if w_before else (w_after["value"] if key == "value" else torch.zeros(4))
            assert torch.equal(w_after[key][frozen], start[frozen]), (step, key)
            if s_before and not on:
                assert torch.equal(s_after[key], s_before[key]), (step, key)
        counts["w1"] += 1
        expect["w1"] = _adam_step(*expect["w1"], -g, counts["w1"], lr, wd)
        if on:
            counts["w0"] += 1
            expect["w0"] = _adam_step(*expect["w0"], g, counts["w0"], lr, wd)
            expect["s"] = _adam_step(*expect["s"], g, counts["w0"], lr, wd)
        for name, got in (("w0", (w_after, 0)), ("w1", (w_after, 1)), ("s", (s_after, 0))):
            snap, i = got
            for key, want in zip(("value", "exp_avg", "exp_avg_sq"), expect[name], strict=True):
                assert float(snap[key][i]) == pytest.approx(want, rel=1e-6, abs=1e-9), (step, name, key)
    assert opt.state[w]["element_steps"].tolist() == [3.0, 6.0, 0.0, 0.0]
    assert opt.state[skipped]["element_steps"].tolist() == [3.0] and float(opt.state[w]["step"]) == 6
    # element 0's last update was its 3rd; as a 6th (AdamW's count) it would land elsewhere
    p, m, v = _adam_step(0.5, 0.0, 0.0, grads[0], 1, lr, wd)
    p, m, v = _adam_step(p, m, v, grads[1], 2, lr, wd)
    assert abs(_adam_step(p, m, v, grads[5], 6, lr, wd)[0] - float(w.detach()[0])) > 1e-4


def _run(opt: LazyAdamW, params: list[torch.Tensor], steps: range) -> None:
    """Steps of gradients from a per-step seed: half the elements zero, or the whole parameter None."""
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen)
            half = torch.rand(p.shape, generator=gen) < 0.5
            p.grad = g * half if i % 2 == 0 else (g if step % 3 else None)
        opt.step()


def test_state_dict_round_trip_continues_like_the_uninterrupted_run():
    straight_params, first_params, resumed_params = _params(0), _params(0), _params(0)
    straight = LazyAdamW(_groups(straight_params), lr=1e-2, weight_decay=0.05)
    _run(straight, straight_params, range(10))

    first = LazyAdamW(_groups(first_params), lr=1e-2, weight_decay=0.05)
    _run(first, first_params, range(5))
    saved = copy.deepcopy(first.state_dict())  # as from disk
    resumed = LazyAdamW(_groups(resumed_params), lr=1e-2, weight_decay=0.05)
    with torch.no_grad():
        for src, dst in zip(first_params, resumed_params, strict=True):
            dst.copy_(src)
    resumed.load_state_dict(saved)
    assert torch.equal(resumed.state[resumed_params[0]]["element_steps"],
                       first.state[first_params[0]]["element_steps"])
    _run(resumed, resumed_params, range(5, 10))
    for a, b in zip(straight_params, resumed_params, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(straight_params, resumed_params, strict=True):
        for key, value in straight.state[a].items():
            assert torch.equal(value, resumed.state[b][key]), key


def test_takes_over_a_torch_adamw_state():
    """A checkpoint written with torch.optim.AdamW resumes under LazyAdamW as AdamW would continue."""
    lazy_params, ref_params = _params(0), _params(0)
    ref = torch.optim.AdamW(_groups(ref_params), lr=1e-2, weight_decay=0.05)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        _set_grads(ref_params, gen)
        ref.step()
    lazy = LazyAdamW(_groups(lazy_params), lr=1e-2, weight_decay=0.05)
    with torch.no_grad():
        for src, dst in zip(ref_params, lazy_params, strict=True):
            dst.copy_(src)
    lazy.load_state_dict(copy.deepcopy(ref.state_dict()))  # as from disk: state_dict() shares the tensors
    _set_grads(ref_params, gen)
    for src, dst in zip(ref_params, lazy_params, strict=True):
        dst.grad = src.grad.clone()
    ref.step()
    lazy.step()
    for a, b in zip(lazy_params, ref_params, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert lazy.state[lazy_params[0]]["element_steps"].unique().tolist() == [5.0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.integration
def test_zero1_client_optimizer_leaves_skipped_layer_bitwise_unchanged(monkeypatch, tmp_path):
    """ZeRO-1 hands LazyAdamW one flat fp32 partition per group, holding both layers; the skipped
    layer's part of it has zero gradients, and after the steps it is the same bits. A DeepSpeed
    checkpoint brings the per-element step counts back."""
    import deepspeed

    from tokenloom.trainer.distributed import destroy_process_group, init_distributed

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(_free_port())), ("RANK", "0"),
                       ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(key, value)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    optimizer = LazyAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    fresh_model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9}
    try:
        init_distributed()
        engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        assert ds_optimizer.optimizer is optimizer  # ZeRO-1 wraps the client optimizer, not replaces it
        x = torch.randn(4, 8)

        def train_step(full: bool) -> None:
            out = engine.module(x) if full else engine.module[0](x)
            engine.backward(out.square().mean())
            engine.step()

        for _ in range(2):  # both layers trained: layer 1 has moments and a step count to keep
            train_step(full=True)
        layer0 = [p.detach().clone() for p in engine.module[0].parameters()]
        layer1 = [p.detach().clone() for p in engine.module[1].parameters()]
        flat = next(iter(optimizer.state.values()))
        moments = {k: v.clone() for k, v in flat.items()}
        for _ in range(3):
            train_step(full=False)
        for before, after in zip(layer1, engine.module[1].parameters(), strict=True):  # the same bits
            assert torch.equal(before.view(torch.int32), after.detach().view(torch.int32))
        for before, after in zip(layer0, engine.module[0].parameters(), strict=True):
            assert not torch.allclose(before, after.detach())
        # the state is the flat partition's: layer 0's elements went 2 -> 5 updates, layer 1's stayed at 2
        assert len(optimizer.state) == 1 and flat["element_steps"].numel() >= 2 * (8 * 8 + 8)
        assert sorted(set(flat["element_steps"][: 2 * (8 * 8 + 8)].tolist())) == [2.0, 5.0]
        assert float(flat["step"]) == 5
        layer1_moments = flat["element_steps"] == 2
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(flat[key][layer1_moments], moments[key][layer1_moments])

        engine.save_checkpoint(str(tmp_path), tag="lazy")
        fresh = LazyAdamW(fresh_model.parameters(), lr=1e-2, weight_decay=0.1)
        fresh_engine, _, _, _ = deepspeed.initialize(model=fresh_model, optimizer=fresh, config=config)
        fresh_engine.load_checkpoint(str(tmp_path), tag="lazy")
        restored = next(iter(fresh.state.values()))
        assert restored.keys() == flat.keys()
        for key, value in flat.items():
            assert torch.equal(restored[key], value), key
    finally:
        destroy_process_group()  # through DeepSpeed: later tests start their own engine


def test_progressive_unfreezing_trains_the_last_layer_first_and_the_embedding_last():
    """Groups unfreeze top-down every `every` steps; until then a group's weights stay bit for bit
    (its gradient is zeroed before the optimizer, which then leaves it alone)."""
    from tokenloom.model import ModelConfig
    from tokenloom.model.unified import UnifiedModel
    from tokenloom.trainer.optim import LazyAdamW, ProgressiveUnfreezing

    torch.manual_seed(0)
    model = UnifiedModel(ModelConfig(dim=32, n_layers=2, n_heads=2, vocab_size=300))
    unfreezing = ProgressiveUnfreezing(model, every=2)
    optimizer = LazyAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ids = torch.randint(0, 300, (2, 16, 1))
    batch = {"ids": ids, "labels": torch.roll(ids, -1, 1), "modality": torch.zeros(2, 16, dtype=torch.long),
             "coords": torch.arange(16).repeat(2, 3, 1).permute(0, 2, 1).contiguous(),
             "doc_ids": torch.zeros(2, 16, dtype=torch.long), "segment_ids": torch.zeros(2, 16, dtype=torch.long),
             "attention": torch.zeros(2, 16, dtype=torch.long), "window": torch.zeros(2, 16, dtype=torch.long),
             "target_modality": torch.zeros(2, 16, dtype=torch.long)}

    def snapshot(prefix):
        return {k: v.detach().clone() for k, v in model.named_parameters() if k.startswith(prefix)}

    changed_at = {}
    for step in range(6):
        unfreezing.at(step)
        before = {p: snapshot(p) for p in ("blocks.1.", "blocks.0.", "embed.")}
        loss, _ = model.loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        for prefix, old in before.items():
            if any(not torch.equal(v, dict(model.named_parameters())[k]) for k, v in old.items()):
                changed_at.setdefault(prefix, step)
        assert unfreezing.unfrozen() == min(3, 1 + step // 2)
    assert changed_at == {"blocks.1.": 0, "blocks.0.": 2, "embed.": 4}
    with pytest.raises(ValueError, match="every >= 1"):
        ProgressiveUnfreezing(model, every=0)
