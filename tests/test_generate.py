"""Generation: KV-cache decoding equals a full forward, sampled log-probabilities are the model's,
the layout generated is the layout trained on, and the request's limits hold."""

import numpy as np
import pytest
import torch
from multimodal_data import AUDIO_RANGES, LAYOUT, MANIFEST, VOCAB

from tokenloom.datasets.stream import sample_positions
from tokenloom.model import ModelConfig, MoEConfig, UnifiedModel
from tokenloom.model.generate import (
    Chunk,
    Cursor,
    Decoder,
    Request,
    SamplingConfig,
    TokenSpace,
    generate,
)
from tokenloom.model.unified import mask_indices
from tokenloom.tokenizers.sequence import AudioPart, ImagePart, TextPart, VideoPart

WINDOW = 4
SPACE = TokenSpace((MANIFEST.text.start, MANIFEST.text.stop), (MANIFEST.visual.start, MANIFEST.visual.stop),
                   tuple((r.start, r.stop) for r in MANIFEST.audio), dict(MANIFEST.specials))


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, audio_ranges=AUDIO_RANGES, dim=64, n_layers=3, n_heads=4, max_seq_len=256,
                      mtp=True, moe=MoEConfig(n_experts=8, top_k=2, expert_hidden=32))
    return UnifiedModel(cfg).eval()


def _positions(parts, drop_eos=True):
    tokens, segments = LAYOUT.assemble(parts)
    if drop_eos:  # a prompt: the sample without its closing <eos>
        tokens = tokens[:-1]
        segments[-1] = {**segments[-1], "length": segments[-1]["length"] - 1}
    return sample_positions(tokens, segments, 2, WINDOW)


def _chunk(pos, sl=slice(None), batch=1):
    return Chunk.from_columns(pos.ids[sl], pos.modality[sl], pos.coords[sl], pos.segment[sl], pos.attention[sl],
                              pos.window[sl], batch)


def _full(model, pos):
    """Hidden states of one sample's positions by a plain forward (the training path)."""
    n = len(pos)
    batch = {"ids": torch.from_numpy(pos.ids)[None], "coords": torch.from_numpy(pos.coords)[None],
             "modality": torch.from_numpy(pos.modality)[None], "segment_ids": torch.from_numpy(pos.segment)[None],
             "doc_ids": torch.zeros(1, n, dtype=torch.long), "attention": torch.from_numpy(pos.attention)[None],
             "window": torch.from_numpy(pos.window)[None]}
    with torch.no_grad():
        return model(batch, indices=mask_indices(batch))[0][0]


def _sample_parts(rng):
    return [TextPart(rng.integers(0, 50, 5)), ImagePart(rng.integers(0, 100, (3, 4))), TextPart(rng.integers(0, 50, 3)),
            AudioPart(rng.integers(0, 50, (7, 2))), TextPart(rng.integers(0, 50, 4))]


def test_cached_decoding_equals_a_full_forward(model):
    """Fed piece by piece through the cache (a text token, an image row, an audio frame at a time),
    every position's hidden state equals the full forward's, for every modality."""
    pos = _positions(_sample_parts(np.random.default_rng(0)), drop_eos=False)
    full = _full(model, pos)
    decoder = Decoder(model, capacity=len(pos))
    cuts, i = [], 4
    while i < len(pos):  # one position at a time, a whole image row at a time
        j = i + 1
        while j < len(pos) and pos.segment[j] == pos.segment[i] and pos.modality[i] == 1:
            j += 1
        cuts.append((i, j))
        i = j
    outs = [decoder.feed(_chunk(pos, slice(0, 4)))[0]]
    outs += [decoder.feed(_chunk(pos, slice(a, b)))[0] for a, b in cuts]
    cached = torch.cat(outs)
    assert cached.shape == full.shape
    for name, m in (("text", 0), ("image", 1), ("audio", 2)):
        sel = torch.from_numpy(pos.modality == m)
        torch.testing.assert_close(cached[sel], full[sel], rtol=0, atol=1e-5, msg=f"{name} positions differ")


