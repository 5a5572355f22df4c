"""Generation from the unified model: KV-cache decoding of text, images and audio (single device).

Why decoding is built this way. The cache holds every layer's keys and values; each step feeds
only the new positions and attends to the cache under *the same visibility rules as training*:
the FlashMask intervals of the whole sequence so far are computed from its per-position columns
(`kernels.mask_from_columns`, the function the trainer uses) and the new queries' rows of that
mask are applied in attention. So a decoded position sees exactly what it saw in training, and
decoding equals a full forward over the same positions (tests/test_generate.py, within 1e-5).

Steps follow the modality (ARCHITECTURE.md, "Groups" and "No target is visible..."):

    text   one token per step: the shared head over the allowed ids (text, stop tokens).
    image  `<boi>`, then a learned start row (w `<row>` positions), then one row group per step:
           the w positions of row r, bidirectional among themselves, score the w codes of row
           r + 1 (the start row scores row 0); `<eoi>` after h rows (the grid is the request's).
    audio  one frame per step: level 0 from the shared head (audio level-0 codes or `<eoa>`),
           levels 1..L-1 in order from the level heads, each conditioned on the codes sampled
           below it, as in training; until `<eoa>` or the frame budget, then `<eoa>`.
    video  `<bov>`, then K frames at `fps` (frame k at round(1000 k / fps) ms), each an image without delimiters (start
           row, then row groups) at its tick on the video's clock, followed by the `audio_per_frame`
           audio frames of its interval (one frame per step, as audio, a new windowed segment per
           interval; none without sound); `<eov>` after the last. Frame k's rows sit at
           (p + tick_k, p + r, p + c), its audio frame j at p + tick_k + j (p: the video's first
           position), and the sample goes on one past the video's largest coordinate
           (datasets/layout.py, the video clock).

Positions are laid out as the stream lays out samples (datasets/stream.py): text and audio
advance the rotary t by one; an image starting at t = p puts its start row at (p, p, p + c), its
row r at (p, p + r + 1, p + c), and the text after it at p + max(h + 1, w); each image row is
its own bidirectional segment, audio frames one windowed segment. A batch decodes in lockstep
(one layout for every row; rows that stopped keep feeding but their outputs are dropped).

Every sampled id comes back with its log-probability under the model at temperature 1, over the
whole vocabulary (shared head) or the level's codebook (level heads): what a trainer computes
for the same position, so RL can compare behaviour and training policies.

Shapes: B batch, n new positions, T cached positions, G id slots, D model dim, H heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from tokenloom.contract import ATTENTION_IDS, MODALITY_IDS, TIME_TICK_MS
from tokenloom.kernels import mask_from_columns
from tokenloom.model.elastic import SubModel


# -- the token space a generation needs ------------------------------------------------------
@dataclass(frozen=True)
class TokenSpace:
    """The id ranges and specials of the model's vocabulary manifest (built by the caller)."""

    text: tuple[int, int]
    visual: tuple[int, int]
    audio: tuple[tuple[int, int], ...]
    specials: dict[str, int]

    def ids(self, *ranges: tuple[int, int], extra: tuple[int, ...] = ()) -> torch.Tensor:
        parts = [torch.arange(a, b) for a, b in ranges] + [torch.tensor(extra, dtype=torch.long)]
        return torch.cat(parts)


@dataclass
class SamplingConfig:
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: all
    top_p: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"sampling needs temperature >= 0, top_k >= 0 and top_p in (0, 1], got {self}")


# -- the cache ---------------------------------------------------------------------------------
class LayerCache:
    """One layer's keys and values [B, capacity, H, Dh]; `allowed` [n, T] is set per step."""

    def __init__(self, owner: KVCache):
        self.owner = owner
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Append this step's k, v [B, n, H, Dh] and attend q [B, n, H, Dh] to the whole cache."""
        start, n = self.owner.length, k.shape[1]
        if self.k is None:
            shape = (k.shape[0], self.owner.capacity, k.shape[2], k.shape[3])
            self.k, self.v = k.new_zeros(shape), v.new_zeros(shape)
        self.k[:, start:start + n], self.v[:, start:start + n] = k, v
        keys, values = self.k[:, :start + n], self.v[:, :start + n]
        mask = self.owner.allowed.to(q.device)[None, None]  # [1, 1, n, T]
        y = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                           attn_mask=mask)
        return y.transpose(1, 2)


