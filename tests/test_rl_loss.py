"""GSPO + IcePop (MISC) against values worked out by hand with plain floats: group advantages, the four
clip cases, token and sequence gates with a band per modality, the gradient of kept tokens, the
exact zero gradient of gated ones, and plain GSPO when the gates are off."""

from __future__ import annotations

import math

import pytest
import torch

from tokenloom.contract import MODALITIES, MODALITY_IDS, PAD_MODALITY
from tokenloom.trainer.rl.loss import MiscConfig, group_advantages, misc_loss, token_entropy

CLIP_LOW, CLIP_HIGH = 0.2, 0.3


def _cfg(**overrides) -> MiscConfig:
    bands = {"text": (0.5, 2.0), "image": (0.5, 2.0), "audio": (0.8, 1.25)}
    fields = dict(clip_low=CLIP_LOW, clip_high=CLIP_HIGH, token_band=dict(bands), sequence_band=dict(bands))
    return MiscConfig(**(fields | overrides))


def _batch(rows: list[list[tuple[float, float, str]]]):
    """rows: per response, its loss tokens as (logp - logp_old, logp_old - logp_infer, modality name).
    Every row gets at least one padding slot after its tokens, holding -inf and nan, which must be
    harmless. Returns logp (a float64 leaf with grad), logp_old, logp_infer, mask, modality: [B, T]."""
    width = max(len(row) for row in rows) + 1
    shape = (len(rows), width)
    logp = torch.full(shape, -math.inf, dtype=torch.float64)
    logp_old = torch.full(shape, math.nan, dtype=torch.float64)
    logp_infer = torch.full(shape, math.nan, dtype=torch.float64)
    mask = torch.zeros(shape, dtype=torch.bool)
    modality = torch.full(shape, PAD_MODALITY, dtype=torch.long)
    for i, row in enumerate(rows):
        for t, (step, mismatch, name) in enumerate(row):
            old = -1.0 - 0.25 * t
            logp[i, t], logp_old[i, t], logp_infer[i, t] = old + step, old, old - mismatch
            mask[i, t], modality[i, t] = True, MODALITY_IDS[name]
    return logp.requires_grad_(), logp_old, logp_infer, mask, modality


def _run(rows, advantages, cfg):
    logp, logp_old, logp_infer, mask, modality = _batch(rows)
    out = misc_loss(logp, logp_old, logp_infer, torch.tensor(advantages, dtype=torch.float64), mask, modality, cfg)
    out.loss.backward()
    return out, logp.grad


# -- group advantages -------------------------------------------------------------------------------


def test_group_advantages_by_hand():
    # in float32 the mean of three 0.9s is not 0.9: a constant group must still give exactly 0
    rewards = torch.tensor([1.0, 0.0, 0.1, 1.0, 0.0, 0.0, 0.9, 0.9, 0.9])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 5, 5, 5])
    mean = (1.0 + 0.0 + 0.1 + 1.0) / 4  # 0.525
    std = math.sqrt(((1 - mean) ** 2 + mean**2 + (0.1 - mean) ** 2 + (1 - mean) ** 2) / 4)  # population std
    eps = 1e-6
    expected = [(r - mean) / (std + eps) for r in (1.0, 0.0, 0.1, 1.0)] + [0.0] * 5  # constant groups: exactly 0
    got = group_advantages(rewards, groups, eps=eps)
    assert got.tolist()[4:] == [0.0] * 5
    torch.testing.assert_close(got, torch.tensor(expected), rtol=1e-6, atol=1e-6)


def test_group_advantages_group_by_id_not_position():
    rewards = torch.tensor([3.0, 10.0, 1.0, 20.0, 42.0])
    groups = torch.tensor([7, 2, 7, 2, 9])  # interleaved groups; a group of one gets 0
    eps = 1e-6
    expected = [1 / (1 + eps), -5 / (5 + eps), -1 / (1 + eps), 5 / (5 + eps), 0.0]
    torch.testing.assert_close(group_advantages(rewards, groups, eps=eps), torch.tensor(expected))


