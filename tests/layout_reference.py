"""The stream's layout and packing rules as plain loops, the code `datasets/layout.py` and
`datasets/packing.py` replaced with segment tables, compiled loops (`datasets/compiled.py`) and
bisection.

Kept as oracles: the whole-array layout of many samples must give, for every sample, what
`reference_positions` gives for that sample alone (tests/test_layout.py); `PackWindow` must take
the rows `reference_choose_row` chooses, and `gather` build what `reference_assemble` builds
(tests/test_packing.py). Pieces here are (Positions, slice)."""

from __future__ import annotations

import numpy as np

from tokenloom.contract import ATTENTION_IDS, DEFAULT_ATTENTION, IGNORE_INDEX, MODALITY_IDS, PAD_MODALITY
from tokenloom.datasets.compiled import PAD_ID
from tokenloom.datasets.layout import ROW_ID


def reference_positions(tokens: np.ndarray, segments: list[dict] | None, group_size: int, audio_window: int) -> dict:
    """A sample's flat tokens and segments -> positions and their targets (see the module docstring)."""
    if not segments:
        segments = [{"modality": "text", "start": 0, "length": len(tokens), "grid": [], "attention": None}]
    ids, modality, coords, segment, attention, window = [], [], [], [], [], []
    image_targets: list[tuple[int, np.ndarray, int]] = []  # (first position, codes in raster order, width)
    media: list[tuple[int, int]] = []
    p, ends_row, seg_no, n_pos = 0, False, 0, 0
    for k, seg in enumerate(segments):
        kind_name = seg.get("attention") or DEFAULT_ATTENTION[seg["modality"]]
        start, length = int(seg["start"]), int(seg["length"])
        toks = tokens[start : start + length].astype(np.int64)
        mod = seg["modality"]
        seg_col = None
        if mod == "audio":
            frames, levels = (int(x) for x in seg["grid"])
            if frames * levels != length:
                raise ValueError(f"audio segment grid {seg['grid']} does not match its length {length}")
            if levels > group_size:
                raise ValueError(f"audio frames of {levels} levels do not fit groups of {group_size}; "
                                 "set stream.group_size from the vocabulary manifest")
            group = np.full((frames, group_size), -1, dtype=np.int64)
            group[:, :levels] = toks.reshape(frames, levels)
            t = p + np.arange(frames)
            xyz = np.stack([t, t, t], axis=1)
            n = frames
            p += frames
        elif mod == "image":
            # a learned start row (w <row> positions), then the h rows; each row is its own
            # segment, so attention is bidirectional within a row and causal across rows
            h, w = (int(x) for x in seg["grid"])
            if h * w != length:
                raise ValueError(f"image segment grid {seg['grid']} does not match its length {length}")
            n = (h + 1) * w
            group = np.full((n, group_size), -1, dtype=np.int64)
            group[:w, 0] = ROW_ID
            group[w:, 0] = toks
            r, c = np.divmod(np.arange(n), w)  # r = 0 is the start row, r = i + 1 the image's row i
            xyz = np.stack([np.full(n, p), p + r, p + c], axis=1)
            seg_col = seg_no + r
            image_targets.append((n_pos, toks, w))
            p += max(h + 1, w)
        else:
            group = np.full((length, group_size), -1, dtype=np.int64)
            group[:, 0] = toks
            t = p + np.arange(length)
            xyz = np.stack([t, t, t], axis=1)
            n = length
            p += length
        win = audio_window if kind_name == "window" else 0
        if win and n > win and k < len(segments) - 1:
            ends_row = True
        ids.append(group)
        modality.append(np.full(n, MODALITY_IDS[mod]))
        coords.append(xyz)
        segment.append(np.full(n, seg_no) if seg_col is None else seg_col)
        seg_no = int(segment[-1][-1]) + 1
        attention.append(np.full(n, ATTENTION_IDS[kind_name]))
        window.append(np.full(n, win))
        if mod in ("image", "audio"):
            media.append((n_pos, n_pos + n))
        n_pos += n
    ids_all, mod_all = np.concatenate(ids), np.concatenate(modality)
    labels, target = _targets(ids_all, mod_all, image_targets)
    return {"ids": ids_all, "modality": mod_all, "coords": np.concatenate(coords).astype(np.int64),
            "segment": np.concatenate(segment), "attention": np.concatenate(attention), "window": np.concatenate(window),
            "ends_row": ends_row, "labels": labels, "target": target, "media": media}