class KVCache:
    """Every layer's cache plus the per-position columns the visibility rules are computed from."""

    def __init__(self, n_layers: int, capacity: int):
        self.capacity, self.length = capacity, 0
        self.layers = [LayerCache(self) for _ in range(n_layers)]
        self.segment = np.zeros(capacity, dtype=np.int64)
        self.attention = np.zeros(capacity, dtype=np.int64)
        self.window = np.zeros(capacity, dtype=np.int64)
        self.allowed = torch.zeros(0, 0, dtype=torch.bool)

    def prepare(self, segment: np.ndarray, attention: np.ndarray, window: np.ndarray) -> None:
        """Record the new positions' columns and the rows of the mask their queries use."""
        n, start = len(segment), self.length
        if start + n > self.capacity:
            raise ValueError(f"the sequence would reach {start + n} positions; this cache holds {self.capacity}")
        self.segment[start:start + n], self.attention[start:start + n] = segment, attention
        self.window[start:start + n] = window
        total = start + n
        cols = [torch.from_numpy(a[:total])[None] for a in (self.segment, self.attention, self.window)]
        indices = mask_from_columns(cols[0], torch.zeros_like(cols[0]), cols[1], cols[2])[0, 0]  # [T, 4]
        rows = torch.arange(start, total)[:, None]
        lts, lte, uts, ute = indices.long().unbind(-1)
        masked = ((rows >= lts) & (rows < lte)) | ((rows >= uts) & (rows < ute))
        self.allowed = ~masked  # [n, T]

    def advance(self, n: int) -> None:
        self.length += n


# -- laying out positions, as the stream does ------------------------------------------------
@dataclass
class Cursor:
    """Where the next position goes: its rotary t and its segment number."""

    t: int
    segment: int
    text_open: bool  # the last position was text: more text continues its segment

    @staticmethod
    def after(prompt: Chunk) -> Cursor:
        """The cursor after a prompt that ends with a text position (a sample's layout always does)."""
        if prompt.modality[-1] != MODALITY_IDS["text"]:
            raise ValueError("a prompt must end with a text position (media parts end with their close delimiter)")
        return Cursor(int(prompt.coords[-1, 0]) + 1, int(prompt.segment[-1]), True)


@dataclass
class Chunk:
    """New positions to feed: ids [B, n, G] and their columns [n] (coords [n, 3])."""

    ids: torch.Tensor
    modality: np.ndarray
    coords: np.ndarray
    segment: np.ndarray
    attention: np.ndarray
    window: np.ndarray

    @staticmethod
    def from_columns(ids: np.ndarray, modality: np.ndarray, coords: np.ndarray, segment: np.ndarray,
                     attention: np.ndarray, window: np.ndarray, batch: int = 1) -> Chunk:
        """A prompt laid out as the stream lays out a sample (`datasets.stream.sample_positions`'s
        columns), repeated over `batch` rows."""
        grouped = torch.from_numpy(np.asarray(ids, dtype=np.int64))[None].expand(batch, -1, -1).clone()
        return Chunk(grouped, *(np.asarray(a, dtype=np.int64) for a in (modality, coords, segment, attention, window)))

    def __len__(self) -> int:
        return self.ids.shape[1]


def _chunk(ids: torch.Tensor, modality: str, coords: np.ndarray, segment: int, kind: str, window: int = 0) -> Chunk:
    n = ids.shape[1]
    return Chunk(ids, np.full(n, MODALITY_IDS[modality]), coords.astype(np.int64), np.full(n, segment),
                 np.full(n, ATTENTION_IDS[kind]), np.full(n, window))


def text_chunk(cursor: Cursor, ids: torch.Tensor, group: int) -> Chunk:
    """ids [B, n] text tokens (specials included) at the cursor."""
    B, n = ids.shape
    if not cursor.text_open:
        cursor.segment += 1
    t = cursor.t + np.arange(n)
    out = _chunk(_grouped(ids, group), "text", np.stack([t, t, t], 1), cursor.segment, "causal")
    cursor.t, cursor.text_open = cursor.t + n, True
    return out