def test_group_advantages_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"\[N\]"):
        group_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer group ids"):
        group_advantages(torch.zeros(3), torch.zeros(3))


# -- GSPO clipping ----------------------------------------------------------------------------------


def test_clip_cases_and_gradients_by_hand():
    rows = [
        [(0.1, 0.0, "text"), (-0.04, 0.0, "text")],  # log s = 0.03: inside [0.8, 1.3]
        [(0.5, 0.0, "text"), (0.5, 0.0, "text")],  # s = e^0.5 above, A > 0: clipped
        [(-0.5, 0.0, "text"), (-0.5, 0.0, "text")],  # s = e^-0.5 below, A < 0: clipped
        [(-0.5, 0.0, "text"), (-0.3, 0.0, "text"), (-0.4, 0.0, "text")],  # s = e^-0.4 below, A > 0: unclipped
        [(0.6, 0.0, "text")],  # s = e^0.6 above, A < 0: unclipped
    ]
    advantages = [1.0, 2.0, -1.0, 1.5, -0.5]
    out, grad = _run(rows, advantages, _cfg())
    batch = 5
    s = [math.exp(0.03), math.exp(0.5), math.exp(-0.5), math.exp(-0.4), math.exp(0.6)]
    objectives = [s[0] * 1.0, (1 + CLIP_HIGH) * 2.0, (1 - CLIP_LOW) * -1.0, s[3] * 1.5, s[4] * -0.5]
    assert out.loss.item() == pytest.approx(-sum(objectives) / batch, rel=1e-12)
    # d loss / d logp_t = -A_i s_i / (|k_i| B) where the unclipped branch is taken, 0 where the clip is
    expected_grad = [[-1.0 * s[0] / (2 * batch)] * 2, [0.0, 0.0], [0.0, 0.0],
                     [-1.5 * s[3] / (3 * batch)] * 3, [0.5 * s[4] / (1 * batch)]]
    for i, row in enumerate(expected_grad):
        assert grad[i, : len(row)].tolist() == pytest.approx(row, rel=1e-12)
        assert grad[i, len(row):].eq(0).all()  # padding, -inf and nan included
    assert out.stats["clip_fraction"] == pytest.approx(4 / 5)
    assert out.stats["sequence_ratio_mean"] == pytest.approx(sum(s) / 5, rel=1e-12)
    assert out.stats["kept_tokens"] == 10
    assert out.stats["sequence_masked_fraction"] == 0
    assert out.stats["mismatch_kl/text"] == pytest.approx(0, abs=1e-15)


def test_token_ratio_grpo_style_by_hand():
    # ratio = "token": each token has its own ratio r_t = exp(logp_t - logp_old_t), clipped on its own
    # (PPO / GRPO); the same row under GSPO has one ratio for all its tokens
    rows = [
        [(0.1, 0.0, "text"), (0.5, 0.0, "text")],  # A > 0: r = e^0.1 inside, e^0.5 above -> clipped
        [(-0.5, 0.0, "text"), (0.2, 0.0, "text"), (0.6, 0.0, "text")],  # A < 0: below -> clipped; inside; above -> not
    ]
    advantages = [2.0, -1.0]
    cfg = _cfg(ratio="token", token_gate=False, sequence_gate=False)
    out, grad = _run(rows, advantages, cfg)
    batch = 2
    r0 = [math.exp(0.1), math.exp(0.5)]
    r1 = [math.exp(-0.5), math.exp(0.2), math.exp(0.6)]
    j0 = (r0[0] * 2.0 + (1 + CLIP_HIGH) * 2.0) / 2
    j1 = ((1 - CLIP_LOW) * -1.0 + r1[1] * -1.0 + r1[2] * -1.0) / 3
    assert out.loss.item() == pytest.approx(-(j0 + j1) / batch, rel=1e-12)
    # d loss / d logp_t = -A r_t / (|k_i| B) where the token's unclipped branch is taken, 0 where clipped
    expected = [[-2.0 * r0[0] / (2 * batch), 0.0], [0.0, 1.0 * r1[1] / (3 * batch), 1.0 * r1[2] / (3 * batch)]]
    for i, row in enumerate(expected):
        assert grad[i, : len(row)].tolist() == pytest.approx(row, rel=1e-12)
        assert grad[i, len(row):].eq(0).all()
    # 3 of 5 tokens outside [0.8, 1.3] (e^0.5, e^-0.5, e^0.6), whichever branch min() took
    assert out.stats["clip_fraction"] == pytest.approx(3 / 5)
    gspo, _ = _run(rows, advantages, _cfg(token_gate=False, sequence_gate=False))
    assert gspo.loss.item() != pytest.approx(out.loss.item(), rel=1e-3)  # the two objectives differ here
    with pytest.raises(ValueError, match="rl.misc.ratio"):
        _cfg(ratio="tokens").validate()


