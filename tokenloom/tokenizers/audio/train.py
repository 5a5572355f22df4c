"""Training, evaluation and bundles of the RVQ audio tokenizer.

Training runs on random segments of the training clips for a wall-clock budget (the shared
loop in `tokenizers/loop.py`: cosine schedule, checkpoints, exact resume, held-out
evaluations). Losses: multi-scale log-mel distance (torchaudio), time-domain L1, the RVQ
commitment loss and negative SI-SDR (phase: without it the waveform never lined up within a
CPU budget); optionally EnCodec's loss balancer and a multi-scale STFT discriminator with
feature matching (`adversarial.py`; measured in bench/RESULTS.md). Evaluation decodes held-out clips
from the first k levels for k = 1, 2, 4, ..., L and reports SI-SDR (`tokenizers.metrics`), mel
distance, bitrate and codebook usage per level, with a PNG of spectrograms and WAV files.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from tokenloom.tokenizers import bundle
from tokenloom.tokenizers.audio.adversarial import (
    Balancer,
    MultiScaleSTFTDiscriminator,
    discriminator_loss,
    generator_losses,
)
from tokenloom.tokenizers.audio.config import AudioTokenizerConfig
from tokenloom.tokenizers.audio.model import (
    AudioTokenizer,
    CompressedSpectralLoss,
    MultiScaleMel,
    parameter_count,
)
from tokenloom.tokenizers.loop import run_training
from tokenloom.tokenizers.metrics import si_sdr

FORMAT = "tokenloom.audio/1"


def level_counts(levels: int) -> list[int]:
    """The first-k levels evaluated: 1, 2, 4, ... and L."""
    ks, k = [], 1
    while k < levels:
        ks.append(k)
        k *= 2
    return ks + [levels]


class SegmentSampler:
    """Random fixed-length segments of a set of clips (short clips are zero-padded)."""

    def __init__(self, clips: list[np.ndarray], samples: int, seed: int):
        if not clips:
            raise ValueError("no training audio")
        self.clips = [torch.from_numpy(np.ascontiguousarray(c, dtype=np.float32)) for c in clips]
        lengths = torch.tensor([max(len(c), samples) for c in self.clips], dtype=torch.float64)
        self.weights = lengths / lengths.sum()  # by duration: every second of audio equally likely
        self.samples = samples
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, n: int) -> torch.Tensor:
        out = torch.zeros(n, 1, self.samples)
        picks = torch.multinomial(self.weights, n, replacement=True, generator=self.generator)
        # quantizer dropout draws from Python's RNG and dead-code replacement from torch's: seed
        # both from ours, so a resumed run repeats exactly what the uninterrupted one would do
        seed = int(torch.randint(0, 2**62, (1,), generator=self.generator))
        random.seed(seed)
        torch.manual_seed(seed)
        for row, i in enumerate(picks.tolist()):
            clip = self.clips[i]
            if len(clip) <= self.samples:
                out[row, 0, :len(clip)] = clip
            else:
                start = int(torch.randint(0, len(clip) - self.samples + 1, (1,), generator=self.generator))
                out[row, 0] = clip[start:start + self.samples]
        return out

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def load_state(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)


def si_sdr_per_item(recon: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean SI-SDR (dB) over the batch items whose target has sound (silence has no SI-SDR)."""
    energy = target.pow(2).mean(dim=(1, 2))
    keep = energy > 1e-6
    if not bool(keep.any()):
        return recon.new_zeros(())
    return si_sdr(recon[keep, 0], target[keep, 0]).mean()


def heldout_clips(clips: list[np.ndarray], seconds: float, sample_rate: int = 16_000) -> list[torch.Tensor]:
    limit = int(seconds * sample_rate)
    return [torch.from_numpy(np.ascontiguousarray(c[:limit], dtype=np.float32))[None] for c in clips if len(c)]