def image_row_chunk(cursor: Cursor, p: int, row: int, codes: torch.Tensor, group: int, tick: int = 0) -> Chunk:
    """Row `row` (-1: the start row) of an image begun at t = p: codes [B, w] unified ids; a video
    frame at `tick` on the clock of a video begun at p has its rows at t = p + tick."""
    w = codes.shape[1]
    cursor.segment += 1
    cursor.text_open = False
    coords = np.stack([np.full(w, p + tick), np.full(w, p + row + 1), p + np.arange(w)], 1)
    return _chunk(_grouped(codes, group), "image", coords, cursor.segment, "bidirectional")


def audio_frame_chunk(cursor: Cursor, frame: torch.Tensor, group: int, window: int, new_segment: bool) -> Chunk:
    """One audio frame [B, L] (unified ids of its levels) as one position."""
    if new_segment:
        cursor.segment += 1
    cursor.text_open = False
    t = np.array([cursor.t])
    out = _chunk(_grouped(frame[:, None, :], group), "audio", np.stack([t, t, t], 1), cursor.segment, "window",
                 window)
    cursor.t += 1
    return out


def _grouped(ids: torch.Tensor, group: int) -> torch.Tensor:
    """[B, n] or [B, n, L] ids -> [B, n, G] with unused slots -1."""
    if ids.dim() == 2:
        ids = ids[..., None]
    out = torch.full((*ids.shape[:2], group), -1, dtype=torch.long, device=ids.device)
    out[..., :ids.shape[-1]] = ids
    return out


