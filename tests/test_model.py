"""The unified MoE model: one token space, attention kinds, group prediction, elastic sub-models, export."""

import numpy as np
import pytest
import torch
from multimodal_data import AUDIO_RANGES, VOCAB, audio_sample, image_sample, text_sample

from tokenloom.datasets.stream import pack_row, sample_positions
from tokenloom.model import ElasticConfig, ModelConfig, SubModel, UnifiedModel, export_submodel
from tokenloom.model.elastic import parse_indices, sample_submodel
from tokenloom.model.io import load_model, save_model

WINDOW = 4


def _cfg(**kw):
    base = dict(vocab_size=VOCAB, audio_ranges=AUDIO_RANGES, dim=64, n_layers=3, n_heads=2, n_experts=8, top_k=2,
                expert_hidden=32)
    base.update(kw)
    return ModelConfig(**base)


def _model(**kw):
    torch.manual_seed(0)
    return UnifiedModel(_cfg(**kw))


def _batch(*rows):
    return {k: torch.from_numpy(np.stack([r[k] for r in rows])) for k in rows[0]}


def _row(samples, seq_len=96):
    return pack_row([sample_positions(t, s, 2, WINDOW) for t, s in samples], seq_len)


@pytest.fixture
def samples():
    rng = np.random.default_rng(0)
    return [text_sample(rng, 12), image_sample(rng), audio_sample(rng, frames=10)]


def _hidden(model, batch):
    with torch.no_grad():
        return model(batch)[0][0]


def test_positions_and_groups(samples):
    row = _row(samples)
    mod = row["modality"]
    n_text, n_img = 12, 2 + 12 + 7
    assert list(mod[:12]) == [0] * 12 and (mod[n_text + 2 : n_text + 14] == 1).all()
    audio = np.flatnonzero(mod == 2)
    assert len(audio) == 10  # ten frames, one position each
    assert (row["ids"][audio] >= 300).all()  # two level codes per position
    assert (row["ids"][mod == 0][:, 1] == -1).all()  # text uses one slot
    img = row["coords"][n_text + 2 : n_text + 14]  # image: t fixed, (h, w) walk the 3 x 4 grid
    assert (img[:, 0] == 2).all() and list(img[:, 1]) == [2] * 4 + [3] * 4 + [4] * 4
    assert list(img[:4, 2]) == [2, 3, 4, 5]
    assert row["coords"][n_text + 14, 0] == 2 + 4  # the caption continues after max(h, w)
    first_audio = audio[0]
    np.testing.assert_array_equal(row["labels"][first_audio - 1], row["ids"][first_audio])  # <boa> predicts frame 0
    assert (row["modality"][n_text + n_img + 2 + 10 + 6 :] == 3).all()  # padding after the audio sample


def test_documents_are_apart_and_attention_kinds_hold(samples):
    model = _model(n_layers=1).eval()  # one layer: the window is the receptive field
    base = _row(samples)
    out = _hidden(model, _batch(base))
    n_text, img0 = 12, 12 + 2
    audio = np.flatnonzero(base["modality"] == 2)

    def changed(pos, slot=0):
        row = {k: v.copy() for k, v in base.items()}
        lo, hi = {(0, 0): (16, 200), (1, 0): (200, 300), (2, 0): AUDIO_RANGES[0], (2, 1): AUDIO_RANGES[1]}[
            (int(base["modality"][pos]), slot)]
        row["ids"][pos, slot] = lo + (row["ids"][pos, slot] - lo + 1) % (hi - lo)  # another id of the same kind
        return _hidden(model, _batch(row))

    # text is causal, and a later sample never sees an earlier one
    o = changed(5)
    torch.testing.assert_close(o[:5], out[:5])
    assert not torch.allclose(o[5:n_text], out[5:n_text])
    torch.testing.assert_close(o[n_text:], out[n_text:])
    # an image is bidirectional within itself: its last token changes its first token's state
    o = changed(img0 + 11)
    assert not torch.allclose(o[img0], out[img0])
    torch.testing.assert_close(o[:img0], out[:img0])
    # audio attends within a window of WINDOW frames; the transcript after it sees every frame
    j = audio[2]
    o = changed(j, slot=1)
    assert not torch.allclose(o[j + WINDOW - 1], out[j + WINDOW - 1])
    torch.testing.assert_close(o[j + WINDOW], out[j + WINDOW])
    assert not torch.allclose(o[audio[-1] + 1], out[audio[-1] + 1])


