"""The names every package shares, defined once: modalities, attention kinds, special tokens,
the ignored-label value and the keys of a packed stream row.

Why one module: these facts are a contract between the tokenizers that write shards, the
catalog that validates them, the stream that packs them, the kernels that mask them and the
model that reads them. Written in five places they drift; here they cannot. This module
imports nothing, so any package may import it.

Order matters where a tuple is indexed: a modality's position in `MODALITIES` is its id in
stream rows (`MODALITY_IDS`), and the padding of a packed row takes the next id
(`PAD_MODALITY`), so per-modality statistics have `MODALITY_SLOTS` rows.
"""

from __future__ import annotations

# -- modalities ---------------------------------------------------------------------------
MODALITIES = ("text", "image", "audio")
MODALITY_IDS: dict[str, int] = {name: i for i, name in enumerate(MODALITIES)}
PAD_MODALITY = len(MODALITIES)  # the modality id of a packed row's padding positions
MODALITY_SLOTS = len(MODALITIES) + 1  # per-modality statistics, padding last

# -- attention kinds ----------------------------------------------------------------------
# causal: sees every key before it (text); bidirectional: sees its whole segment and what
# precedes it (an image row: the stream makes each row of an image, and its learned start row,
# a segment of its own, so an image is block-causal over its rows); window: sees what precedes its segment and the last `window`
# positions of its own segment (audio frames).
ATTENTION_KINDS: tuple[str, ...] = ("causal", "bidirectional", "window")
ATTENTION_IDS: dict[str, int] = {name: i for i, name in enumerate(ATTENTION_KINDS)}
DEFAULT_ATTENTION: dict[str, str] = {"text": "causal", "image": "bidirectional", "audio": "window"}

# -- special tokens -----------------------------------------------------------------------
# The first ids of every vocabulary manifest, in this order; `SPECIAL_BLOCK` slots are
# reserved so that a new special never shifts the modality ranges after them.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<pad>",
    "<bos>",
    "<eos>",
    "<boi>",  # begin of image
    "<eoi>",  # end of image
    "<boa>",  # begin of audio
    "<eoa>",  # end of audio
    "<row>",  # the input id of an image's learned start row (datasets/stream.py)
    "<bov>",  # begin of video
    "<eov>",  # end of video
)
SPECIAL_BLOCK = 16
# the specials that open and close a media part of a sample
MEDIA_DELIMITERS: dict[str, tuple[str, str]] = {"image": ("<boi>", "<eoi>"), "audio": ("<boa>", "<eoa>")}
# A video is not a modality of its own: its frames are image segments and its sound track audio
# segments, laid out between these delimiters, each segment carrying its time (in milliseconds from
# the video's start) as a third grid entry: [h, w, ms] for a frame, [frames, levels, ms] for audio.
VIDEO_DELIMITERS: tuple[str, str] = ("<bov>", "<eov>")
VIDEO = "video"  # the name a video sample's modality mix (the partition key) carries besides its segments'
# The step of M-RoPE's t axis for timed (video) segments: a segment at `ms` starts at t = ms // TIME_TICK_MS
# from the video's first position, so frames and their sound share one clock (one tick = one 50 Hz audio frame).
TIME_TICK_MS = 20

# -- training rows ------------------------------------------------------------------------
IGNORE_INDEX = -100  # a label that no loss counts
# The arrays of one packed row (see datasets/stream.py): ids and labels [P, G], the others [P]
# except coords [P, 3].
ROW_KEYS: tuple[str, ...] = ("ids", "labels", "modality", "target_modality", "coords", "doc_ids", "segment_ids",
                             "attention", "window")
# Their dtype as the packer writes them (half the bytes of int64: writing rows is the packer's largest
# cost); the model takes them as they are (`UnifiedModel.loss` widens the targets it needs as int64).
ROW_DTYPE = "int32"