def _targets(ids: np.ndarray, modality: np.ndarray, images: list[tuple[int, np.ndarray, int]]
             ) -> tuple[np.ndarray, np.ndarray]:
    """Each position's target group and its modality.

    Text and audio: the next position's group (audio: a frame's L codes). No position predicts an
    image's start row (it is given). In an image, the w positions of the start row predict row 0
    and those of row r predict row r + 1, column by column; the last row predicts nothing except
    at its last position, which predicts what follows the image (its `<eoi>`). So no target is
    visible to the position that predicts it: rows see only themselves and the rows above."""
    P, G = ids.shape
    labels = np.full((P, G), IGNORE_INDEX, dtype=np.int64)
    target = np.full(P, -1, dtype=np.int64)
    labels[:-1] = ids[1:]
    target[:-1] = modality[1:]
    given = np.r_[ids[1:, 0] == ROW_ID, False]  # predicting a start row position
    labels[given], target[given] = IGNORE_INDEX, -1
    for first, codes, w in images:
        n = len(codes)
        labels[first : first + n] = IGNORE_INDEX
        labels[first : first + n, 0] = codes
        target[first : first + n] = MODALITY_IDS["image"]
        last_row = slice(first + n, first + n + w - 1)  # all of the last row but its last position
        labels[last_row], target[last_row] = IGNORE_INDEX, -1
    labels[labels < 0] = IGNORE_INDEX
    return labels, target


def reference_choose_row(lengths, closes, seq_len: int) -> list[int]:
    """Which pending pieces (indices, in stream order) make the next row, in row order.

    The oldest piece first, then best fit: the largest piece that still fits, the earliest among
    equals; at most one closing piece, placed last. A pure function of its arguments."""
    if not lengths:
        raise ValueError("no pending pieces to pack")
    lens = np.asarray(lengths, dtype=np.int64)
    closing = np.asarray(closes, dtype=bool)
    free = np.ones(len(lens), dtype=bool)
    chosen, last = [0], None
    free[0] = False
    room = seq_len - int(lens[0])
    if closing[0]:
        chosen, last = [], 0
    while room > 0:
        fits = free & (lens <= room) & (~closing if last is not None else True)
        if not fits.any():
            break
        k = int(np.argmax(np.where(fits, lens, -1)))  # argmax: the first of the largest
        free[k] = False
        room -= int(lens[k])
        if closing[k]:
            last = k
        else:
            chosen.append(k)
    return chosen + ([last] if last is not None else [])


def reference_assemble(pieces, seq_len: int, group_size: int) -> dict[str, np.ndarray]:
    """Pieces, in row order, as one row of `seq_len` positions, each piece its own document,
    padded after the last one (see the module docstring). Raises if they do not fit."""
    L, G = seq_len, group_size
    used = sum(sl.stop - sl.start for _, sl in pieces)
    if used > L:
        raise ValueError(f"{used} positions do not fit a row of {L}")
    ids = np.concatenate([s.ids[sl] for s, sl in pieces])
    docs = np.concatenate([np.full(sl.stop - sl.start, d) for d, (_, sl) in enumerate(pieces)])
    cat = {key: np.concatenate([getattr(s, key)[sl] for s, sl in pieces])
           for key in ("modality", "coords", "segment", "attention", "window")}
    labels = np.concatenate([s.labels[sl] for s, sl in pieces])
    target_modality = np.concatenate([s.target[sl] for s, sl in pieces])
    # a segment id unique within the row: (document, segment index) runs
    key = docs * 100_000 + cat["segment"]
    segment_ids = np.cumsum(np.r_[0, key[1:] != key[:-1]])
    row = {
        "ids": ids, "labels": labels, "modality": cat["modality"], "coords": cat["coords"], "doc_ids": docs,
        "segment_ids": segment_ids, "attention": cat["attention"], "window": cat["window"],
        "target_modality": target_modality,
    }
    if used < L:  # padding: a causal segment of the last document, no targets
        pad = L - used
        last_t = row["coords"][-1, 0]
        filler = np.full((pad, G), -1, dtype=np.int64)
        filler[:, 0] = PAD_ID
        row["ids"] = np.concatenate([row["ids"], filler])
        row["labels"] = np.concatenate([row["labels"], np.full((pad, G), IGNORE_INDEX, dtype=np.int64)])
        row["target_modality"] = np.r_[row["target_modality"], np.full(pad, -1)]
        row["modality"] = np.r_[row["modality"], np.full(pad, PAD_MODALITY)]
        row["coords"] = np.concatenate([row["coords"], np.repeat(last_t + 1 + np.arange(pad)[:, None], 3, 1)])
        row["doc_ids"] = np.r_[row["doc_ids"], np.full(pad, row["doc_ids"][-1])]
        row["segment_ids"] = np.r_[row["segment_ids"], np.full(pad, row["segment_ids"][-1] + 1)]
        row["attention"] = np.r_[row["attention"], np.full(pad, ATTENTION_IDS["causal"])]
        row["window"] = np.r_[row["window"], np.zeros(pad, dtype=np.int64)]
    return {k: np.asarray(v, dtype=np.int64) for k, v in row.items()}