# -- evaluation ---------------------------------------------------------------------------
@dataclass
class AudioEvalResult:
    si_sdr: float  # dB, all L levels
    mel: float  # multi-scale log-mel L1, all L levels
    by_levels: dict[int, dict] = field(default_factory=dict)  # k -> {si_sdr, mel, bitrate}
    usage: list[float] = field(default_factory=list)  # per level: fraction of the codebook used
    clips: int = 0
    seconds: float = 0.0
    frames: int = 0
    files: dict = field(default_factory=dict)  # pictures and WAVs written

    def to_dict(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def evaluate(model: AudioTokenizer, clips: list[torch.Tensor], out_dir: Path | None = None, names=None,
             wavs: int = 2, levels: int | None = None) -> AudioEvalResult:
    """Reconstruct each clip ([1, T] at 16 kHz) from the first k levels, for k in 1, 2, 4, ..., L
    (and `levels`); the spectrograms and WAVs use `levels` (all by default)."""
    if not clips:
        raise ValueError("nothing to evaluate: no audio")
    model.eval()
    device = next(model.parameters()).device
    mel = MultiScaleMel(model.cfg.sample_rate).to(device)
    shown = levels or model.levels
    ks = sorted(set(level_counts(model.levels)) | {shown})
    scores = {k: {"si_sdr": [], "mel": []} for k in ks}
    histograms = torch.zeros(model.levels, model.cfg.codebook_size, dtype=torch.long)
    frames, recon_full, originals = 0, [], []
    for clip in clips:
        wav = model.pad(clip[None].to(device))
        codes = model.encode(wav)
        frames += codes.shape[1]
        for level in range(model.levels):
            histograms[level] += torch.bincount(codes[0, :, level].cpu(), minlength=model.cfg.codebook_size)
        for k in ks:
            recon = model.decode(codes, k).float()
            sdr = si_sdr(recon[0, 0], wav[0, 0])
            scores[k]["si_sdr"].append(float(sdr))
            scores[k]["mel"].append(float(mel(recon, wav)))
            if k == shown:
                recon_full.append(recon[0, 0].cpu())
        originals.append(wav[0, 0].cpu())
    by_levels = {k: {"si_sdr": float(np.mean(v["si_sdr"])), "mel": float(np.mean(v["mel"])),
                     "bitrate": model.cfg.bitrate(k)} for k, v in scores.items()}
    result = AudioEvalResult(
        si_sdr=by_levels[model.levels]["si_sdr"], mel=by_levels[model.levels]["mel"], by_levels=by_levels,
        usage=[float((h > 0).sum()) / model.cfg.codebook_size for h in histograms], clips=len(clips),
        seconds=sum(len(o) for o in originals) / model.cfg.sample_rate, frames=frames,
    )
    if out_dir is not None:
        result.files = write_listening(originals, recon_full, Path(out_dir), model.cfg.sample_rate, names, wavs)
    return result


def write_listening(originals: list[torch.Tensor], recons: list[torch.Tensor], out_dir: Path, sample_rate: int,
                    names=None, wavs: int = 2) -> dict:
    """Spectrograms of originals above reconstructions (PNG) and WAV files of the first clips."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import soundfile as sf
    from torchaudio.transforms import MelSpectrogram

    out_dir.mkdir(parents=True, exist_ok=True)
    spec = MelSpectrogram(sample_rate, n_fft=1024, hop_length=160, n_mels=80)
    shown = min(len(originals), 3)
    fig, axes = plt.subplots(2, shown, figsize=(4.5 * shown, 5), squeeze=False)
    for col in range(shown):
        for row, (wav, title) in enumerate([(originals[col], "original"), (recons[col], "reconstruction")]):
            image = torch.log10(spec(wav.float()) + 1e-5).numpy()
            axes[row][col].imshow(image, origin="lower", aspect="auto", cmap="magma")
            label = (names[col] if names else f"clip {col}").rsplit("/", 1)[-1]
            axes[row][col].set_title(f"{title}: {label}", fontsize=8)
            axes[row][col].set_xticks([])
            axes[row][col].set_yticks([])
    fig.tight_layout()
    picture = out_dir / "spectrograms.png"
    fig.savefig(picture, dpi=90)
    plt.close(fig)
    written = {"spectrograms": str(picture), "wavs": []}
    for i in range(min(wavs, len(originals))):
        for wav, kind in ((originals[i], "original"), (recons[i], "reconstruction")):
            path = out_dir / f"clip{i}-{kind}.wav"
            sf.write(path, wav.clamp(-1, 1).numpy(), sample_rate, subtype="PCM_16")
            written["wavs"].append(str(path))
    return written


# -- bundles ------------------------------------------------------------------------------
def config_from_dict(doc: dict) -> AudioTokenizerConfig:
    known = AudioTokenizerConfig.__dataclass_fields__
    return AudioTokenizerConfig(**{k: v for k, v in doc.items() if k in known})


def publish_bundle(model: AudioTokenizer, store: Path, heldout: dict | None = None) -> bundle.BundleInfo:
    if not model.codebook_ready:
        raise ValueError("refusing to publish an audio tokenizer whose RVQ codebooks were never initialized")
    return bundle.publish_module(model, store, "audio", {
        "format": FORMAT,
        "config": asdict(model.cfg),
        "levels": model.levels,
        "codebook_size": model.cfg.codebook_size,
        "code_ranges": [[0, model.cfg.codebook_size]] * model.levels,  # local ids per level
        "frame_rate": model.cfg.frame_rate,
        "sample_rate": model.cfg.sample_rate,
        "layout": "frame-major: L codes per frame, level 1 first",
        "parameters": parameter_count(model),
        "heldout": heldout or {},
    })


def load_audio(path: Path | str) -> AudioTokenizer:
    """An audio tokenizer bundle, ready to encode/decode (eval mode, no gradients)."""
    return bundle.load_module(path, "audio", FORMAT, lambda doc: AudioTokenizer(config_from_dict(doc["config"])))


# -- training -----------------------------------------------------------------------------
@dataclass
class AudioTrainResult:
    bundle: bundle.BundleInfo
    steps: int
    seconds: float
    seconds_of_audio_per_second: float
    heldout: dict
    run_dir: str
    parameters: int


def train_audio(train_clips: list[np.ndarray], heldout: list[np.ndarray], cfg: AudioTokenizerConfig, store: Path,
                run_dir: Path, *, resume: bool = False, progress: bool = True, stop_after: int = 0,
                device: str | None = None) -> AudioTrainResult:
    """Train on 16 kHz mono clips for `cfg.max_minutes` (or `cfg.steps`), evaluate, publish a bundle."""
    cfg.validate()
    if not heldout:
        raise ValueError("no held-out audio: evaluation needs at least one clip")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run_dir = Path(run_dir)
    torch.manual_seed(cfg.seed)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = AudioTokenizer(cfg).to(device)
    sampler = SegmentSampler(train_clips, int(cfg.segment_seconds * cfg.sample_rate), cfg.seed)
    if not resume:  # every level's codebook starts from k-means on real audio, whatever the dropout draws
        model.init_codebook(sampler.batch(64).to(device))  # 64 segments: enough vectors for k-means
    eval_set = heldout_clips(heldout, cfg.eval_seconds, cfg.sample_rate)
    mel = MultiScaleMel(cfg.sample_rate).to(device)
    summaries: dict[str, dict] = {}
    companions: dict = {}
    discriminator = None
    if cfg.adversarial:
        discriminator = MultiScaleSTFTDiscriminator(tuple(cfg.disc_scales), cfg.disc_channels).to(device)
        disc_optimizer = torch.optim.AdamW(discriminator.parameters(), lr=cfg.disc_lr, betas=(0.5, 0.9))
        companions.update(discriminator=discriminator, discriminator_optimizer=disc_optimizer)
    spectral = CompressedSpectralLoss(cfg).to(device) if cfg.spec_weight else None
    weights = {"l1": cfg.l1_weight, "mel": cfg.mel_weight, "si_sdr": cfg.sisdr_weight, "spec": cfg.spec_weight,
               "adversarial": cfg.adversarial_weight, "feature": cfg.feature_weight}
    balancer = None
    if cfg.balancer:
        balancer = Balancer(weights, decay=cfg.balancer_decay)
        companions["balancer"] = balancer

    def loss_fn(batch: torch.Tensor) -> tuple[torch.Tensor, dict]:
        recon, _, commit = model(batch)
        recon = recon.float()[..., :batch.shape[-1]]
        losses = {"l1": F.l1_loss(recon, batch), "mel": mel(recon, batch)}
        if spectral is not None:
            losses["spec"] = spectral(recon, batch)
        if cfg.sisdr_weight:
            losses["si_sdr"] = -si_sdr_per_item(recon, batch) / 10  # negative dB / 10
        if discriminator is not None:
            # one random window of every segment (the same for the original and the decoded audio)
            width = min(batch.shape[-1], int(cfg.disc_seconds * cfg.sample_rate))
            start = int(torch.randint(0, batch.shape[-1] - width + 1, (1,)))
            real, fake = batch[..., start:start + width], recon[..., start:start + width]
            discriminator.requires_grad_(True)  # one discriminator step on this batch's decoded audio
            d_loss = discriminator_loss(discriminator(real), discriminator(fake.detach()))
            disc_optimizer.zero_grad(set_to_none=True)
            d_loss.backward()
            disc_optimizer.step()
            discriminator.requires_grad_(False)  # the decoder's step does not train the discriminator
            losses["adversarial"], losses["feature"] = generator_losses(discriminator(real), discriminator(fake))
        weighted = sum(weights[k] * v for k, v in losses.items())
        logged = {k: float(v.detach()) for k, v in losses.items()}
        if "si_sdr" in logged:
            logged["si_sdr"] = -10 * logged["si_sdr"]  # dB, as evaluations report it
        if discriminator is not None:
            logged["disc"] = float(d_loss.detach())
        if balancer is None:
            return weighted + commit, logged
        surrogate, norms = balancer.surrogate({k: v for k, v in losses.items() if weights[k]}, recon)
        logged.update(norms)
        # the gradient is the balanced one; the value logged is the weighted sum of the losses
        return surrogate - surrogate.detach() + weighted.detach() + commit, logged

    def evaluate_fn(tag: str) -> dict:
        ev = evaluate(model, eval_set, run_dir / f"eval-{tag}")
        summaries[tag] = ev.to_dict()
        return {"si_sdr": ev.si_sdr, "mel": ev.mel, "usage_min": min(ev.usage),
                **{f"si_sdr_k{k}": v["si_sdr"] for k, v in ev.by_levels.items()}}

    out = run_training(model, cfg, run_dir, sampler, loss_fn, evaluate_fn, device=device, resume=resume,
                       progress=progress, stop_after=stop_after, desc=f"audio tokenizer ({cfg.levels} levels)",
                       companions=companions)
    final = summaries["final"]
    heldout_doc = {k: v for k, v in final.items() if k != "files"}
    info = publish_bundle(model, store, heldout_doc)
    result = AudioTrainResult(info, out.steps, out.elapsed, out.items_per_second * cfg.segment_seconds,
                              heldout_doc, str(run_dir), parameter_count(model))
    (run_dir / "summary.json").write_text(json.dumps({**asdict(result), "bundle": info.id, "files": final["files"]},
                                                     indent=2, default=str))
    return result


def encode_long(model: AudioTokenizer, blocks) -> np.ndarray:
    """Codes [frames, L] of a long recording given as an iterator of mono float32 blocks [T] at
    the model's sample rate (`datasets.audio.read_mono` reads files so). The encoder runs over
    windows of `encode_window_seconds` with `context_frames` of audio kept on each side, so the
    codes equal one pass over the whole recording whatever the block sizes, and memory stays
    bounded by a block plus a window."""
    hop, halo = model.cfg.hop, model.context_frames
    window = model.cfg.encode_window_frames or max(1, round(model.cfg.chunk_seconds * model.cfg.frame_rate))
    device = next(model.parameters()).device
    buf = np.zeros(0, dtype=np.float32)
    first = 0  # the frame index of buf[0]
    done = 0  # frames whose codes are out
    out: list[np.ndarray] = []

    def run(a: int, f0: int, f1: int | None) -> None:
        """Codes of frames [f0, f1) (f1 None: to the end) from buf's samples starting at frame a."""
        samples = buf[(a - first) * hop:] if f1 is None else buf[(a - first) * hop:(f1 + halo - first) * hop]
        codes = model.encode(torch.from_numpy(np.ascontiguousarray(samples))[None, None].to(device))[0]
        out.append(codes[f0 - a:None if f1 is None else f1 - a].cpu().numpy())

    for block in blocks:
        buf = np.concatenate([buf, np.asarray(block, dtype=np.float32)])
        while done + window + halo <= first + len(buf) // hop:
            run(max(0, done - halo), done, done + window)
            done += window
            drop = max(0, done - halo) - first
            buf, first = buf[drop * hop:], first + drop
    if len(buf) > (done - first) * hop:
        run(max(0, done - halo), done, None)  # the rest, its last partial frame zero-padded by the model
    if not out:
        return np.zeros((0, model.levels), dtype=np.int64)
    return np.concatenate(out)


__all__ = ["AudioEvalResult", "AudioTrainResult", "evaluate", "load_audio", "publish_bundle",
           "train_audio", "encode_long", "level_counts"]
