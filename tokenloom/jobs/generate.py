"""Generation job: a prompt (text, an image file, an audio file) -> the model's own tokenizers ->
KV-cache decoding (`model.generate`) -> text, a PNG, a WAV or an MP4 (a video: frames at
`ingest.video.fps` within its frame pixel budget, with their sound when the model has audio).

The model folder names its token space: `model.json` holds the vocabulary manifest it was
trained on (written by the training job; older folders are found through their run's
`source.json`), and the manifest names the tokenizer bundles. Prompts are laid out exactly as
ingestion lays out a sample (`tokenizers.sequence`) and read into positions exactly as the
stream reads them (`datasets.stream.sample_positions`), without the closing `<eos>`: media
parts first, then the prompt text, then what is generated. So the model decodes in the layout
it was trained on: captioning and transcription continue `<bos> media ...`, text -> image and
text -> speech continue `<bos> text ...` (the `ingest.text_first` share of the training data).

Bad requests (no such bundle, an image smaller than one tokenizer cell, a grid the tokenizer
cannot have made, a prompt plus request longer than the context) raise ValueError or
FileNotFoundError with one line; the command line turns them into exit status 2.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenloom.jobs.home import Home, model_folder
from tokenloom.tokenizers.sequence import AudioPart, ImagePart, SampleLayout, TextPart, VideoPart
from tokenloom.tokenizers.vocab import VocabManifest

TARGETS = ("text", "image", "audio", "video")
SUFFIX = {"text": ".txt", "image": ".png", "audio": ".wav", "video": ".mp4"}


def model_manifest(home: Home, folder: Path, doc: dict) -> VocabManifest:
    """The vocabulary manifest a model folder was trained on."""
    if doc.get("vocab"):
        return VocabManifest.from_dict(doc["vocab"])
    if doc.get("source", {}).get("vocab_id"):  # exported from a run that predates `vocab` in model.json
        return home.manifest(doc["source"]["vocab_id"])
    source = folder.parent / "source.json"
    if source.is_file():
        return home.manifest(json.loads(source.read_text())["vocab_id"])
    raise ValueError(f"model {folder} names no vocabulary manifest (model.json has no `vocab` and no source.json "
                     "lies beside it); generate needs the token space the model was trained on")


@dataclass
class Generator:
    """A loaded model with its token space and (lazily) its tokenizers."""

    home: Home
    folder: Path
    model: object
    vocab: VocabManifest
    audio_window: int

    @staticmethod
    def load(home: Home, source: Path) -> Generator:
        from tokenloom.model.io import load_model

        folder = model_folder(source)
        model, doc = load_model(folder)
        vocab = model_manifest(home, folder, doc)
        if vocab.size > model.cfg.vocab_size:
            raise ValueError(f"model {folder} has {model.cfg.vocab_size} embeddings, its manifest {vocab.size} ids")
        window = int(doc.get("stream", {}).get("audio_window", 64))
        return Generator(home, folder, model, vocab, window)

    def __post_init__(self):
        self.layout = SampleLayout(self.vocab)
        self._tokenizers: dict[str, object] = {}

    @property
    def space(self):
        from tokenloom.model.generate import TokenSpace

        v = self.vocab
        return TokenSpace((v.text.start, v.text.stop), (v.visual.start, v.visual.stop),
                          tuple((r.start, r.stop) for r in v.audio), dict(v.specials))

    def tokenizer(self, kind: str):
        """The model's text, visual or audio tokenizer, from the bundle its manifest names."""
        if kind not in self._tokenizers:
            bundle_id = self.vocab.bundles.get(kind)
            if not bundle_id:
                raise ValueError(f"the model's vocabulary names no {kind} tokenizer bundle")
            path = self.home.bundle(bundle_id, kind).path
            if kind == "text":
                from tokenloom.tokenizers.text import TextTokenizer

                self._tokenizers[kind] = TextTokenizer.load(path)
            elif kind == "visual":
                from tokenloom.tokenizers.visual import load_visual

                self._tokenizers[kind] = load_visual(path).eval()
            else:
                from tokenloom.tokenizers.audio import load_audio

                self._tokenizers[kind] = load_audio(path).eval()
        return self._tokenizers[kind]

    # -- prompts ------------------------------------------------------------------------------
    def encode_image(self, path: Path) -> np.ndarray:
        import torch

        from tokenloom.datasets.images import decode_image
        from tokenloom.tokenizers.visual import prepare

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no image file {path}")
        visual = self.tokenizer("visual")
        cell = visual.cfg.factor
        decoded, reason = decode_image(path.read_bytes(), min_side=cell, max_decoded_pixels=4 * visual.cfg.max_pixels)
        if decoded is None:
            raise ValueError(f"{path}: {reason} (the visual tokenizer's cell is {cell}x{cell} pixels)")
        with torch.no_grad():
            return visual.encode(prepare(decoded.pixels, visual.cfg)[None])[0].numpy()

    def encode_audio(self, path: Path) -> np.ndarray:
        from tokenloom.datasets.audio import AudioProblem, read_mono
        from tokenloom.tokenizers.audio import encode_long

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no audio file {path}")
        audio = self.tokenizer("audio")
        try:
            return encode_long(audio, read_mono(path, audio.cfg.chunk_seconds, audio.cfg.sample_rate))
        except AudioProblem as exc:
            raise ValueError(f"{path}: {exc}") from None

    def prompt_parts(self, text: str | None = None, image: Path | None = None, audio: Path | None = None,
                     services=None) -> list:
        """Media first (as a captioned or transcribed sample), then the prompt text; tokenized by the
        model's own bundles here, or by the long-lived services (`services`: a
        `platform.services.ServiceClient`), which must hold the same bundles."""
        if services is not None:
            return self._service_parts(services, text, image, audio)
        parts: list = []
        if image is not None:
            parts.append(ImagePart(self.encode_image(image)))
        if audio is not None:
            parts.append(AudioPart(self.encode_audio(audio)))
        if text:
            parts.append(TextPart(np.asarray(self.tokenizer("text").encode(text), dtype=np.int64)))
        return parts

    def _service_parts(self, services, text: str | None, image: Path | None, audio: Path | None) -> list:
        requests = [(m, kind, path) for m, kind, path in (("image", "visual", image), ("audio", "audio", audio))
                    if path is not None]
        for modality, kind, path in requests + ([("text", "text", None)] if text else []):
            if services.vocab.bundles.get(kind) != self.vocab.bundles.get(kind):
                raise ValueError(f"the tokenizer services tokenize {kind} with bundle "
                                 f"{services.vocab.bundles.get(kind)}, the model was trained on "
                                 f"{self.vocab.bundles.get(kind)}: run `tokenloom pools up --dataset` with the "
                                 "model's dataset, or generate without --pools service")
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(f"no {modality} file {path}")
        want = {"image": ImagePart, "audio": AudioPart}
        parts: list = []
        for modality, _, path in requests:
            got = [p for p in services.parts(modality, Path(path).read_bytes(), {"source": str(path)})
                   if isinstance(p, want[modality])]
            if len(got) != 1:
                raise ValueError(f"the {modality} service made {len(got)} {modality} parts of {path}, not one")
            parts += got
        if text:
            parts += [p for p in services.parts("text", json.dumps({"text": text}).encode()) if isinstance(p, TextPart)]
        return parts

    def prompt_chunk(self, parts: list, batch: int = 1):
        """Parts -> the prompt's positions (the sample's layout without its closing <eos>)."""
        from tokenloom.datasets.stream import sample_positions
        from tokenloom.model.generate import Chunk

        tokens, segments = self.layout.assemble(parts)
        tokens, segments = tokens[:-1], [*segments[:-1], {**segments[-1], "length": segments[-1]["length"] - 1}]
        if segments[-1]["length"] == 0:
            segments = segments[:-1]
        pos = sample_positions(tokens, segments, max(1, len(self.vocab.audio)), self.audio_window)
        return Chunk.from_columns(pos.ids, pos.modality, pos.coords, pos.segment, pos.attention, pos.window, batch)

    # -- requests ------------------------------------------------------------------------------
    def image_grid(self, grid: tuple[int, int] | None) -> tuple[int, int]:
        """The requested grid, or the tokenizer's training crop; refused when the tokenizer cannot make it."""
        cfg = self.tokenizer("visual").cfg
        if grid is None:
            side = cfg.image_size // cfg.factor
            return side, side
        h, w = grid
        if h < 1 or w < 1 or h * w * cfg.factor ** 2 > cfg.max_pixels:
            raise ValueError(f"grid {h}x{w} is not one the visual tokenizer makes: it needs 1 <= rows, cols and "
                             f"rows*cols <= {cfg.max_pixels // cfg.factor ** 2} ({cfg.factor}-pixel cells within "
                             f"{cfg.max_pixels} pixels)")
        return h, w

    def video_request(self, grid: tuple[int, int] | None, seconds: float, video=None) -> dict:
        """A video's frame grid (default: a 4:3 frame within the frame pixel budget, as ingestion
        tokenizes frames), frames and frame rate, and audio frames per frame (the audio tokenizer's
        frame rate over the frame interval; none when the model has no audio), from `video`
        (`ingest.video`, a `VideoConfig`; its defaults when None)."""
        from tokenloom.datasets.video import VideoConfig
        from tokenloom.tokenizers.visual import fit_to_budget

        if seconds <= 0:
            raise ValueError(f"--seconds must be positive, got {seconds}")
        video, cfg = video or VideoConfig(), self.tokenizer("visual").cfg
        if grid is None:
            h, w = fit_to_budget(240, 320, video.max_frame_pixels, cfg.factor)
            grid = (h // cfg.factor, w // cfg.factor)
        rows, cols = self.image_grid(grid)
        sound = 0
        if self.vocab.audio and self.vocab.bundles.get("audio"):
            sound = max(1, round(self.tokenizer("audio").cfg.frame_rate / video.fps))
        return {"grid": (rows, cols), "frames": max(1, round(seconds * video.fps)), "fps": float(video.fps),
                "audio_per_frame": sound}

    def frames_for(self, seconds: float) -> int:
        if seconds <= 0:
            raise ValueError(f"--seconds must be positive, got {seconds}")
        return max(1, round(seconds * self.tokenizer("audio").cfg.frame_rate))

    def decode(self, to: str, part: dict, out: Path | None):
        """Generated local codes -> text (returned), a PNG or a WAV (written to `out`)."""
        import torch

        if to == "text":
            text = self.tokenizer("text").decode(part["text"])
            if out is not None:
                out.write_text(text + "\n")
            return text
        if to == "video":
            from tokenloom.jobs.tokenizer import _write_video
            from tokenloom.tokenizers.visual import to_pixels

            visual = self.tokenizer("visual")

            def draw(part: ImagePart, target):
                with torch.no_grad():
                    return to_pixels(visual.decode(torch.from_numpy(part.codes)[None])[0])

            decoders = {"visual": draw}
            if part["video"].audio:
                audio = self.tokenizer("audio")

                def sound(part: AudioPart, target):
                    with torch.no_grad():
                        return audio.decode(torch.from_numpy(part.codes)[None])[0, 0].clamp(-1, 1).numpy()

                sound.sample_rate = audio.cfg.sample_rate
                decoders["audio"] = sound
            _write_video(part["video"], out, decoders)
            return str(out)
        if to == "image":
            from PIL import Image

            from tokenloom.tokenizers.visual import to_pixels

            with torch.no_grad():
                pixels = to_pixels(self.tokenizer("visual").decode(torch.from_numpy(part["image"])[None])[0])
            Image.fromarray(pixels).save(out, format="PNG")
            return str(out)
        import soundfile as sf

        audio = self.tokenizer("audio")
        codes = part["audio"]
        if len(codes) == 0:
            wav = np.zeros(0, dtype=np.float32)
        else:
            with torch.no_grad():
                wav = audio.decode(torch.from_numpy(codes)[None])[0, 0].clamp(-1, 1).numpy()
        sf.write(out, wav, audio.cfg.sample_rate, subtype="PCM_16")
        return str(out)


def generate(home: Home, source: Path, to: str, prompt: str | None = None, image: Path | None = None,
             audio: Path | None = None, grid: tuple[int, int] | None = None, seconds: float = 2.0,
             max_new_tokens: int = 64, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
             out: Path | None = None, generator: Generator | None = None, pools: str = "local", video=None) -> dict:
    """One generation: returns what was made (text, or the file written) with its log-probabilities.
    `pools`: "local" tokenizes the prompt with the model's bundles in this process, "service" through
    the long-lived tokenizer services (`tokenloom pools up`); `video`: `ingest.video` (a `VideoConfig`)
    for `to="video"`."""
    from tokenloom.model.generate import Cursor, Request, SamplingConfig
    from tokenloom.model.generate import generate as decode

    if to not in TARGETS:
        raise ValueError(f"--to must be one of {TARGETS}, got {to!r}")
    gen = generator or Generator.load(home, source)
    sampling = SamplingConfig(temperature, top_k, top_p, seed)
    sampling.validate()
    request = Request(to, max_new_tokens=max_new_tokens, audio_window=gen.audio_window)
    if to == "image":
        request.grid = gen.image_grid(grid)
    if to == "audio":
        request.max_frames = gen.frames_for(seconds)
    if to == "video":
        for key, value in gen.video_request(grid, seconds, video).items():
            setattr(request, key, value)
    if to != "text":
        gen.tokenizer("audio" if to == "audio" else "visual")  # an unknown bundle fails before decoding
    if pools not in ("local", "service"):
        raise ValueError(f"--pools must be local or service, got {pools!r}")
    services = None
    if pools == "service":
        from tokenloom.jobs.pools import load_state
        from tokenloom.platform.services import ServiceClient

        state = load_state(home)
        services = ServiceClient(state["http"], next(iter(state["defaults"].values()))["vocab"])
    chunk = gen.prompt_chunk(gen.prompt_parts(prompt, image, audio, services))
    started = time.perf_counter()
    made = decode(gen.model, gen.space, chunk, Cursor.after(chunk), request, sampling)
    seconds_taken = time.perf_counter() - started
    if out is None and to != "text":
        out = home.new_dir("generate", folder="generations") / f"output{SUFFIX[to]}"
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
    if to == "video":
        made.parts[0]["video"] = VideoPart(**made.parts[0]["video"])
    result = gen.decode(to, made.parts[0], out)
    sampled = [x for x in made.logprobs[0] if not np.isnan(x)]
    doc = {"model": str(gen.folder), "to": to, "pools": pools, "prompt_positions": len(chunk), "positions": made.positions,
           "sampled": len(sampled), "logprob_mean": float(np.mean(sampled)) if sampled else None,
           "seconds": round(seconds_taken, 3), "positions_per_second": made.positions / max(seconds_taken, 1e-9),
           "ids": made.ids[0], "logprobs": [None if np.isnan(x) else x for x in made.logprobs[0]]}
    if to == "text":
        doc["text"] = result
        if out is not None:
            doc["out"] = str(out)
    else:
        doc["out"] = result
        if to == "image":
            doc["grid"] = list(made.parts[0]["image"].shape)
        elif to == "audio":
            doc["frames"] = len(made.parts[0]["audio"])
        else:
            video = made.parts[0]["video"]
            doc.update(grid=list(video.frames.shape[1:]), frames=len(video.frames), times=video.times.tolist(),
                       audio_frames=video.audio_frames)
    return doc
