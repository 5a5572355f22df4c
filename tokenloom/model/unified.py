"""The unified multimodal MoE transformer (single-device code).

One token space: the embedding table covers the whole vocabulary manifest (specials, text BPE,
visual codes, one audio range per RVQ level). A position's input is the sum of the embeddings
of the ids in its group: one id for text and image tokens, the L level codes of an audio frame.
Rotary positions are 3-D (t, h, w) as in M-RoPE: text and audio carry t = h = w, so the rotation
is plain 1-D RoPE; image tokens carry their row and column, so the grid is kept. Attention goes
through FlashMask (`tokenloom.kernels.flashmask_attention`) with the mask built from the batch's
segments: text causal, an image bidirectional within each row and causal across rows, audio
within a window, packed samples apart. Every layer's feed-forward is a fine-grained MoE with shared experts
(`tokenloom.model.moe`), routed without regard to modality.

Prediction, one group ahead. The shared output head scores the whole vocabulary for the next
position's first id: the next text token, the code in the same column of the next image row
(datasets/stream.py: a learned start row predicts row 0), or the next audio frame's level-0 code
(or `<eoa>`). An audio frame's levels 1..L-1 come from per-level heads, teacher-forced: level l sees
the hidden state plus the embeddings of the true codes of levels < l. With `mtp`, a depth-1
multi-token head also predicts the text token after next from the hidden state and the
next token's embedding (DeepSeek-V3's MTP, without its extra attention block).

Elastic sub-models (`tokenloom.model.elastic.SubModel`): a subset of layers, routing restricted
to a subset of experts, and a smaller top-k, applied per forward; `elastic.export_submodel`
copies one into a standalone model.

The attention mask's intervals come from the batch's per-position segment columns
(`mask_indices`, batched, no loop over rows); the trainer computes them once per micro-batch and
passes them in, and `forward` computes them itself when they are not given.

Shapes: B batch, P positions, G id slots per position, D model dim, H heads, E experts, V vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from tokenloom.contract import IGNORE_INDEX, MODALITIES, MODALITY_IDS, MODALITY_SLOTS, PAD_MODALITY
from tokenloom.kernels import flashmask_attention, mask_from_columns
from tokenloom.model.config import ModelConfig
from tokenloom.model.elastic import SubModel
from tokenloom.model.moe import MoE, SwiGLU, load_metrics


# -- positions and masks -------------------------------------------------------------------
def rope_tables(coords: torch.Tensor, head_dim: int, theta: float, axes: str = "interleaved"
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, P, 1, Dh/2] for coordinates [B, P, 3] (t, h, w).

    "interleaved": frequency i turns with axis i mod 3, so each axis spans the whole spectrum
    and an image's rows and columns are told apart at any head size. "sections": the first half
    of the frequencies turn with t, a quarter each with h and w (Qwen2-VL). Text and audio carry
    t = h = w, so both are plain 1-D RoPE for them."""
    half = head_dim // 2
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=coords.device).float() / head_dim)
    if axes == "interleaved":
        axis = torch.arange(half, device=coords.device) % 3
    else:
        n_t = half // 2
        n_h = (half - n_t) // 2
        axis = torch.tensor([0] * n_t + [1] * n_h + [2] * (half - n_t - n_h), device=coords.device)
    angles = coords.float()[..., axis] * freqs  # [B, P, Dh/2]
    return angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (x_i, x_{i + Dh/2}) (the "rotate half" layout)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


