"""Fitting the model and stream configs to a dataset's vocabulary manifest.

The token space is the data's, not the recipe's: the embedding covers the manifest's ids, the
audio heads its RVQ level ranges, and each stream position holds as many ids as there are
levels. The trainer receives sizes and ranges (it does not read manifests, which belong to
`tokenizers/`), and refuses a model that cannot hold the data.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenloom.datasets import StreamConfig
from tokenloom.model import ModelConfig


def fit_to_vocabulary(model: ModelConfig, stream: StreamConfig, vocab_size: int,
                      audio_ranges: Sequence[tuple[int, int]]) -> None:
    """Set the model's vocabulary and audio ranges and the stream's group size from a manifest."""
    if model.vocab_size and model.vocab_size < vocab_size:
        raise ValueError(f"model.vocab_size {model.vocab_size} is smaller than the manifest's {vocab_size}")
    model.vocab_size = model.vocab_size or vocab_size
    model.audio_ranges = tuple((int(a), int(b)) for a, b in audio_ranges)
    fit_stream(stream, len(audio_ranges))
    model.max_seq_len = max(model.max_seq_len, stream.seq_len)


def fit_stream(stream: StreamConfig, audio_levels: int) -> None:
    """Groups wide enough for an audio frame's levels (1 without audio)."""
    stream.group_size = stream.group_size or max(1, audio_levels)
    if stream.group_size < audio_levels:
        raise ValueError(f"stream.group_size {stream.group_size} cannot hold the manifest's {audio_levels} audio levels")


def check_model_fits(model: ModelConfig, vocab_size: int, audio_ranges: Sequence[tuple[int, int]], what: str) -> None:
    """A trained model can read a dataset only if its token space is that dataset's."""
    if vocab_size > model.vocab_size or tuple(tuple(r) for r in audio_ranges) != tuple(model.audio_ranges):
        raise ValueError(f"the model's token space does not match {what}")