def test_each_modality_loss_is_finite_and_decreases(samples):
    rng = np.random.default_rng(1)
    rows = [_row(samples), _row([image_sample(rng), audio_sample(rng, 8)]), _row([text_sample(rng, 40), audio_sample(rng, 6)])]
    batch = _batch(*rows)
    model = _model(mtp=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    history = []
    for _ in range(40):
        loss, parts = model.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.update_router_bias(model.routing_loads())
        history.append({k: float(v) for k, v in parts.items() if k.startswith("loss_")})
    for key in ("loss_text", "loss_image", "loss_audio", "loss_mtp"):
        assert np.isfinite(history[0][key]) and history[-1][key] < 0.6 * history[0][key], key


def test_audio_levels_are_teacher_forced_by_lower_levels(samples):
    """Level 1's loss depends on the true level-0 code of the frame it predicts, not on the level-1 input."""
    model = _model()
    batch = _batch(_row(samples))
    base = model.loss(batch)[1]["sum_audio"]
    audio = torch.nonzero(batch["modality"][0] == 2).flatten()
    relabel = {k: v.clone() for k, v in batch.items()}
    relabel["labels"][0, audio[3] - 1, 0] = 300 + (relabel["labels"][0, audio[3] - 1, 0] - 299) % 50
    assert not torch.isclose(model.loss(relabel)[1]["sum_audio"], base)


def test_exported_submodel_equals_the_restricted_full_model(samples, tmp_path):
    model = _model(n_layers=4).eval()
    batch = _batch(_row(samples))
    sub = SubModel(layers=(0, 2, 3), experts=(1, 2, 4, 7), top_k=1)
    small = export_submodel(model, sub).eval()
    assert small.cfg.n_layers == 3 and small.cfg.n_experts == 4 and small.cfg.top_k == 1
    with torch.no_grad():
        torch.testing.assert_close(small.logits(batch), model.logits(batch, sub), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(model.logits(batch), model.logits(batch, sub))
    save_model(small.state_dict(), small.cfg, tmp_path / "m")
    loaded, _ = load_model(tmp_path / "m")
    with torch.no_grad():
        torch.testing.assert_close(loaded.logits(batch), small.logits(batch))
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in model.parameters())


def test_elastic_sampling_matches_the_configuration():
    cfg = _cfg(n_layers=10, n_experts=32, top_k=4, elastic=ElasticConfig(enabled=True, seed=3))
    draws = [sample_submodel(cfg, step) for step in range(4000)]
    depth = [d for d in draws if d.layers is not None]
    width = [d for d in draws if d.experts is not None]
    sparse = [d for d in draws if d.top_k is not None]
    assert abs(len(depth) / 4000 - 0.25) < 0.03 and abs(len(width) / 4000 - 0.2) < 0.03
    assert abs(len(sparse) / 4000 - 0.2) < 0.03
    assert all(3 <= len(d.layers) <= 7 for d in depth)
    assert all(round(0.3 * 32) <= len(d.experts) <= round(0.5 * 32) for d in width)
    assert all(1 <= d.top_k < 4 for d in sparse)
    assert sample_submodel(cfg, 17) == sample_submodel(cfg, 17)  # every rank draws the same sub-model
    assert all(d == SubModel() for d in (sample_submodel(_cfg(), s) for s in range(50)))  # off by default


def test_mtp_is_a_switch(samples):
    batch = _batch(_row(samples))
    assert "loss_mtp" not in _model().loss(batch)[1]
    with_mtp = _model(mtp=True)
    assert "loss_mtp" in with_mtp.loss(batch)[1] and with_mtp.mtp is not None


def test_bad_configuration_and_indices_are_refused():
    with pytest.raises(ValueError, match="top_k"):
        _cfg(top_k=9).validate()
    with pytest.raises(ValueError, match="audio range"):
        _cfg(audio_ranges=((300, 500),)).validate()
    assert parse_indices("0-2,5", 8, "--experts") == (0, 1, 2, 5)
    with pytest.raises(ValueError, match="--layers"):
        parse_indices("0,9", 4, "--layers")
