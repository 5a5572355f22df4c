"""ERNIE 5.0's MISC objective: GSPO's sequence-level ratio, with IcePop gates on the gap between the
training engine and the inference engine, and a band per modality.

Why sequence-level (GSPO). The reward belongs to a whole response, so the importance ratio does
too: a per-token ratio (PPO, GRPO) puts high-variance weights on single tokens, which in a long
response, or a mixture-of-experts model whose routing shifts between updates, sum to a noisy and
unstable gradient. GSPO clips one length-normalised ratio per response instead.

Why IcePop gates. The rollouts come from an inference engine with its own numerics (and possibly
an older policy version), so pi_infer differs from the training engine's pi_train = pi_old on the
same tokens. Where that mismatch is large, the gradient is of a policy other than the one that
sampled; IcePop discards those tokens (and whole sequences whose mean mismatch is large) rather
than reweighting them, which keeps the rest of the batch unbiased and bounded. Image and audio
tokens are sampled from flatter distributions than text and have a mismatch of their own size,
hence a band per modality.

Formulas (i: response, t: token, A_i: its group-normalised advantage, sg: stop-gradient):

    token gate      r_t   = exp(logp_old_t - logp_infer_t);  k_t = mask_t and alpha_m(t) <= r_t <= beta_m(t)
    sequence gate   rho_i = exp(mean_{t: mask_t} (logp_old_t - logp_infer_t)); keep i iff
                            alpha_m(i) <= rho_i <= beta_m(i) (sequence band) and k_i is not empty
    GSPO ratio      log s_i   = mean_{t in k_i} (logp_t - logp_old_t)
                    log s_i,t = sg[log s_i] + logp_t - sg[logp_t]     (GSPO-token: equal to s_i in value)
    objective       J_i  = mean_{t in k_i} min(s_i,t A_i, clip(s_i,t, 1 - clip_low, 1 + clip_high) A_i)
    loss            L    = -(1 / B) sum_{i kept} J_i

With `cfg.ratio = "token"` (the GRPO-style baseline) s_i,t = exp(logp_t - logp_old_t), each token's
own ratio, clipped per token; everything else (gates, J_i's mean over kept tokens, L) is the same.
GRPO as DAPO and verl run it is that with clip_low = clip_high = 0.2 and both gates off.

m(t) is a token's modality; m(i), a sequence's, is the modality of most of its masked tokens
(ties: the smallest id). Dropped sequences count in B, so gating never rescales what is kept. The
gradient of a kept, unclipped token is -A_i s_i / (|k_i| B), as in sequence-level GSPO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tokenloom.contract import MODALITIES, MODALITY_IDS
from tokenloom.trainer.rl.config import MiscConfig


def group_advantages(rewards: torch.Tensor, groups: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards [N], groups [N] (int id of the query each response answers) -> advantages [N]:
    (r - mean_group) / (std_group + eps), with the population std; a group whose rewards are all
    equal (one response included) gets exactly 0, as it carries no signal about which is better."""
    if rewards.dim() != 1 or groups.shape != rewards.shape:
        raise ValueError(f"rewards and groups must both be [N], got {tuple(rewards.shape)} and {tuple(groups.shape)}")
    if groups.is_floating_point() or groups.is_complex() or groups.dtype == torch.bool:
        raise ValueError(f"groups must hold integer group ids, got dtype {groups.dtype}")
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    values = rewards.to(dtype)
    if values.numel() == 0:
        return values
    _, index = torch.unique(groups, return_inverse=True)
    n_groups = int(index.max()) + 1
    count = torch.zeros(n_groups, dtype=dtype, device=values.device).index_add_(0, index, torch.ones_like(values))
    mean = torch.zeros_like(count).index_add_(0, index, values) / count
    centred = values - mean[index]
    std = (torch.zeros_like(count).index_add_(0, index, centred.square()) / count).sqrt()
    high = torch.full_like(count, -math.inf).scatter_reduce(0, index, values, "amax")
    low = torch.full_like(count, math.inf).scatter_reduce(0, index, values, "amin")
    constant = (high == low)[index]  # exact, where mean-and-std rounding would leave crumbs / eps
    return torch.where(constant, torch.zeros_like(values), centred / (std[index] + eps))


@dataclass
class MiscOutput:
    loss: torch.Tensor  # scalar, differentiable w.r.t. logp
    stats: dict[str, float]  # see misc_loss