# -- IcePop gates -----------------------------------------------------------------------------------


def test_token_gate_drops_tokens_outside_the_band():
    rows = [
        [(0.1, 0.0, "text"), (-0.05, 0.2, "text"), (0.3, 1.0, "text")],  # r = e^1 > 2: token 2 gated
        [(0.02, -1.0, "text"), (0.0, 0.0, "text")],  # r = e^-1 < 0.5: token 0 gated
        [(0.1, 0.9, "text"), (0.1, -0.9, "text")],  # both gated (rho = 1 passes): no kept tokens, dropped
    ]
    advantages = [1.0, -1.0, 1.0]
    out, grad = _run(rows, advantages, _cfg())
    batch = 3
    s0 = math.exp((0.1 - 0.05) / 2)  # over the kept tokens only
    s1 = math.exp(0.0)
    assert out.loss.item() == pytest.approx(-(s0 * 1.0 + s1 * -1.0) / batch, rel=1e-12)
    assert grad[0].tolist()[:3] == pytest.approx([-s0 / (2 * batch), -s0 / (2 * batch), 0.0], rel=1e-12)
    assert grad[0, 2] == 0 and grad[1, 0] == 0 and grad[2].eq(0).all()
    assert grad[1, 1].item() == pytest.approx(s1 / batch, rel=1e-12)

    # what a gated token's logp is does not matter
    logp, logp_old, logp_infer, mask, modality = _batch(rows)
    moved = logp.detach().clone()
    moved[0, 2] += 3.0
    moved[1, 0] -= 2.0
    moved[2, :2] += 1.0
    again = misc_loss(moved, logp_old, logp_infer, torch.tensor(advantages, dtype=torch.float64), mask, modality,
                      _cfg())
    assert again.loss.item() == out.loss.item()

    assert out.stats["token_masked_fraction/text"] == pytest.approx(4 / 7)
    assert out.stats["sequence_masked_fraction"] == pytest.approx(1 / 3)
    assert out.stats["kept_tokens"] == 3
    mismatches = [0.0, 0.2, 1.0, -1.0, 0.0, 0.9, -0.9]
    k3 = sum(math.exp(d) - d - 1 for d in mismatches) / len(mismatches)
    assert out.stats["mismatch_kl/text"] == pytest.approx(k3, rel=1e-12)


