"""`[rl]`: one RL post-training run — the task, the buffer, rollouts, the objective, hints, schedule.

Sizes follow ERNIE 5.0's U-RB vocabulary: a training batch is `batch_queries` (Omega_BS) queries of
`group_size` responses each (a GSPO group); the inference pool holds `oversample` (N) batches'
worth of queries; every round gives each unfinished response at most `round_tokens` new tokens,
so a long answer spans rounds (and policy versions). Defaults are the CPU recipe the tests and
`bench/` use; `configs/rl.toml` is the task recipe (SFT start and RL) for a 2-core machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenloom.contract import MODALITIES, MODALITY_IDS
from tokenloom.trainer.rl.hints import HintConfig


def _default_bands() -> dict[str, tuple[float, float]]:
    return {name: (0.5, 5.0) for name in MODALITIES}


@dataclass
class MiscConfig:
    clip_low: float = 3e-4  # GSPO: the sequence ratio is clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 4e-4
    # IcePop token gate [alpha, beta] on r_t = pi_old / pi_infer, per modality name
    token_band: dict[str, tuple[float, float]] = field(default_factory=_default_bands)
    # IcePop sequence gate [alpha, beta] on the length-normalised mismatch ratio rho_i, per modality name
    sequence_band: dict[str, tuple[float, float]] = field(default_factory=_default_bands)
    token_gate: bool = True
    sequence_gate: bool = True
    # "sequence": GSPO's one length-normalised ratio per response (MISC); "token": a ratio per token,
    # clipped per token, as PPO and GRPO do (the baseline: with clip_low = clip_high = 0.2 and both
    # gates off it is GRPO's objective without the KL term, as DAPO and verl's defaults run it)
    ratio: str = "sequence"

    def validate(self) -> None:
        if self.ratio not in ("sequence", "token"):
            raise ValueError(f"rl.misc.ratio must be sequence (GSPO) or token (GRPO-style), got {self.ratio!r}")
        if not (self.clip_low >= 0 and self.clip_high >= 0):
            raise ValueError(f"clip_low and clip_high must be >= 0, got {self.clip_low} and {self.clip_high}")
        if self.clip_low >= 1:
            raise ValueError(f"clip_low must be < 1 (the lower clip bound 1 - clip_low must stay positive), "
                             f"got {self.clip_low}")
        for gate, bands in (("token_band", self.token_band), ("sequence_band", self.sequence_band)):
            for name, band in bands.items():
                if name not in MODALITY_IDS:
                    raise ValueError(f"{gate} names an unknown modality {name!r}; "
                                     f"the modalities are {', '.join(MODALITIES)}")
                alpha, beta = band
                if not 0 < alpha < beta:
                    raise ValueError(f"{gate}[{name!r}] = ({alpha}, {beta}) must satisfy 0 < alpha < beta")


@dataclass
class RLConfig:
    task: str = "sort"
    buckets: str = ""  # difficulty buckets the training queries cycle through ("0,1,2"; empty: all)
    buffer: str = "urb"  # urb | sync | april
    batch_queries: int = 4  # Omega_BS
    group_size: int = 8  # responses per query (the advantage's group)
    oversample: int = 2  # N: the inference pool holds batch_queries * N queries
    round_tokens: int = 8  # new tokens per response per rollout round
    max_response_tokens: int = 24  # a response that reaches this without <eos> ends (and scores as written)
    temperature: float = 1.0
    rollout_actors: int = 2  # Ray actors holding a copy of the policy (0: in this process, no Ray)
    # the rollout copy's weights: "bf16" rounds them to bfloat16 (compute stays fp32), so pi_infer
    # really differs from pi_train, as between an inference engine and a trainer; "fp32": identical
    rollout_weights: str = "bf16"
    steps: int = 40  # training batches
    stop_after: int = 0  # end this invocation at this step (0: run to steps); --resume continues
    # end this invocation after the first step that finishes past this many minutes of wall clock,
    # counted from the rollout pool's start, hint probes included, evaluations not (0: no limit);
    # the same budget for every method is how bench/bench_rl.py compares them
    max_minutes: float = 0.0
    updates_per_batch: int = 2  # optimizer steps per batch (its mini-batches): later ones are off-policy
    lr: float = 2e-5
    warmup_steps: int = 0
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    misc: MiscConfig = field(default_factory=MiscConfig)
    hints: bool = False  # AHRL
    hint: HintConfig = field(default_factory=HintConfig)
    eval_every: int = 10  # pass@1 per bucket (greedy, no hints) every this many steps and at the end (0: end only)
    eval_queries: int = 16  # held-out queries per bucket
    eval_buckets: str = ""  # empty: every bucket of the task
    checkpoint_every: int = 10  # 0: only at the end
    keep_last: int = 2
    seed: int = 0

    def validate(self) -> None:
        if min(self.batch_queries, self.group_size, self.oversample, self.round_tokens, self.max_response_tokens,
               self.steps, self.updates_per_batch, self.eval_queries) < 1:
            raise ValueError("rl.batch_queries, group_size, oversample, round_tokens, max_response_tokens, steps, "
                             "updates_per_batch and eval_queries must be >= 1")
        if self.seed < 0:
            raise ValueError(f"rl.seed must be >= 0, got {self.seed}")
        if self.group_size < 2:
            raise ValueError("rl.group_size must be >= 2: the advantage compares a response with its group's others")
        if self.rollout_actors < 0:
            raise ValueError(f"rl.rollout_actors must be >= 0 (0: roll out in this process), got {self.rollout_actors}")
        if self.rollout_weights not in ("bf16", "fp32"):
            raise ValueError(f"rl.rollout_weights must be bf16 or fp32, got {self.rollout_weights!r}")
        if not 0 <= self.stop_after <= self.steps or self.temperature <= 0:
            raise ValueError("rl.stop_after must be in [0, rl.steps] and rl.temperature > 0 (rollouts sample; their "
                             "log-probabilities are the behaviour policy's)")
        if self.updates_per_batch > self.batch_queries * self.group_size:
            raise ValueError(f"rl.updates_per_batch ({self.updates_per_batch}) cannot exceed the batch's "
                             f"{self.batch_queries * self.group_size} responses")
        if min(self.eval_every, self.checkpoint_every, self.keep_last, self.warmup_steps, self.max_minutes) < 0 or self.lr <= 0:
            raise ValueError("rl.eval_every, checkpoint_every, keep_last, warmup_steps and max_minutes must be >= 0, rl.lr > 0")
        self.misc.validate()
        self.hint.validate()