def _band_tables(bands: dict[str, tuple[float, float]], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[len(MODALITIES)] alpha and beta by modality id; nan where a modality has no band."""
    alpha = torch.full((len(MODALITIES),), math.nan, dtype=like.dtype, device=like.device)
    beta = alpha.clone()
    for name, (a, b) in bands.items():
        alpha[MODALITY_IDS[name]], beta[MODALITY_IDS[name]] = a, b
    return alpha, beta


def misc_loss(logp: torch.Tensor, logp_old: torch.Tensor, logp_infer: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, modality: torch.Tensor, cfg: MiscConfig) -> MiscOutput:
    """GSPO + IcePop (the module docstring has the formulas).

    logp, logp_old, logp_infer, mask, modality: [B, T]; advantages: [B]. logp is log pi_theta of each
    response token (with grad), logp_old the training engine's before this update, logp_infer the
    inference engine's; mask (bool) marks the tokens that may carry loss; modality (long) holds
    MODALITY_IDS. Unmasked slots may hold anything (-inf, nan): they are never read.

    stats: clip_fraction and sequence_ratio_mean (over kept sequences; 0.0 and 1.0 when none),
    sequence_masked_fraction (dropped / B), kept_tokens, and for each modality among the masked
    tokens token_masked_fraction/<m> (gated / masked) and mismatch_kl/<m>, the k3 estimate of
    KL(pi_infer || pi_old) over masked tokens: mean(r_t - log r_t - 1).
    """
    cfg.validate()
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    batch = logp.shape[0]
    if batch == 0:
        raise ValueError("misc_loss needs at least one response (B == 0)")
    for name, tensor in (("logp_old", logp_old), ("logp_infer", logp_infer), ("mask", mask), ("modality", modality)):
        if tensor.shape != logp.shape:
            raise ValueError(f"{name} must have logp's shape {tuple(logp.shape)}, got {tuple(tensor.shape)}")
    if advantages.shape != (batch,):
        raise ValueError(f"advantages must be [B] = [{batch}], got {tuple(advantages.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    if modality.is_floating_point() or modality.dtype == torch.bool:
        raise ValueError(f"modality must hold integer modality ids, got {modality.dtype}")
    present = sorted(int(m) for m in modality[mask].unique())
    for m in present:
        if m not in range(len(MODALITIES)):
            raise ValueError(f"a masked token has modality id {m}; loss tokens must be one of "
                             f"{MODALITY_IDS} (padding must be outside mask)")
        for gate_on, gate, bands in ((cfg.token_gate, "token_band", cfg.token_band),
                                     (cfg.sequence_gate, "sequence_band", cfg.sequence_band)):
            if gate_on and MODALITIES[m] not in bands:
                raise ValueError(f"masked tokens of modality {MODALITIES[m]!r} need a band in cfg.{gate}")

    dtype = torch.promote_types(logp.dtype, torch.float32)
    zero = torch.zeros((), dtype=dtype, device=logp.device)
    # zero the unmasked slots first, so padding's -inf or nan reaches neither values nor gradients
    logp = torch.where(mask, logp.to(dtype), zero)
    logp_old = torch.where(mask, logp_old.detach().to(dtype), zero)
    logp_infer = torch.where(mask, logp_infer.detach().to(dtype), zero)
    advantages = advantages.detach().to(dtype)
    ids = torch.where(mask, modality, torch.zeros_like(modality)).long()  # [B, T], safe to index with

    with torch.no_grad():
        log_mismatch = logp_old - logp_infer  # [B, T]: log r_t
        ratio_t = log_mismatch.exp()
        if cfg.token_gate:
            alpha, beta = _band_tables(cfg.token_band, logp)
            token_pass = (ratio_t >= alpha[ids]) & (ratio_t <= beta[ids])
        else:
            token_pass = torch.ones_like(mask)
        gated_tokens = mask & token_pass  # [B, T]

        n_mask = mask.sum(1)  # [B]
        rho = ((log_mismatch * mask).sum(1) / n_mask.clamp(min=1)).exp()  # [B]
        counts = torch.nn.functional.one_hot(ids, len(MODALITIES)).mul(mask.unsqueeze(-1)).sum(1)  # [B, M]
        seq_modality = counts.argmax(1)  # [B]; argmax returns the first maximum: ties go to the smallest id
        if cfg.sequence_gate:
            alpha, beta = _band_tables(cfg.sequence_band, logp)
            seq_pass = (rho >= alpha[seq_modality]) & (rho <= beta[seq_modality])
        else:
            seq_pass = torch.ones_like(n_mask, dtype=torch.bool)
        kept_seq = seq_pass & gated_tokens.any(1)  # [B]
        kept = gated_tokens & kept_seq.unsqueeze(1)  # [B, T]: k_t
        n_kept = kept.sum(1).clamp(min=1).to(dtype)  # [B]
        log_s = torch.where(kept, logp - logp_old, zero).sum(1) / n_kept  # [B]: sg[log s_i]

    if cfg.ratio == "token":  # [B, T]: each token's own ratio (PPO, GRPO)
        ratio = (logp - logp_old).exp()
    else:  # [B, T]: s_i,t, equal to s_i in value
        ratio = (log_s.unsqueeze(1) + logp - logp.detach()).exp()
    adv = advantages.unsqueeze(1)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv)
    objective = torch.where(kept, surrogate, zero).sum(1) / n_kept  # [B]: J_i, 0 for dropped sequences
    loss = -objective.sum() / batch

    with torch.no_grad():
        s = log_s.exp()
        n_seq = int(kept_seq.sum())
        if cfg.ratio == "token":  # the share of kept tokens whose own ratio is outside the band
            outside_t = kept & ((ratio < 1 - cfg.clip_low) | (ratio > 1 + cfg.clip_high))
            clipped = float(outside_t.sum()) / max(1.0, float(kept.sum()))
        else:  # the share of kept sequences whose ratio is outside the band
            outside = (s < 1 - cfg.clip_low) | (s > 1 + cfg.clip_high)
            clipped = float((outside & kept_seq).sum()) / n_seq if n_seq else 0.0
        stats = {
            "clip_fraction": clipped,
            "sequence_ratio_mean": float(s[kept_seq].mean()) if n_seq else 1.0,
            "sequence_masked_fraction": (batch - n_seq) / batch,
            "kept_tokens": float(kept.sum()),
        }
        k3 = ratio_t - log_mismatch - 1
        for m in present:
            of_m = mask & (modality == m)
            n_m = int(of_m.sum())
            stats[f"token_masked_fraction/{MODALITIES[m]}"] = float((of_m & ~token_pass).sum()) / n_m
            stats[f"mismatch_kl/{MODALITIES[m]}"] = float(k3[of_m].sum()) / n_m
    return MiscOutput(loss=loss, stats=stats)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> entropy [...] in nats, float32, via log_softmax (a -inf logit adds 0, not nan)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1)