def test_sequence_gate_drops_a_sequence_and_keeps_the_denominator():
    cfg = _cfg(sequence_band={"text": (0.8, 1.25)})
    rows = [
        [(0.1, 0.0, "text"), (0.0, 0.0, "text")],
        [(0.2, 0.6, "text"), (0.1, 0.6, "text"), (0.0, 0.6, "text")],  # tokens pass (e^0.6 < 2); rho = e^0.6 > 1.25
        [(-0.1, 0.1, "text"), (0.04, -0.1, "text")],  # rho = 1
        # rho is over every masked token, gated or not: e^(1/3) > 1.25 (over the kept two it would be 1)
        [(0.1, 1.0, "text"), (0.1, 0.0, "text"), (0.1, 0.0, "text")],
    ]
    advantages = [1.0, 1.0, -2.0, 1.0]
    out, grad = _run(rows, advantages, cfg)
    batch = 4  # the dropped sequences still count
    s0, s2 = math.exp(0.05), math.exp(-0.03)
    assert out.loss.item() == pytest.approx(-(s0 * 1.0 + s2 * -2.0) / batch, rel=1e-12)
    assert grad[1].eq(0).all() and grad[3].eq(0).all()
    assert grad[2, :2].tolist() == pytest.approx([2.0 * s2 / (2 * batch)] * 2, rel=1e-12)
    assert out.stats["sequence_masked_fraction"] == pytest.approx(2 / 4)
    assert out.stats["token_masked_fraction/text"] == pytest.approx(1 / 10)
    assert out.stats["kept_tokens"] == 4
    assert out.stats["sequence_ratio_mean"] == pytest.approx((s0 + s2) / 2, rel=1e-12)  # over kept sequences
    assert out.stats["clip_fraction"] == 0


def test_token_band_is_per_modality():
    ratio = math.log(1.5)  # inside text's token band (0.5, 2), outside audio's (0.8, 1.25)
    rows = [[(0.06, ratio, "text"), (0.5, ratio, "audio"), (-0.03, 0.0, "audio"), (0.0, 0.0, "audio")]]
    out, grad = _run(rows, [1.0], _cfg())  # rho = sqrt(1.5) ~ 1.22: inside audio's sequence band
    s = math.exp((0.06 - 0.03 + 0.0) / 3)
    assert out.loss.item() == pytest.approx(-s, rel=1e-12)
    assert grad[0, :4].tolist() == pytest.approx([-s / 3, 0.0, -s / 3, -s / 3], rel=1e-12)
    assert out.stats["token_masked_fraction/text"] == 0
    assert out.stats["token_masked_fraction/audio"] == pytest.approx(1 / 3)
    assert "token_masked_fraction/image" not in out.stats
    assert out.stats["mismatch_kl/audio"] == pytest.approx((1.5 - ratio - 1) / 3, rel=1e-12)


def test_sequence_band_is_that_of_the_majority_modality():
    ratio = math.log(1.5)  # rho = 1.5: inside text's sequence band (0.5, 2), outside audio's (0.8, 1.25)
    rows = [
        [(0.1, ratio, "text"), (0.1, ratio, "text"), (0.1, ratio, "audio")],  # text sequence: kept
        [(0.1, ratio, "audio"), (0.1, ratio, "audio"), (0.1, ratio, "text")],  # audio sequence: dropped
        [(0.1, ratio, "audio"), (0.1, ratio, "text")],  # a tie goes to the smaller id, text: kept
    ]
    out, grad = _run(rows, [1.0, 1.0, 1.0], _cfg(token_gate=False))
    s = math.exp(0.1)
    assert out.loss.item() == pytest.approx(-2 * s / 3, rel=1e-12)
    assert grad[1].eq(0).all()
    assert grad[0, 0].item() == pytest.approx(-s / (3 * 3), rel=1e-12)
    assert grad[2, 0].item() == pytest.approx(-s / (2 * 3), rel=1e-12)
    assert out.stats["sequence_masked_fraction"] == pytest.approx(1 / 3)


