"""Sample audio: offline speech and sound: eSpeak NG (shipped by the `espeakng-loader` wheel) called through
ctypes, plus synthetic tones, chords and noise. No download. eSpeak NG varies each utterance
slightly (timing by a few milliseconds, seen from run to run even with its random seed fixed),
so speech is the same sentences and voices on every run, not the same bytes.

Speech comes from first sentences of standard-library docstrings spoken by several eSpeak
voices at varied rates and pitches, so there are audio-transcript pairs to ingest and speech
to train the audio tokenizer on; held-out clips use sentences and a voice never trained on.
"""

from __future__ import annotations

import ctypes
import json
import re
import threading
from pathlib import Path

import numpy as np

_LOCK = threading.Lock()  # eSpeak NG keeps global state: one synthesis at a time per process
_ENGINE: dict = {}

TRAIN_VOICES = ("en", "en-us", "en+f3", "en-us+m3", "en+f4", "en-gb-x-rp")
HELDOUT_VOICES = ("en-us+f2",)
_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)


def _engine() -> tuple[ctypes.CDLL, int]:
    if not _ENGINE:
        import espeakng_loader

        lib = ctypes.cdll.LoadLibrary(espeakng_loader.get_library_path())
        data_parent = str(Path(espeakng_loader.get_data_path()).parent)
        lib.espeak_Initialize.restype = ctypes.c_int
        rate = lib.espeak_Initialize(2, 0, data_parent.encode(), 0)  # AUDIO_OUTPUT_SYNCHRONOUS
        if rate <= 0:
            raise RuntimeError(f"eSpeak NG failed to initialize (data at {data_parent})")
        chunks: list[np.ndarray] = []

        def collect(wav, n, _events):
            if n > 0:
                chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
            return 0

        _ENGINE.update(lib=lib, rate=rate, chunks=chunks, callback=_CALLBACK(collect))  # keep the callback alive
        lib.espeak_SetSynthCallback(_ENGINE["callback"])
    return _ENGINE["lib"], _ENGINE["rate"]


def synthesize(text: str, voice: str = "en", words_per_minute: int = 165, pitch: int = 50) -> tuple[np.ndarray, int]:
    """Speak `text`: (int16 samples, sample rate) from eSpeak NG."""
    with _LOCK:
        lib, rate = _engine()
        if lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ValueError(f"eSpeak NG has no voice {voice!r}")
        lib.espeak_SetParameter(1, int(words_per_minute), 0)  # espeakRATE
        lib.espeak_SetParameter(3, int(pitch), 0)  # espeakPITCH
        chunks = _ENGINE["chunks"]
        chunks.clear()
        data = text.encode("utf-8") + b"\0"
        lib.espeak_Synth(data, len(data), 0, 1, 0, 1, None, None)  # POS_CHARACTER, espeakCHARS_UTF8
        lib.espeak_Synchronize()
        samples = np.concatenate(chunks) if chunks else np.zeros(0, np.int16)
    return samples.astype(np.int16), rate


def sentences(limit: int, skip: int = 0) -> list[str]:
    """Plain English first sentences of stdlib docstrings (30-140 characters, letters only)."""
    from tokenloom.samples.text import iter_stdlib_docstrings

    out, seen = [], set()
    for _, doc in iter_stdlib_docstrings():
        first = re.split(r"(?<=[.!?])\s", " ".join(doc.split()), maxsplit=1)[0]
        if not 30 <= len(first) <= 140 or not re.fullmatch(r"[A-Za-z ,.'()-]+", first) or first in seen:
            continue
        seen.add(first)
        out.append(first)
        if len(out) >= limit + skip:
            break
    return out[skip:]