def test_generated_text_logprobs_are_the_full_forwards(model):
    prompt = _positions([TextPart(np.arange(6))])
    out = generate(model, SPACE, _chunk(prompt), Cursor.after(_chunk(prompt)), Request("text", max_new_tokens=12),
                   SamplingConfig(temperature=1.0, seed=3))
    ids = out.ids[0]
    assert 1 <= len(ids) <= 12 and len(out.logprobs[0]) == len(ids)
    eos = MANIFEST.specials["<eos>"]
    assert eos not in ids[:-1]  # generation stops at its stop token
    text = [i - MANIFEST.text.start for i in ids if i != eos]
    full_pos = _positions([TextPart(np.r_[np.arange(6), text])])
    logits = model.head(_full(model, full_pos)).log_softmax(-1)
    n = len(prompt)
    expected = [float(logits[n - 1 + k, i]) for k, i in enumerate(ids)]
    np.testing.assert_allclose(out.logprobs[0], expected, atol=1e-4)


def test_generated_image_is_the_trained_layout(model):
    """Row by row: each code's log-probability is the full forward's at the position that predicts
    it in the training layout (start row -> row 0, row r -> row r + 1)."""
    prompt = _positions([TextPart(np.arange(4))])
    grid = (3, 5)
    out = generate(model, SPACE, _chunk(prompt), Cursor.after(_chunk(prompt)), Request("image", grid=grid),
                   SamplingConfig(temperature=1.0, seed=1))
    codes = out.parts[0]["image"]
    assert codes.shape == grid and ((codes >= 0) & (codes < MANIFEST.visual.size)).all()
    full_pos = _positions([TextPart(np.arange(4)), ImagePart(codes)])
    logp = model.head(_full(model, full_pos)).log_softmax(-1)
    targets = torch.from_numpy(full_pos.labels[:, 0])
    image = np.flatnonzero(full_pos.target == 1)
    assert len(image) == codes.size
    expected = logp[image, targets[image]].numpy()
    sampled = [x for x in out.logprobs[0] if not np.isnan(x)]
    np.testing.assert_allclose(sampled, expected, atol=1e-4)
    assert out.ids[0][0] == MANIFEST.specials["<boi>"] and out.ids[0][-1] == MANIFEST.specials["<eoi>"]


def test_generated_audio_is_the_trained_layout(model):
    prompt = _positions([TextPart(np.arange(4))])
    out = generate(model, SPACE, _chunk(prompt), Cursor.after(_chunk(prompt)),
                   Request("audio", max_frames=9, audio_window=WINDOW), SamplingConfig(temperature=1.0, seed=2))
    codes = out.parts[0]["audio"]
    assert codes.shape[1] == 2 and 1 <= len(codes) <= 9
    full_pos = _positions([TextPart(np.arange(4)), AudioPart(codes)])
    h = _full(model, full_pos)
    frames = np.flatnonzero(full_pos.modality == 2)
    before = np.r_[frames[0] - 1, frames[:-1]]  # the position that predicts each frame
    level0 = model.head(h[before]).log_softmax(-1)
    ids = torch.from_numpy(full_pos.ids[frames])
    lp0 = level0.gather(1, ids[:, :1])[:, 0]
    cond = h[before] + model.embed(ids[:, 0])
    lp1 = model.level_heads[0](cond).log_softmax(-1).gather(1, (ids[:, 1:2] - AUDIO_RANGES[1][0]))[:, 0]
    sampled = np.array([x for x in out.logprobs[0] if not np.isnan(x)])
    expected = torch.stack([lp0, lp1], 1).flatten().detach().numpy()
    np.testing.assert_allclose(sampled[:len(expected)], expected, atol=1e-4)
    assert out.ids[0][-1] == MANIFEST.specials["<eoa>"]


