"""Training configuration: optimisation, schedule, precision, logging and checkpointing for one run."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Stage:
    """One stage of a staged run (`[[train.stages]]`): its steps, its row length, optionally a RoPE
    base and source weights. Rows per micro-batch scale so that positions per step stay those of
    `stream.seq_len` x `train.micro_batch_size`."""

    steps: int = 0
    seq_len: int = 0
    rope_theta: float = 0.0  # 0: keep the model's
    weights: dict[str, float] = field(default_factory=dict)  # source -> weight; empty: the sources' own


@dataclass
class TrainConfig:
    steps: int = 300
    micro_batch_size: int = 8
    grad_accum: int = 1
    lr: float = 3e-3
    warmup_steps: int = 0  # 0: derived from the run length (`warmup`: 10% of steps, at least 1)
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    zero_stage: int = 1
    # "auto": bf16 autocast on GPUs, fp32 on CPUs, where MoE training measured 0.5x in bf16 even
    # on an AMX Xeon (see trainer.distributed.use_bf16); "bf16" or "fp32" force it.
    precision: str = "auto"
    log_every: int = 10
    seed: int = 0
    save_checkpoint: bool = True  # a checkpoint when this invocation ends (at `steps` or `stop_after`)
    stop_after: int = 0  # stop this invocation at this global step (0: run to `steps`); resume later
    checkpoint_every: int = 0  # also a checkpoint every this many steps (0: only at the end)
    checkpoint_every_minutes: float = 0.0  # and after this many minutes without one (0: off)
    keep_last: int = 2  # complete checkpoints kept; older ones go once a newer one is complete (0: keep all)
    expert_parallel: int = 1  # ranks one layer's experts are spread over (divides the world size)
    # held-out loss per modality at every checkpoint and at the end, when stream.holdout > 0:
    # this many batches per modality mix (trainer.evaluate; 0: off)
    eval_batches: int = 4
    # "adamw" (torch) or "lazy_adamw" (trainer.optim: an element whose gradient is exactly 0 in a step,
    # e.g. a layer the elastic sub-model skipped, gets no moment decay, weight decay or update)
    optimizer: str = "adamw"
    stages: list[Stage] = field(default_factory=list)  # staged context extension; empty: one stage
    follow_every: int = 10  # with --follow: steps between looks for snapshots committed since
    # progressive unfreezing (fine-tuning): the last layer (with the output heads) trains first, one more
    # layer every this many steps, the embedding last; frozen parameters get no update (lazy AdamW). 0: off
    unfreeze_every: int = 0
    log_rows: bool = False  # write rows.jsonl: every step's global row indices, sources and row hashes

    def stage_bounds(self) -> list[tuple[int, int]]:
        """[start, stop) steps of each stage (one stage over the whole run when none is set)."""
        if not self.stages:
            return [(0, self.steps)]
        out, start = [], 0
        for st in self.stages:
            out.append((start, start + st.steps))
            start += st.steps
        return out

    def stage_at(self, step: int) -> int:
        for k, (a, b) in enumerate(self.stage_bounds()):
            if a <= step < b:
                return k
        return len(self.stage_bounds()) - 1

    def validate(self) -> None:
        if self.steps < 1 or self.micro_batch_size < 1 or self.grad_accum < 1:
            raise ValueError("train.steps, train.micro_batch_size and train.grad_accum must be >= 1")
        if self.zero_stage not in (0, 1, 2):
            raise ValueError(f"train.zero_stage must be 0, 1 or 2 on this trainer, got {self.zero_stage}")
        if not 0 <= self.stop_after <= self.steps:
            raise ValueError(f"train.stop_after ({self.stop_after}) must be between 0 and train.steps ({self.steps})")
        if self.checkpoint_every < 0 or self.checkpoint_every_minutes < 0:
            raise ValueError(f"train.checkpoint_every ({self.checkpoint_every}) and train.checkpoint_every_minutes "
                             f"({self.checkpoint_every_minutes}) must be >= 0 (0: off)")
        if self.keep_last < 0:
            raise ValueError(f"train.keep_last must be >= 0 (0 keeps every checkpoint), got {self.keep_last}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"train.precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.eval_batches < 0:
            raise ValueError(f"train.eval_batches must be >= 0 (0: no held-out evaluation), got {self.eval_batches}")
        if self.optimizer not in ("adamw", "lazy_adamw"):
            raise ValueError(f"train.optimizer must be adamw or lazy_adamw, got {self.optimizer!r}")
        if self.expert_parallel < 1:
            raise ValueError(f"train.expert_parallel must be >= 1, got {self.expert_parallel}")
        if self.expert_parallel > 1 and self.zero_stage not in (1, 2):
            raise ValueError("train.expert_parallel > 1 needs train.zero_stage 1 or 2 (resuming restores the "
                             "expert slices from ZeRO's master copies)")
        if self.stages:
            if any(st.steps < 1 or st.seq_len < 2 or st.rope_theta < 0 for st in self.stages):
                raise ValueError(f"every train.stages entry needs steps >= 1, seq_len >= 2 (rope_theta >= 0), got "
                                 f"{self.stages}")
            if sum(st.steps for st in self.stages) != self.steps:
                raise ValueError(f"train.stages cover {sum(st.steps for st in self.stages)} steps, train.steps is "
                                 f"{self.steps}: they must agree")
        if self.follow_every < 1 or self.unfreeze_every < 0:
            raise ValueError(f"train.follow_every must be >= 1 and train.unfreeze_every >= 0, got "
                             f"{self.follow_every}, {self.unfreeze_every}")
        if self.unfreeze_every and self.optimizer != "lazy_adamw":
            raise ValueError("train.unfreeze_every needs train.optimizer=lazy_adamw (AdamW would still move frozen "
                             "weights on their moments and weight decay)")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError(f"train.warmup_steps ({self.warmup_steps}) must be in [0, train.steps={self.steps}] "
                             "(0 derives it from the run length)")

    @property
    def warmup(self) -> int:
        """The warm-up steps this run uses: as set, or 10% of the run (at least 1) when unset."""
        return self.warmup_steps or max(1, round(0.1 * self.steps))

    def deepspeed_config(self) -> dict:
        return {
            "train_micro_batch_size_per_gpu": self.micro_batch_size,
            "gradient_accumulation_steps": self.grad_accum,
            "gradient_clipping": self.grad_clip,
            "zero_optimization": {"stage": self.zero_stage},
            "zero_allow_untested_optimizer": True,  # torch AdamW: DeepSpeed's fused Adams need CUDA
            "scheduler": {
                "type": "WarmupCosineLR",
                "params": {
                    "total_num_steps": self.steps,
                    "warmup_num_steps": self.warmup,
                    "warmup_type": "linear",
                    "cos_min_ratio": self.min_lr_ratio,
                },
            },
            "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
        }