# -- sampling ------------------------------------------------------------------------------------
def sample(logits: torch.Tensor, candidates: torch.Tensor | None, cfg: SamplingConfig,
           generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (ids [B] among `candidates` (all when None), their log-probability under
    the whole softmax at temperature 1)."""
    logits = logits.float()
    full = logits.log_softmax(-1)
    scores = logits if candidates is None else logits[:, candidates]
    if cfg.temperature == 0:
        pick = scores.argmax(-1)
    else:
        scores = scores / cfg.temperature
        if cfg.top_k and cfg.top_k < scores.shape[-1]:
            kth = scores.topk(cfg.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if cfg.top_p < 1:
            ordered, order = scores.sort(-1, descending=True)
            cumulative = ordered.softmax(-1).cumsum(-1)
            drop = cumulative - ordered.softmax(-1) > cfg.top_p  # keep the smallest set reaching top_p
            scores = scores.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
        pick = torch.multinomial(scores.softmax(-1).cpu(), 1, generator=generator)[:, 0].to(logits.device)
    ids = pick if candidates is None else candidates.to(logits.device)[pick]
    return ids, full.gather(-1, ids[:, None])[:, 0]


# -- the decoder -----------------------------------------------------------------------------------
@dataclass
class Generated:
    """What one generation made, per batch row: the ids it appended (unified, in shard layout
    order, forced delimiters included) and, aligned with them, the log-probability of each
    sampled id (NaN for ids it did not sample: delimiters, start rows)."""

    ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    # per row: {"text": ids} | {"image": codes} | {"audio": codes} | {"video": VideoPart's fields}
    parts: list[dict] = field(default_factory=list)
    positions: int = 0  # positions fed after the prompt
    seconds: float = 0.0


class Decoder:
    """Feeds positions through the model with a KV cache; returns the final hidden states."""

    def __init__(self, model, capacity: int, sub: SubModel | None = None):
        self.model, self.sub = model, sub or SubModel()
        self.cache = KVCache(len(model.blocks), capacity)
        self.group = 0

    @torch.no_grad()
    def feed(self, chunk: Chunk) -> torch.Tensor:
        """chunk -> hidden states [B, n, D] (normed) of its positions."""
        self.cache.prepare(chunk.segment, chunk.attention, chunk.window)
        B = chunk.ids.shape[0]
        device = next(self.model.parameters()).device
        batch = {"ids": chunk.ids.to(device),
                 "coords": torch.from_numpy(chunk.coords)[None].expand(B, -1, -1).to(device),
                 "modality": torch.from_numpy(chunk.modality)[None].expand(B, -1).to(device)}
        h, _ = self.model.forward(batch, self.sub, cache=self.cache)
        self.cache.advance(chunk.ids.shape[1])
        return h


@dataclass
class Request:
    """What to generate after the prompt."""

    to: str  # "text", "image", "audio" or "video"
    grid: tuple[int, int] = (0, 0)  # image, video frames: rows x columns of codes
    max_new_tokens: int = 64  # text
    max_frames: int = 250  # audio: at most this many frames (the duration), then <eoa>
    stop: tuple[int, ...] = ()  # text: ids that end it (besides <eos>)
    audio_window: int = 64  # frames an audio position attends to (stream.audio_window of training)
    frames: int = 1  # video: frames
    fps: float = 2.0  # video: frames per second (ingest.video.fps): frame k at round(1000 k / fps) ms
    audio_per_frame: int = 0  # video: audio frames after each frame (its interval's sound); 0: no sound

    def validate(self, space: TokenSpace) -> None:
        if self.to not in ("text", "image", "audio", "video"):
            raise ValueError(f"generation target must be text, image, audio or video, got {self.to!r}")
        if self.to in ("image", "video") and min(self.grid) < 1:
            raise ValueError(f"an image needs a grid of at least 1 x 1 codes, got {self.grid}")
        if self.to in ("image", "video") and space.visual[1] <= space.visual[0]:
            raise ValueError("this model's vocabulary has no visual codes")
        if (self.to == "audio" or (self.to == "video" and self.audio_per_frame)) and not space.audio:
            raise ValueError("this model's vocabulary has no audio codes")
        if self.max_new_tokens < 1 or self.max_frames < 1:
            raise ValueError("max_new_tokens and max_frames must be >= 1")
        if self.to == "video":
            if "<bov>" not in space.specials or "<eov>" not in space.specials:
                raise ValueError("this model's vocabulary has no <bov>/<eov>: it was not trained with video")
            if self.frames < 1 or not 0 < self.fps <= 1000 / TIME_TICK_MS or self.audio_per_frame < 0:
                raise ValueError(f"a video needs frames >= 1, 0 < fps <= {1000 // TIME_TICK_MS} (one frame per "
                                 f"{TIME_TICK_MS} ms tick at most) and audio_per_frame >= 0, got {self.frames}, "
                                 f"{self.fps}, {self.audio_per_frame}")

    def budget(self) -> int:
        """Positions this request may append (delimiters included)."""
        if self.to == "image":
            return (self.grid[0] + 1) * self.grid[1] + 2
        if self.to == "video":
            return self.frames * ((self.grid[0] + 1) * self.grid[1] + self.audio_per_frame) + 2
        return (self.max_frames if self.to == "audio" else self.max_new_tokens) + 2


@torch.no_grad()
def generate(model, space: TokenSpace, prompt: Chunk, cursor: Cursor, request: Request,
             sampling: SamplingConfig | None = None, sub: SubModel | None = None) -> Generated:
    """Decode `request` after the `prompt` positions (laid out up to `cursor`) with a KV cache."""
    import time

    sampling = sampling or SamplingConfig()
    sampling.validate()
    request.validate(space)
    model.eval()
    B, group = prompt.ids.shape[0], prompt.ids.shape[2]
    capacity = prompt.ids.shape[1] + request.budget()
    if capacity > model.cfg.max_seq_len:
        raise ValueError(f"the prompt ({prompt.ids.shape[1]} positions) and this request ({request.budget()}) "
                         f"exceed the model's context of {model.cfg.max_seq_len} positions")
    decoder = Decoder(model, capacity, sub)
    rng = torch.Generator().manual_seed(sampling.seed)
    out = Generated(ids=[[] for _ in range(B)], logprobs=[[] for _ in range(B)], parts=[{} for _ in range(B)])
    t0 = time.perf_counter()
    h = decoder.feed(prompt)[:, -1]
    step = {"text": _text, "image": _image, "audio": _audio, "video": _video}[request.to]
    step(model, decoder, space, cursor, request, sampling, rng, h, group, out)
    out.positions = decoder.cache.length - prompt.ids.shape[1]
    out.seconds = time.perf_counter() - t0
    return out


def _record(out: Generated, row: int, ids, logprobs) -> None:
    out.ids[row] += [int(i) for i in ids]
    out.logprobs[row] += [float(x) for x in logprobs]


def _forced(decoder: Decoder, cursor: Cursor, token: int, B: int, group: int, out: Generated) -> torch.Tensor:
    """Feed a delimiter every row gets; returns the last hidden state."""
    for row in range(B):
        _record(out, row, [token], [float("nan")])
    return decoder.feed(text_chunk(cursor, torch.full((B, 1), token), group))[:, -1]


def _text(model, decoder, space, cursor, request, sampling, rng, h, group, out) -> None:
    B = h.shape[0]
    stops = (space.specials["<eos>"], *request.stop)
    candidates = space.ids(space.text, extra=stops)
    done = torch.zeros(B, dtype=torch.bool)
    for k in range(request.max_new_tokens):
        ids, logprobs = sample(model.head(h), candidates, sampling, rng)
        for row in range(B):
            if not done[row]:
                _record(out, row, [ids[row]], [logprobs[row]])
        done |= torch.isin(ids.cpu(), torch.tensor(stops))
        if bool(done.all()) or k == request.max_new_tokens - 1:
            break
        h = decoder.feed(text_chunk(cursor, ids[:, None].cpu(), group))[:, -1]
    for row in range(B):
        text = [i for i in out.ids[row] if space.text[0] <= i < space.text[1]]
        out.parts[row] = {"text": [i - space.text[0] for i in text]}


def _image(model, decoder, space, cursor, request, sampling, rng, h, group, out) -> None:
    B = h.shape[0]
    rows, cols = request.grid
    _forced(decoder, cursor, space.specials["<boi>"], B, group, out)
    p = cursor.t
    candidates = space.ids(space.visual)
    current = torch.full((B, cols), space.specials["<row>"])  # the learned start row
    codes = []
    for r in range(-1, rows - 1):  # row r's positions score row r + 1
        hidden = decoder.feed(image_row_chunk(cursor, p, r, current, group))  # [B, w, D]
        ids, logprobs = sample(model.head(hidden).flatten(0, 1), candidates, sampling, rng)
        current, logprobs = ids.view(B, cols).cpu(), logprobs.view(B, cols).cpu()
        codes.append(current)
        for row in range(B):
            _record(out, row, current[row], logprobs[row])
    cursor.t = p + max(rows + 1, cols)
    grid = torch.stack(codes, 1) - space.visual[0]  # [B, rows, cols] local codes
    for row in range(B):
        out.ids[row].append(space.specials["<eoi>"])
        out.logprobs[row].append(float("nan"))
        out.parts[row] = {"image": grid[row].numpy()}


def _audio_frame(model, space, h, sampling, rng, candidates) -> tuple[torch.Tensor, torch.Tensor]:
    """One audio frame from the hidden state that predicts it: level 0 from the shared head among
    `candidates`, levels 1..L-1 in order from the level heads, each conditioned on the codes sampled
    below it (teacher forcing's order); (unified ids [B, L], log-probabilities [B, L]) on the CPU."""
    level0, lp0 = sample(model.head(h), candidates, sampling, rng)
    frame, lps, cond = [level0], [lp0], h
    for level, head in enumerate(model.level_heads, start=1):
        cond = cond + model.embed(frame[-1])
        local, lp = sample(head(cond), None, sampling, rng)
        frame.append(local + space.audio[level][0])
        lps.append(lp)
    return torch.stack(frame, 1).cpu(), torch.stack(lps, 1).cpu()


def _video(model, decoder, space, cursor, request, sampling, rng, h, group, out) -> None:
    B = h.shape[0]
    rows, cols = request.grid
    n = request.audio_per_frame
    _forced(decoder, cursor, space.specials["<bov>"], B, group, out)
    p = cursor.t
    candidates = space.ids(space.visual)
    level0 = space.ids(space.audio[0]) if n else None  # a fixed count per interval: no <eoa> inside a video
    offsets = torch.tensor([start for start, _ in space.audio]) if n else None
    frames, sound, times, extent = [], [], [], 0
    for k in range(request.frames):
        ms = round(k * 1000 / request.fps)
        tick = ms // TIME_TICK_MS
        current = torch.full((B, cols), space.specials["<row>"])  # the learned start row
        codes = []
        for r in range(-1, rows):  # every row is fed: the last one's last position predicts what follows
            hidden = decoder.feed(image_row_chunk(cursor, p, r, current, group, tick))  # [B, w, D]
            if r == rows - 1:
                break
            ids, logprobs = sample(model.head(hidden).flatten(0, 1), candidates, sampling, rng)
            current, logprobs = ids.view(B, cols).cpu(), logprobs.view(B, cols).cpu()
            codes.append(current)
            for row in range(B):
                _record(out, row, current[row], logprobs[row])
        frames.append(torch.stack(codes, 1) - space.visual[0])  # [B, rows, cols]
        times.append(ms)
        extent = max(extent, max(tick, rows, cols - 1) + 1)
        h = hidden[:, -1]
        interval = []
        cursor.t = p + tick
        for j in range(n):
            frame_ids, frame_lp = _audio_frame(model, space, h, sampling, rng, level0)
            interval.append(frame_ids)
            for row in range(B):
                _record(out, row, frame_ids[row], frame_lp[row])
            h = decoder.feed(audio_frame_chunk(cursor, frame_ids, group, request.audio_window, new_segment=j == 0))[:, -1]
        if n:
            sound.append((torch.stack(interval, 1) - offsets).numpy())  # [B, n, L] local codes
            extent = max(extent, tick + n)
    cursor.t, cursor.text_open = p + extent, False
    grids = torch.stack(frames, 1).numpy()  # [B, K, rows, cols]
    stamps = np.asarray(times, dtype=np.int64)
    for row in range(B):
        out.ids[row].append(space.specials["<eov>"])
        out.logprobs[row].append(float("nan"))
        audio = tuple(s[row] for s in sound) if n else ()
        # the fields of `tokenizers.sequence.VideoPart` (the model layer does not import tokenizers)
        out.parts[row] = {"video": {"frames": grids[row], "times": stamps, "audio": audio,
                                    "audio_times": stamps if n else np.zeros(0, np.int64)}}


def _audio(model, decoder, space, cursor, request, sampling, rng, h, group, out) -> None:
    B, levels = h.shape[0], len(space.audio)
    eoa = space.specials["<eoa>"]
    h = _forced(decoder, cursor, space.specials["<boa>"], B, group, out)
    first = space.ids(space.audio[0], extra=(eoa,))
    offsets = torch.tensor([start for start, _ in space.audio])
    done = torch.zeros(B, dtype=torch.bool)
    frames: list[list[torch.Tensor]] = [[] for _ in range(B)]
    for k in range(request.max_frames):
        level0, lp0 = sample(model.head(h), first, sampling, rng)
        ended = level0.cpu() == eoa
        frame, lps, cond = [level0], [lp0], h
        for level, head in enumerate(model.level_heads, start=1):  # teacher forcing's order: level l sees < l
            cond = cond + model.embed(frame[-1])
            local, lp = sample(head(cond), None, sampling, rng)
            frame.append(local + space.audio[level][0])
            lps.append(lp)
        frame_ids, frame_lp = torch.stack(frame, 1).cpu(), torch.stack(lps, 1).cpu()  # [B, L]
        for row in range(B):
            if done[row]:
                continue
            if ended[row]:
                _record(out, row, [eoa], [frame_lp[row, 0]])
            else:
                frames[row].append(frame_ids[row])
                _record(out, row, frame_ids[row], frame_lp[row])
        done |= ended
        if bool(done.all()) or k == request.max_frames - 1:
            break
        feed = torch.where(done[:, None], offsets, frame_ids)  # rows that stopped feed a filler frame
        h = decoder.feed(audio_frame_chunk(cursor, feed, group, request.audio_window, new_segment=k == 0))[:, -1]
    for row in range(B):
        if not done[row]:  # the frame budget ran out: close the audio
            _record(out, row, [eoa], [float("nan")])
        codes = torch.stack(frames[row]) if frames[row] else torch.zeros(0, levels, dtype=torch.long)
        out.parts[row] = {"audio": (codes - offsets).numpy()}