@pytest.mark.parametrize("audio_per_frame", [0, 3])
def test_generated_video_is_the_trained_layout(model, audio_per_frame):
    """Frames at their ticks with their sound between them: every sampled code's log-probability
    is the full forward's over the same video laid out as ingestion and the stream lay it out
    (frame rows predicted row by row, each audio frame by the position before it, level 1 by its
    level head), so the decoder's positions, segments and masks are the trained ones."""
    prompt = _positions([TextPart(np.arange(4))])
    request = Request("video", grid=(2, 3), frames=3, fps=10.0, audio_per_frame=audio_per_frame,
                      audio_window=WINDOW)
    out = generate(model, SPACE, _chunk(prompt), Cursor.after(_chunk(prompt)), request,
                   SamplingConfig(temperature=1.0, seed=5))
    video = VideoPart(**out.parts[0]["video"])
    assert video.frames.shape == (3, 2, 3)
    assert video.times.tolist() == [0, 100, 200] and video.audio_frames == 3 * audio_per_frame
    full_pos = _positions([TextPart(np.arange(4)), video])
    h = _full(model, full_pos)
    logp = model.head(h).log_softmax(-1)
    expected = []
    for i in range(len(prompt), len(full_pos) - 1):
        if full_pos.target[i] == 1:  # predicts a frame's code
            expected.append(float(logp[i, full_pos.labels[i, 0]]))
        elif full_pos.modality[i + 1] == 2:  # the position before an audio frame predicts it
            ids = torch.from_numpy(full_pos.ids[i + 1])
            cond = h[i] + model.embed(ids[:1])[0]
            level1 = model.level_heads[0](cond[None]).log_softmax(-1)[0, ids[1] - AUDIO_RANGES[1][0]]
            expected += [float(logp[i, ids[0]]), float(level1)]
    sampled = [x for x in out.logprobs[0] if not np.isnan(x)]
    assert len(sampled) == 3 * 2 * 3 + 3 * audio_per_frame * 2
    np.testing.assert_allclose(sampled, expected, atol=1e-4)
    # the ids are the sample's tokens between <bov> and <eov>, in shard order
    tokens, _ = LAYOUT.assemble([video])
    assert out.ids[0] == tokens[1:-1].tolist()
    assert out.positions == 1 + 3 * (3 * 3 + audio_per_frame)


def test_greedy_is_deterministic_and_seeds_repeat(model):
    prompt = _positions([TextPart(np.arange(5))])
    run = lambda s: generate(model, SPACE, _chunk(prompt, batch=2), Cursor.after(_chunk(prompt)),  # noqa: E731
                             Request("text", max_new_tokens=8), s).ids
    greedy = run(SamplingConfig(temperature=0))
    assert greedy == run(SamplingConfig(temperature=0, seed=9)) and greedy[0] == greedy[1]
    assert run(SamplingConfig(seed=4, top_k=20, top_p=0.9)) == run(SamplingConfig(seed=4, top_k=20, top_p=0.9))


def test_top_k_one_is_greedy(model):
    prompt = _positions([TextPart(np.arange(5))])
    run = lambda s: generate(model, SPACE, _chunk(prompt), Cursor.after(_chunk(prompt)),  # noqa: E731
                             Request("text", max_new_tokens=6), s).ids
    assert run(SamplingConfig(temperature=0.7, top_k=1, seed=5)) == run(SamplingConfig(temperature=0))


def test_limits_and_bad_requests(model):
    prompt = _positions([TextPart(np.arange(5))])
    chunk = _chunk(prompt)
    out = generate(model, SPACE, chunk, Cursor.after(chunk), Request("text", max_new_tokens=3, stop=()),
                   SamplingConfig(temperature=0))
    assert len(out.ids[0]) <= 3
    with pytest.raises(ValueError, match="context"):
        generate(model, SPACE, chunk, Cursor.after(chunk), Request("image", grid=(40, 40)))
    with pytest.raises(ValueError, match="grid"):
        generate(model, SPACE, chunk, Cursor.after(chunk), Request("image", grid=(0, 4)))
    with pytest.raises(ValueError, match="text, image, audio or video"):
        generate(model, SPACE, chunk, Cursor.after(chunk), Request("smell"))
    with pytest.raises(ValueError, match="grid"):
        generate(model, SPACE, chunk, Cursor.after(chunk), Request("video"))
    with pytest.raises(ValueError, match="frames >= 1"):
        generate(model, SPACE, chunk, Cursor.after(chunk), Request("video", grid=(2, 2), frames=0))
    with pytest.raises(ValueError, match="context"):
        generate(model, SPACE, chunk, Cursor.after(chunk), Request("video", grid=(4, 4), frames=20, audio_per_frame=25))
    with pytest.raises(ValueError, match="top_p"):
        generate(model, SPACE, chunk, Cursor.after(chunk), Request("text"), SamplingConfig(top_p=0))