def tone(freqs: tuple[float, ...], seconds: float, rate: int = 16_000, amplitude: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    wave = sum(np.sin(2 * np.pi * f * t) for f in freqs) / len(freqs)
    fade = np.minimum(1.0, np.minimum(t, seconds - t) / 0.02)  # no clicks at the ends
    return (amplitude * wave * fade).astype(np.float32)


def noise(seconds: float, rate: int = 16_000, seed: int = 0, color: str = "white") -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(int(seconds * rate))
    if color == "pink":  # 1/f spectrum by filtering in the frequency domain
        spectrum = np.fft.rfft(x)
        spectrum /= np.sqrt(np.maximum(np.arange(len(spectrum)), 1))
        x = np.fft.irfft(spectrum, len(x))
    return (0.2 * x / (np.abs(x).max() + 1e-9)).astype(np.float32)


def _to16k(samples: np.ndarray, rate: int) -> np.ndarray:
    import torch
    import torchaudio.functional as AF

    wav = torch.from_numpy(samples.astype(np.float32) / 32768.0)
    return AF.resample(wav, rate, 16_000).numpy()


def speech_clips(split: str = "train", count: int | None = None) -> list[tuple[np.ndarray, str]]:
    """(16 kHz float32 speech, transcript) pairs. train: 6 voices over 240 sentences;
    heldout: a voice and 16 sentences never used for training."""
    if split == "train":
        texts, voices = sentences(count or 240), TRAIN_VOICES
    elif split == "heldout":
        texts, voices = sentences(count or 16, skip=400), HELDOUT_VOICES
    else:
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    out = []
    for i, text in enumerate(texts):
        samples, rate = synthesize(text, voices[i % len(voices)], 140 + (i * 37) % 60, 35 + (i * 17) % 40)
        out.append((_to16k(samples, rate), text))
    return out


def sound_clips() -> list[np.ndarray]:
    """Non-speech variety at 16 kHz: tones, chords, sweeps-free intervals, white and pink noise."""
    return [
        tone((440.0,), 1.5), tone((261.6, 329.6, 392.0), 2.0), tone((220.0, 277.2, 329.6, 440.0), 2.0),
        tone((110.0, 165.0), 1.0, amplitude=0.5), noise(1.5, seed=1), noise(1.5, seed=2, color="pink"),
    ]


_SCALE = (0, 2, 4, 5, 7, 9, 11)  # major scale, semitones above the key


def _pluck(freq: float, samples: int, rng: np.random.Generator, rate: int) -> np.ndarray:
    """Karplus-Strong plucked string: a noise burst through a delay line with an averaging filter."""
    period = max(2, int(round(rate / freq)))
    line = rng.uniform(-1, 1, period)
    out = np.empty(samples)
    for start in range(0, samples, period):  # one delay-line pass per period, vectorized
        n = min(period, samples - start)
        out[start:start + n] = line[:n]
        line = 0.996 * 0.5 * (line + np.roll(line, -1))
    return out


def _organ(freq: float, samples: int, rate: int) -> np.ndarray:
    t = np.arange(samples) / rate
    partials = sum(np.sin(2 * np.pi * freq * h * t) / h**1.5 for h in (1, 2, 3, 4, 6))
    attack = np.minimum(1.0, t / 0.03)
    return partials * attack * np.exp(-1.5 * t)


def music_clips(split: str = "train", count: int | None = None, seconds: float = 4.0,
                rate: int = 16_000) -> list[np.ndarray]:
    """Synthetic music at 16 kHz: a melody on a plucked string or an organ-like timbre over
    chords, with a noise-burst snare on the beat, in a random key and tempo. train and heldout
    draw from disjoint seeds (heldout: melodies, keys and tempi never trained on)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    count = count or (24 if split == "train" else 6)
    base_seed = 1000 if split == "train" else 9000
    out = []
    for i in range(count):
        rng = np.random.default_rng(base_seed + i)
        total = int(seconds * rate)
        mix = np.zeros(total)
        key = 48 + int(rng.integers(0, 12))  # MIDI note of the key
        beat = int(rate * 60 / rng.uniform(80, 160))
        lead = "pluck" if (i % 2 == 0) else "organ"
        degree = int(rng.integers(0, 7))
        for start in range(0, total, beat):  # melody: a random walk on the scale, one note per beat
            degree = int(np.clip(degree + rng.integers(-2, 3), 0, 13))
            note = key + 12 + _SCALE[degree % 7] + 12 * (degree // 7)
            freq = 440.0 * 2 ** ((note - 69) / 12)
            n = min(beat * 2, total - start)
            tone_ = _pluck(freq, n, rng, rate) if lead == "pluck" else _organ(freq, n, rate)
            mix[start:start + n] += 0.35 * tone_
        for start in range(0, total, beat * 4):  # chords on the bar: root, third, fifth
            root = key + _SCALE[int(rng.integers(0, 7))]
            n = min(beat * 4, total - start)
            for step in (0, 4, 7):
                mix[start:start + n] += 0.12 * _organ(440.0 * 2 ** ((root + step - 69) / 12), n, rate)
        for start in range(beat, total, beat * 2):  # snare on beats 2 and 4
            n = min(int(0.12 * rate), total - start)
            mix[start:start + n] += 0.15 * rng.standard_normal(n) * np.exp(-np.arange(n) / (0.03 * rate))
        fade = np.minimum(1.0, np.minimum(np.arange(total), total - np.arange(total)) / (0.02 * rate))
        out.append((0.8 * mix * fade / (np.abs(mix).max() + 1e-9)).astype(np.float32))
    return out


def write_sample_audio(out_dir: Path, with_bad_inputs: bool = True, utterances: int = 24) -> Path:
    """Write audio-transcript pairs and other sounds under `out_dir` (idempotent); return it.

    `speech-NNN.{wav,flac,ogg}` with `speech-NNN.txt` transcripts; `sounds/` tones, chords and
    noise (no transcripts); `pairs.jsonl` records `{"audio": ..., "text": ...}` for three more
    utterances in `paired/`; with `with_bad_inputs`, `odd/` files to normalize (stereo 44.1 kHz,
    8 kHz, 48 kHz, 4 channels, clipped, float beyond +-1) and `bad/` files to quarantine.
    """
    import soundfile as sf

    out_dir = Path(out_dir)
    done = out_dir / ".complete.json"
    settings = {"with_bad_inputs": with_bad_inputs, "utterances": utterances, "layout": 1}
    if done.exists() and json.loads(done.read_text()) == settings:
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    formats = ((".wav", "PCM_16"), (".flac", "PCM_16"), (".ogg", "VORBIS"))
    clips = speech_clips("train", utterances + 3)
    for i, (wav, text) in enumerate(clips[:utterances]):
        suffix, subtype = formats[i % len(formats)]
        sf.write(out_dir / f"speech-{i:03d}{suffix}", wav, 16_000, subtype=subtype)
        (out_dir / f"speech-{i:03d}.txt").write_text(text + "\n")
    (out_dir / "paired").mkdir(exist_ok=True)
    pairs = []
    for j, (wav, text) in enumerate(clips[utterances:]):
        sf.write(out_dir / "paired" / f"utterance-{j}.wav", wav, 16_000, subtype="PCM_16")
        pairs.append(json.dumps({"audio": f"paired/utterance-{j}.wav", "text": text}))
    (out_dir / "pairs.jsonl").write_text("\n".join(pairs) + "\n")
    (out_dir / "sounds").mkdir(exist_ok=True)
    for k, wav in enumerate(sound_clips()):
        sf.write(out_dir / "sounds" / f"sound-{k}.wav", wav, 16_000, subtype="PCM_16")
    if with_bad_inputs:
        write_odd_audio(out_dir / "odd")
        write_bad_audio(out_dir / "bad")
    done.write_text(json.dumps(settings))
    return out_dir


def write_odd_audio(odd_dir: Path) -> dict[str, str]:
    """Valid but unusual files every job must normalize; returns name -> what is odd."""
    import soundfile as sf

    odd_dir.mkdir(parents=True, exist_ok=True)
    t = tone((330.0, 440.0), 1.0)
    stereo44 = np.stack([tone((300.0,), 1.0, 44_100), tone((500.0,), 1.0, 44_100)], axis=1)
    sf.write(odd_dir / "stereo-44k.wav", stereo44, 44_100, subtype="PCM_16")
    sf.write(odd_dir / "narrowband-8k.wav", tone((300.0,), 1.0, 8_000), 8_000, subtype="PCM_16")
    sf.write(odd_dir / "studio-48k.flac", tone((440.0,), 1.0, 48_000), 48_000, subtype="PCM_24")
    sf.write(odd_dir / "four-channels.wav", np.stack([t] * 4, axis=1), 16_000, subtype="PCM_16")
    sf.write(odd_dir / "clipped.wav", np.clip(t * 6, -1, 1), 16_000, subtype="PCM_16")
    sf.write(odd_dir / "float-over-range.wav", t * 3, 16_000, subtype="FLOAT")
    return {"stereo-44k.wav": "stereo, 44.1 kHz", "narrowband-8k.wav": "8 kHz", "studio-48k.flac": "48 kHz, 24-bit",
            "four-channels.wav": "4 channels", "clipped.wav": "clipped", "float-over-range.wav": "float beyond +-1"}


def write_bad_audio(bad_dir: Path) -> dict[str, str]:
    """Files every job must quarantine; returns name -> start of the reason."""
    import io

    import soundfile as sf

    bad_dir.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    sf.write(buffer, tone((440.0,), 1.0), 16_000, format="WAV", subtype="PCM_16")
    wav = buffer.getvalue()
    (bad_dir / "truncated-header.wav").write_bytes(wav[:30])
    (bad_dir / "not-audio.wav").write_text("this is a text file with an audio extension\n")
    (bad_dir / "empty.flac").write_bytes(b"")
    sf.write(bad_dir / "zero-length.wav", np.zeros(0, np.float32), 16_000, subtype="PCM_16")
    nan = tone((440.0,), 0.5)
    nan[1000:1010] = np.nan
    sf.write(bad_dir / "nan-samples.wav", nan, 16_000, subtype="FLOAT")
    inf = tone((440.0,), 0.5)
    inf[2000] = np.inf
    sf.write(bad_dir / "inf-samples.wav", inf, 16_000, subtype="FLOAT")
    return {"truncated-header.wav": "unreadable audio", "not-audio.wav": "unreadable audio",
            "empty.flac": "empty file", "zero-length.wav": "zero-length audio",
            "nan-samples.wav": "non-finite samples (NaN or infinity): first at 0.062",
            "inf-samples.wav": "non-finite samples (NaN or infinity): first at 0.125"}
