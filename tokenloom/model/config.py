"""Model configuration: size, experts, heads and elastic training; the token space comes from the manifest.

Each component owns its dataclass: `MoEConfig` (the routed and shared experts of every layer)
and `ElasticConfig` (sub-model sampling) are nested in `ModelConfig`, so a run config writes
`model.moe.top_k` or `model.elastic.enabled`, and `MoE` takes its own config whole instead of
a long argument list.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MOE_IMPLS = ("grouped", "loop")
ROPE_AXES = ("interleaved", "sections")  # see ModelConfig.rope_axes  # how Experts runs its experts, see tokenloom.model.moe


@dataclass
class MoEConfig:
    """Fine-grained routed experts plus shared ones, in every layer (tokenloom.model.moe).

    `impl` picks how the experts compute: "grouped" (one grouped matmul per projection over
    all experts) or "loop" (one matmul per expert, the plain twin the tests hold it to).
    """

    n_experts: int = 16
    top_k: int = 2
    expert_hidden: int = 128
    n_shared_experts: int = 1
    router_bias_update: float = 1e-3  # auxiliary-loss-free balancing speed (0: off)
    seq_balance_weight: float = 0.0  # optional sequence-level balance loss weight (DeepSeek-V3 uses 1e-4)
    router_z_weight: float = 0.0  # optional router z-loss weight (ST-MoE uses 1e-3)
    impl: str = "grouped"

    def validate(self) -> None:
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"model.moe.top_k must be in [1, model.moe.n_experts={self.n_experts}], got {self.top_k}")
        if self.expert_hidden < 1 or self.n_shared_experts < 0:
            raise ValueError("model.moe.expert_hidden must be >= 1 and model.moe.n_shared_experts >= 0, got "
                             f"{self.expert_hidden} and {self.n_shared_experts}")
        for name in ("router_bias_update", "seq_balance_weight", "router_z_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"model.moe.{name} must be >= 0, got {getattr(self, name)}")
        if self.impl not in MOE_IMPLS:
            raise ValueError(f"model.moe.impl must be one of {MOE_IMPLS}, got {self.impl!r}")


@dataclass
class ElasticConfig:
    """Per-step sampling of a sub-model (ERNIE 5.0's elastic depth, width and sparsity).

    Each training step independently draws: with `depth_prob` a random subset of layers keeping a
    fraction in [depth_min, depth_max] (else all layers); with `width_prob` routing restricted to a
    random fraction in [width_min, width_max] of the experts (else all); with `sparsity_prob` a
    top-k drawn from [1, top_k - 1] (else top_k). The draw is seeded by (seed, step), so every rank
    of a run picks the same sub-model. With `sandwich` such a step also trains the full model.
    """

    enabled: bool = False
    depth_prob: float = 0.25
    depth_min: float = 0.3
    depth_max: float = 0.7
    width_prob: float = 0.2
    width_min: float = 0.3
    width_max: float = 0.5
    sparsity_prob: float = 0.2
    seed: int = 0
    # the sandwich rule (slimmable networks, BigNAS): a step that draws a sub-model trains the full
    # model on the same rows too (the two losses summed, one backward), so the full model gets every
    # step's update; a sub-model step then costs the full model's forward and backward on top
    sandwich: bool = True

    def validate(self) -> None:
        for name in ("depth_prob", "width_prob", "sparsity_prob", "depth_min", "depth_max", "width_min", "width_max"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"model.elastic.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.depth_min > self.depth_max or self.width_min > self.width_max:
            raise ValueError("model.elastic: each *_min must be <= its *_max")


@dataclass
class ModelConfig:
    vocab_size: int = 0  # 0: taken from the dataset's vocabulary manifest
    # audio code ranges [start, stop) per RVQ level, from the manifest; empty without audio
    audio_ranges: tuple[tuple[int, int], ...] = ()
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    # how the rotary frequencies are shared by the (t, h, w) axes: "interleaved" (t, h, w, t, ...:
    # every axis gets high and low frequencies, as Qwen3-VL) or "sections" (t the highest half, h
    # and w a quarter each of the lowest, as Qwen2-VL; the w axis barely turns at small head sizes)
    rope_axes: str = "interleaved"
    norm_eps: float = 1e-6
    tie_embeddings: bool = True
    # mixture of experts (every layer): fine-grained routed experts plus shared ones
    moe: MoEConfig = field(default_factory=MoEConfig)
    # prediction heads
    mtp: bool = False  # an extra head predicting the token after next (text and image), depth 1
    mtp_weight: float = 0.3
    attention_backend: str = "auto"  # tokenloom.kernels.flashmask_attention backend
    elastic: ElasticConfig = field(default_factory=ElasticConfig)

    @property
    def audio_levels(self) -> int:
        return len(self.audio_ranges)

    def validate(self) -> None:
        if self.vocab_size <= 0:
            raise ValueError("model.vocab_size must be set (it comes from the vocabulary manifest)")
        if self.dim % self.n_heads or (self.dim // self.n_heads) % 4:
            raise ValueError(f"model.dim {self.dim} must split into {self.n_heads} heads of a size divisible by 4")
        if self.n_layers < 1:
            raise ValueError(f"model.n_layers must be >= 1, got {self.n_layers}")
        for start, stop in self.audio_ranges:
            if not 0 <= start < stop <= self.vocab_size:
                raise ValueError(f"audio range [{start}, {stop}) outside the vocabulary [0, {self.vocab_size})")
        if self.rope_axes not in ROPE_AXES:
            raise ValueError(f"model.rope_axes must be one of {ROPE_AXES}, got {self.rope_axes!r}")
        self.moe.validate()
        self.elastic.validate()