def mask_indices(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """FlashMask `startend_row_indices` int32 [B, 1, P, 4] (causal=False) from a batch's segment columns.

    Batched and on the batch's device (`kernels.mask_from_columns`). A stream row's padding is a
    causal segment of its last document (datasets/stream.py), so it needs nothing special here.
    The trainer calls this once per micro-batch and passes the result to `loss`/`forward`."""
    return mask_from_columns(batch["segment_ids"], batch["doc_ids"], batch["attention"], batch["window"])


# -- layers ----------------------------------------------------------------------------------
class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.backend = cfg.n_heads, cfg.attention_backend
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.out = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin, indices, cache=None):
        q, k, v = rearrange(self.qkv(x), "b l (three h d) -> three b l h d", three=3, h=self.n_heads)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # decoding: append k, v to this layer's cache and attend to all of it
            y = cache.attend(q, k, v)
        else:
            y = flashmask_attention(q, k, v, indices, causal=False, backend=self.backend)
        return self.out(rearrange(y.to(x.dtype), "b l h d -> b l (h d)"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.moe_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.moe = MoE(cfg.dim, cfg.moe)

    def forward(self, x, cos, sin, indices, modality, allowed, top_k, cache=None):
        x = x + self.attn(self.attn_norm(x), cos, sin, indices, cache)
        y, aux = self.moe(self.moe_norm(x), modality, allowed, top_k)
        return x + y, aux


class LevelHead(nn.Module):
    """Scores RVQ level l's codebook from the hidden state plus the embeddings of levels < l."""

    def __init__(self, dim: int, size: int, eps: float):
        super().__init__()
        self.norm = nn.RMSNorm(dim, eps=eps)
        self.proj = nn.Linear(dim, size, bias=False)

    def forward(self, z):
        return self.proj(self.norm(z))


class MTPHead(nn.Module):
    """Depth-1 multi-token prediction: [h_i ; emb(x_{i+1})] -> a state scored by the shared head for x_{i+2}."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.h_norm, self.e_norm = nn.RMSNorm(dim, eps=eps), nn.RMSNorm(dim, eps=eps)
        self.proj = nn.Linear(2 * dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim, eps=eps)
        self.mlp = SwiGLU(dim, 2 * dim)
        self.out_norm = nn.RMSNorm(dim, eps=eps)

    def forward(self, h, e):
        z = self.proj(torch.cat([self.h_norm(h), self.e_norm(e)], dim=-1))
        z = z + self.mlp(self.mlp_norm(z))
        return self.out_norm(z)


class UnifiedModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.level_heads = nn.ModuleList(LevelHead(cfg.dim, stop - start, cfg.norm_eps)
                                         for start, stop in cfg.audio_ranges[1:])
        self.mtp = MTPHead(cfg.dim, cfg.norm_eps) if cfg.mtp else None
        self.apply(self._init)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        for block in self.blocks:  # residual branches scaled down with depth (GPT-2)
            nn.init.normal_(block.attn.out.weight, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def moe_layers(self) -> list[MoE]:
        return [block.moe for block in self.blocks]

    # -- forward --------------------------------------------------------------------------
    def embed_groups(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, P, G] (unused slots < 0) -> summed embeddings [B, P, D]."""
        used = ids >= 0
        return (self.embed(ids.clamp_min(0)) * used[..., None].to(self.embed.weight.dtype)).sum(2)

    def forward(self, batch: dict[str, torch.Tensor], sub: SubModel | None = None,
                indices: torch.Tensor | None = None, cache=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states [B, P, D] (normed) and the summed auxiliary routing loss.

        `indices`: the batch's FlashMask intervals (`mask_indices(batch)`); computed here when not given.
        `cache`: a `generate.KVCache` whose visibility for these positions is prepared; the batch
        then holds only the new positions (ids, coords, modality) and attention reads the cache."""
        sub = sub or SubModel()
        cfg = self.cfg
        if cache is None and indices is None:
            indices = mask_indices(batch)
        cos, sin = rope_tables(batch["coords"], cfg.dim // cfg.n_heads, cfg.rope_theta, cfg.rope_axes)
        allowed = None
        if sub.experts is not None:
            allowed = torch.zeros(cfg.moe.n_experts, dtype=torch.bool, device=batch["ids"].device)
            allowed[list(sub.experts)] = True
        layers = range(len(self.blocks)) if sub.layers is None else sub.layers
        for moe in self.moe_layers():
            moe.last_load = None
        x = self.embed_groups(batch["ids"])
        aux = x.new_zeros((), dtype=torch.float32)
        for i in layers:
            layer_cache = None if cache is None else cache.layers[i]
            x, layer_aux = self.blocks[i](x, cos, sin, indices, batch["modality"], allowed, sub.top_k, layer_cache)
            aux = aux + layer_aux
        return self.norm(x), aux

    def logits(self, batch: dict[str, torch.Tensor], sub: SubModel | None = None,
               indices: torch.Tensor | None = None) -> torch.Tensor:
        """Next-position scores over the whole vocabulary [B, P, V]."""
        return self.head(self.forward(batch, sub, indices)[0])

    # -- loss -----------------------------------------------------------------------------
    def loss(self, batch: dict[str, torch.Tensor], sub: SubModel | None = None, indices: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Token-weighted cross-entropy over every predicted id (+ routing aux, + weighted MTP).

        Returns the loss to minimise and its parts: the mean CE per target modality (detached
        sums and counts are kept too, so the trainer can average them over ranks). The batch's
        integer columns may be of any integer dtype (the packer writes int32, `contract.ROW_DTYPE`);
        the targets are widened to int64 here, where the cross-entropy needs them."""
        h, aux = self.forward(batch, sub, indices)
        labels = batch["labels"]
        target = labels[..., 0]
        has_target = target != IGNORE_INDEX
        tmod = batch["target_modality"]  # the row's last target lies past the row: the stream knows it
        ce = F.cross_entropy(self.head(h[has_target]).float(), target[has_target].long(), reduction="none")
        sums, counts = {}, {}
        tm = tmod[has_target]
        for m, name in enumerate(MODALITIES):
            sel = tm == m
            sums[name], counts[name] = ce[sel].sum(), sel.sum()
        # The level heads and the MTP head run on every rank and step, on no rows if need be: under
        # ZeRO a parameter that gets no gradient on one rank shortens that rank's reduce bucket, and
        # the ranks' collectives then disagree in size (the gloo "data size doesn't match" abort).
        audio = tmod == MODALITY_IDS["audio"]
        if len(self.level_heads):
            h_a, lab = h[audio], labels[audio]  # [Na, D], [Na, G]
            cond = h_a
            level_ce = []
            for level, head in enumerate(self.level_heads, start=1):
                cond = cond + self.embed(lab[:, level - 1])
                start = self.cfg.audio_ranges[level][0]
                level_ce.append(F.cross_entropy(head(cond).float(), lab[:, level].long() - start, reduction="none"))
            stacked = torch.stack(level_ce)
            sums["audio"] = sums["audio"] + stacked.sum()
            counts["audio"] = counts["audio"] + stacked.numel()
        total_count = sum(counts.values())
        main = sum(sums.values()) / total_count.clamp_min(1)
        parts = {f"loss_{n}": (sums[n] / counts[n].clamp_min(1)).detach() for n in MODALITIES}
        parts.update({f"sum_{n}": sums[n].detach() for n in MODALITIES})
        parts.update({f"count_{n}": counts[n].detach().float() for n in MODALITIES})
        loss = main + aux
        parts["aux"] = aux.detach()
        if self.mtp is not None:
            mtp_loss = self._mtp_loss(h, labels, tmod)
            parts["loss_mtp"] = mtp_loss.detach()
            loss = loss + self.cfg.mtp_weight * mtp_loss
        return loss, parts

    def _mtp_loss(self, h: torch.Tensor, labels: torch.Tensor, tmod: torch.Tensor) -> torch.Tensor:
        """Predict position i+2's token from h_i and the embedding of position i+1's token (text targets).

        Only where positions i and i+1 both predict text, i.e. their next position: an image
        position predicts the row below, whose next row may sit in its own row's view (a leak)."""
        text = tmod == MODALITY_IDS["text"]
        ok = text[:, :-1] & text[:, 1:]  # i+1 and i+2 are the next two text tokens of one sample
        h_i = h[:, :-1][ok]
        nxt = self.embed(labels[:, :-1, 0][ok])
        z = self.mtp(h_i, nxt)  # on no rows when there is no pair: every rank's head gets a gradient
        ce = F.cross_entropy(self.head(z).float(), labels[:, 1:, 0][ok].long(), reduction="sum")
        return ce / ok.sum().clamp_min(1)

    # -- routing statistics and balancing -------------------------------------------------
    def routing_loads(self) -> torch.Tensor:
        """[layers, MODALITY_SLOTS, E] token-expert assignments of the last forward (padding last)."""
        out = torch.zeros(len(self.blocks), MODALITY_SLOTS, self.cfg.moe.n_experts)
        for i, moe in enumerate(self.moe_layers()):
            if moe.last_load is not None:
                out[i] = moe.last_load.cpu()
        return out

    def update_router_bias(self, loads: torch.Tensor, sub: SubModel | None = None) -> None:
        """Auxiliary-loss-free step for every layer from loads [layers, MODALITY_SLOTS, E] (padding excluded)."""
        allowed = None
        if sub is not None and sub.experts is not None:
            allowed = torch.zeros(self.cfg.moe.n_experts, dtype=torch.bool)
            allowed[list(sub.experts)] = True
        for i, moe in enumerate(self.moe_layers()):
            moe.update_bias(loads[i, :PAD_MODALITY].sum(0), allowed)


def routing_metrics(loads: torch.Tensor) -> dict[str, float]:
    """Per layer and modality: expert load balance of loads [layers, MODALITY_SLOTS, E] (padding ignored)."""
    out: dict[str, float] = {}
    for layer in range(loads.shape[0]):
        for m, name in enumerate((*MODALITIES, "all")):
            load = loads[layer, :PAD_MODALITY].sum(0) if name == "all" else loads[layer, m]
            if float(load.sum()) == 0:
                continue
            for key, value in load_metrics(load).items():
                out[f"l{layer}.{name}.{key}"] = value
    return out