def test_gates_off_is_plain_gspo():
    gen = torch.Generator().manual_seed(0)
    batch, width = 6, 9
    logp_old = -torch.rand(batch, width, generator=gen, dtype=torch.float64) * 3
    logp_infer = logp_old + torch.randn(batch, width, generator=gen, dtype=torch.float64)  # far outside any band
    # per-row drifts from e^-0.6 to e^0.6, so that sequences fall below, inside and above [0.8, 1.3]
    steps = torch.linspace(-0.6, 0.6, batch, dtype=torch.float64)[:, None] + 0.1 * torch.randn(
        batch, width, generator=gen, dtype=torch.float64)
    mask = torch.rand(batch, width, generator=gen) < 0.7
    mask[:, 0] = True
    modality = torch.randint(0, len(MODALITIES), (batch, width), generator=gen)
    advantages = torch.randn(batch, generator=gen, dtype=torch.float64)
    cfg = _cfg(token_gate=False, sequence_gate=False)

    logp = (logp_old + steps).requires_grad_()
    out = misc_loss(logp, logp_old, logp_infer, advantages, mask, modality, cfg)
    out.loss.backward()

    reference_logp = (logp_old + steps).requires_grad_()
    # GSPO as written: one ratio per sequence, s_i = exp(mean_t (logp - logp_old)), clipped and averaged
    s = ((reference_logp - logp_old) * mask).sum(1).div(mask.sum(1)).exp()
    objective = torch.minimum(s * advantages, s.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * advantages)
    reference = -objective.mean()
    reference.backward()

    assert 0 < out.stats["clip_fraction"] < 1  # both branches are exercised
    torch.testing.assert_close(out.loss, reference, rtol=1e-12, atol=0)
    torch.testing.assert_close(logp.grad, reference_logp.grad, rtol=1e-12, atol=1e-15)
    assert out.stats["kept_tokens"] == mask.sum().item()
    assert out.stats["sequence_masked_fraction"] == 0


# -- validation -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("overrides", "message"), [
    ({"clip_low": -0.1}, ">= 0"),
    ({"clip_high": -1e-4}, ">= 0"),
    ({"clip_low": 1.0}, "clip_low must be < 1"),
    ({"token_band": {"text": (0.0, 2.0)}}, "0 < alpha < beta"),
    ({"token_band": {"text": (2.0, 2.0)}}, "0 < alpha < beta"),
    ({"sequence_band": {"audio": (1.5, 0.5)}}, "0 < alpha < beta"),
    ({"sequence_band": {"video": (0.5, 2.0)}}, "unknown modality 'video'"),
])
def test_validate_rejects(overrides, message):
    with pytest.raises(ValueError, match=message):
        _cfg(**overrides).validate()


def test_misc_loss_rejects_bad_batches():
    logp, logp_old, logp_infer, mask, modality = _batch([[(0.0, 0.0, "image")]])
    advantages = torch.ones(1, dtype=torch.float64)
    with pytest.raises(ValueError, match="B == 0"):
        empty = torch.zeros(0, 3)
        misc_loss(empty, empty, empty, torch.zeros(0), empty.bool(), empty.long(), MiscConfig())
    with pytest.raises(ValueError, match="advantages"):
        misc_loss(logp, logp_old, logp_infer, torch.ones(2), mask, modality, _cfg())
    with pytest.raises(ValueError, match="'image' need a band in cfg.token_band"):
        misc_loss(logp, logp_old, logp_infer, advantages, mask, modality, _cfg(token_band={"text": (0.5, 2.0)}))
    padded = mask.clone()
    padded[0, 1] = True  # a padding slot marked as a loss token
    with pytest.raises(ValueError, match="modality id 3"):
        misc_loss(logp, logp_old, logp_infer, advantages, padded, modality, _cfg())


def test_default_config_is_valid_and_keeps_a_small_mismatch():
    rows = [[(0.0, 0.1, "text"), (0.0, -0.1, "image"), (0.0, 0.0, "audio")]]
    out, _ = _run(rows, [1.0], MiscConfig())
    assert out.loss.item() == pytest.approx(-1.0, rel=1e-12)  # s = 1, kept, B = 1
    assert out.stats["kept_tokens"] == 3


# -- entropy ----------------------------------------------------------------------------------------


def test_token_entropy():
    logits = torch.tensor([[0.0, math.log(2.0), math.log(3.0)], [1.0, 1.0, -math.inf]])
    expected_first = -sum(p * math.log(p) for p in (1 / 6, 2 / 6, 3 / 6))
    got = token_entropy(logits)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx([expected_first, math.log(2.0)], rel=1e-6)
    uniform = token_entropy(torch.full((2, 3, 50), 7.0, dtype=torch.bfloat16))
    assert uniform.shape == (2, 3)
    torch.testing.assert_close(uniform, torch.full((2, 3), math.log(50.0)))
