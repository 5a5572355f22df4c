"""Ingestion configuration: Ray connection and one tokenizer pool per modality.

Pools are data, not code: a modality's pool says which tokenizer class serves it and what
each actor needs. Adding the visual or audio tokenizer adds a registry entry and a pool
here; the pipeline does not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenloom.datasets.filters import FilterConfig
from tokenloom.datasets.video import VideoConfig
from tokenloom.platform.guard import FaultConfig
from tokenloom.platform.services import ServiceConfig


@dataclass
class PoolConfig:
    """One Ray Data actor pool (autoscaling between min_actors and max_actors)."""

    num_cpus: float = 0.5  # fractional so read and write tasks are never starved
    num_gpus: float = 0.0  # per actor, used where the cluster has GPUs (else the pool runs on CPUs)
    resource_label: str = ""  # a custom Ray resource: pools scale independently on CPU-only nodes
    min_actors: int = 2  # measured: starting both actors at once beats scaling up from one
    max_actors: int = 2
    batch_size: int = 64
    # a job with less input than this runs the pool as Ray tasks on reusable worker processes
    # instead of starting actors (platform/pools.py); 0: always actors
    task_below_bytes: int = 4 << 20
    # how often a worker process that died (killed, out of memory, a poisoned record) is replaced
    # and its batch retried; each poisoned record of a batch costs one (platform/guard.py)
    max_restarts: int = 16

    def validate(self, modality: str) -> None:
        if not 1 <= self.min_actors <= self.max_actors:
            raise ValueError(
                f"pool {modality!r}: need 1 <= min_actors <= max_actors, got {self.min_actors}..{self.max_actors}"
            )
        if self.batch_size < 1 or self.num_cpus < 0 or self.num_gpus < 0 or self.max_restarts < 0:
            raise ValueError(f"pool {modality!r}: batch_size must be >= 1 and resources and max_restarts >= 0")


@dataclass
class RayConfig:
    address: str = ""  # empty: start a local Ray; "auto" or ray://host:10001 for a cluster
    num_cpus: int = 0  # local only; 0 = all cores
    object_store_mb: int = 512  # local only: small machines need a bound
    progress_bars: bool = True


@dataclass
class DedupConfig:
    """`[ingest.dedup]`: which duplicates a job drops, within itself and against its dataset."""

    enabled: bool = True
    exact: bool = True  # same content hash of the normalized record
    near_text: bool = True  # MinHash LSH over word shingles
    near_image: bool = True  # perceptual hash within a Hamming distance
    minhash_threshold: float = 0.8  # estimated Jaccard of the shingle sets at or above which text is a duplicate
    shingle_size: int = 5  # words per shingle; a shorter document is one shingle
    num_perm: int = 128
    # phash bits that may differ (of 64). Measured on the 18 sample photos: a JPEG re-encode, a
    # 0.8x resize or a 15% brightening differs by <= 4 bits (10 for the saturated colour wheel
    # brightened); distinct photos, their 3/4 crops and the odd files differ by >= 18
    phash_threshold: int = 12
    text: bool = True  # per-modality switches
    image: bool = True
    audio: bool = True

    def validate(self) -> None:
        if not 0.0 < self.minhash_threshold <= 1.0:
            raise ValueError(f"ingest.dedup.minhash_threshold must be in (0, 1], got {self.minhash_threshold}")
        if not 0 <= self.phash_threshold <= 64:
            raise ValueError(f"ingest.dedup.phash_threshold is a Hamming distance of 64-bit hashes: 0..64, "
                             f"got {self.phash_threshold}")
        if self.shingle_size < 1 or self.num_perm < 16:
            raise ValueError(f"ingest.dedup: need shingle_size >= 1 and num_perm >= 16, got "
                             f"{self.shingle_size} and {self.num_perm}")


@dataclass
class IngestConfig:
    ray: RayConfig = field(default_factory=RayConfig)
    pools: dict[str, PoolConfig] = field(default_factory=lambda: {
        "text": PoolConfig(resource_label="text_pool"),
        # one GPU per actor on GPU nodes; on CPU-only machines a CPU pool with its own label that
        # scales apart from the text pool
        "image": PoolConfig(resource_label="image_pool", num_gpus=1.0, min_actors=1, max_actors=2, batch_size=16),
        "audio": PoolConfig(resource_label="audio_pool", min_actors=1, max_actors=2, batch_size=4),
        # video files: frames on the visual pool's nodes (its label, a GPU per actor where there are
        # GPUs), then the sound track on the audio pool's (`ingest.pools.audio`; workers.STAGES)
        "video": PoolConfig(resource_label="image_pool", num_gpus=1.0, min_actors=1, max_actors=2, batch_size=2),
    })
    video: VideoConfig = field(default_factory=VideoConfig)  # frame rate, pixel budget, limits (datasets/video.py)
    read_tasks: int = 0  # 0 = let Ray Data choose
    # a JSON-lines text corpus larger than this is read as byte ranges of this size aligned to its
    # lines, one read task each (datasets/sources.py), so one big file feeds every actor; 0: never
    split_bytes: int = 64 << 20
    # rows a write task buffers into one data file (per modality mix): fewer, larger Parquet files
    # are cheaper to plan and read, and a small job does not start a write task per pool batch
    rows_per_file: int = 8192
    # the fraction of captioned images and transcribed audio laid out text first (caption, then
    # the media) instead of media first: the model learns text -> image and text -> speech from
    # the former, captioning and transcription from the latter. Chosen per sample by a hash of its
    # id, so a sample's layout never changes between runs.
    text_first: float = 0.5
    filters: FilterConfig = field(default_factory=FilterConfig)  # quality filters (datasets/filters.py)
    dedup: DedupConfig = field(default_factory=DedupConfig)  # platform/dedup.py
    faults: FaultConfig = field(default_factory=FaultConfig)  # injected faults for drills (platform/guard.py)
    service: ServiceConfig = field(default_factory=ServiceConfig)  # `tokenloom pools up` (platform/services.py)
    # where a job tokenizes: "job" (its own Ray Data actor pools or tasks) or "service" (the
    # long-lived services `tokenloom pools up` started, through Serve handles: no actor starts)
    pools_mode: str = "job"

    def validate(self) -> None:
        if self.pools_mode not in ("job", "service"):
            raise ValueError(f"ingest.pools_mode must be job or service, got {self.pools_mode!r}")
        self.service.validate()
        if self.split_bytes < 0:
            raise ValueError(f"ingest.split_bytes must be >= 0 (0: never split), got {self.split_bytes}")
        if not 0.0 <= self.text_first <= 1.0:
            raise ValueError(f"ingest.text_first must be in [0, 1], got {self.text_first}")
        self.filters.validate()
        self.dedup.validate()
        self.video.validate()

    def pool(self, modality: str) -> PoolConfig:
        if modality not in self.pools:
            raise ValueError(f"no tokenizer pool configured for modality {modality!r}; configured: {sorted(self.pools)}")
        return self.pools[modality]
