"""The unified MoE model: one token space, attention kinds, group prediction, elastic sub-models, export,
the attention mask from a batch's columns, and model folders old and new."""

import json

import numpy as np
import pytest
import torch
from multimodal_data import (
    AUDIO_RANGES,
    VOCAB,
    audio_sample,
    image_sample,
    mixed_samples,
    text_sample,
    write_shard,
)

from tokenloom.contract import ATTENTION_KINDS, MODALITIES, MODALITY_IDS, PAD_MODALITY, ROW_DTYPE, ROW_KEYS
from tokenloom.datasets import StreamConfig, TokenStream
from tokenloom.datasets.stream import pack_row, sample_positions
from tokenloom.kernels import Segment, build_multimodal_mask
from tokenloom.model import ElasticConfig, ModelConfig, MoEConfig, SubModel, UnifiedModel, export_submodel
from tokenloom.model.elastic import sample_submodel
from tokenloom.model.io import load_model, save_model
from tokenloom.model.unified import mask_indices

WINDOW = 4


def _cfg(moe: dict | None = None, **kw):
    base = dict(vocab_size=VOCAB, audio_ranges=AUDIO_RANGES, dim=64, n_layers=3, n_heads=2)
    base.update(kw)
    return ModelConfig(**base, moe=MoEConfig(**{"n_experts": 8, "top_k": 2, "expert_hidden": 32, **(moe or {})}))


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
    n_text, n_img = 12, 2 + 4 + 12 + 7  # <bos><boi>, the start row, 3 x 4 codes, <eoi> caption <eos>
    img0 = n_text + 2
    assert list(mod[:12]) == [0] * 12 and (mod[img0 : img0 + 16] == 1).all()
    audio = np.flatnonzero(mod == 2)
    assert len(audio) == 10  # ten frames, one position each
    assert (row["ids"][audio] >= 300).all()  # two level codes per position
    assert (row["ids"][mod == 0][:, 1] == -1).all()  # text uses one slot
    assert (row["ids"][img0 : img0 + 4, 0] == 7).all()  # the learned start row: <row> ids
    img = row["coords"][img0 : img0 + 16]  # image: t fixed, (h, w) walk the start row then the 3 x 4 grid
    assert (img[:, 0] == 2).all() and list(img[:, 1]) == [2] * 4 + [3] * 4 + [4] * 4 + [5] * 4
    assert list(img[:4, 2]) == [2, 3, 4, 5]
    assert row["coords"][img0 + 16, 0] == 2 + 4  # the caption continues after max(h + 1, w)
    # each row is a segment of its own; the start row predicts row 0, row r predicts row r + 1
    assert len(set(row["segment_ids"][img0 : img0 + 16])) == 4
    np.testing.assert_array_equal(row["labels"][img0 : img0 + 12, 0], row["ids"][img0 + 4 : img0 + 16, 0])
    assert (row["target_modality"][img0 : img0 + 12] == 1).all()
    assert (row["labels"][img0 + 12 : img0 + 15] == -100).all()  # the last row predicts nothing ...
    assert row["labels"][img0 + 15, 0] == row["ids"][img0 + 16, 0]  # ... but its last position: <eoi>
    assert (row["labels"][img0 - 1] == -100).all()  # nothing predicts the given start row
    first_audio = audio[0]
    np.testing.assert_array_equal(row["labels"][first_audio - 1], row["ids"][first_audio])  # <boa> predicts frame 0
    assert (row["modality"][n_text + n_img + 2 + 10 + 6 :] == 3).all()  # padding after the audio sample


def test_documents_are_apart_and_attention_kinds_hold(samples):
    model = _model(n_layers=1).eval()  # one layer: the window is the receptive field
    base = _row(samples)
    out = _hidden(model, _batch(base))
    n_text, img0 = 12, 12 + 2 + 4  # the image's first row, after its start row
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
    # an image row is bidirectional within itself and causal across rows: a row's last code
    # changes its first code's state, never an earlier row's
    o = changed(img0 + 3)
    assert not torch.allclose(o[img0], out[img0])
    torch.testing.assert_close(o[:img0], out[:img0])
    o = changed(img0 + 11)  # the last row
    torch.testing.assert_close(o[: img0 + 8], out[: img0 + 8])
    assert not torch.allclose(o[img0 + 8], out[img0 + 8])
    assert not torch.allclose(o[img0 + 12], out[img0 + 12])  # the caption sees the whole image
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


def test_rows_are_packed_as_int32_and_train_as_the_same_rows_in_int64(samples):
    """The packer writes rows as `contract.ROW_DTYPE` (int32: half the bytes of int64) and the model
    takes them as they come: its loss, loss parts and gradients equal those of the same rows widened
    to int64 (every head: text, image, audio levels, MTP)."""
    rng = np.random.default_rng(2)
    packed = _batch(_row(samples), _row([image_sample(rng), text_sample(rng, 20), audio_sample(rng, 8)]))
    assert {str(packed[k].dtype) for k in ROW_KEYS} == {f"torch.{ROW_DTYPE}"}
    wide = {k: v.long() if k in ROW_KEYS else v for k, v in packed.items()}
    model = _model(mtp=True)
    results = []
    for batch in (packed, wide):
        model.zero_grad()
        loss, parts = model.loss(batch)
        loss.backward()
        results.append((parts, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (parts32, grads32), (parts64, grads64) = results
    assert parts32["count_image"] > 0 and parts32["count_audio"] > 0 and parts32["count_text"] > 0
    assert all(torch.equal(parts32[k], parts64[k]) for k in parts64)
    assert len(grads32) == len(grads64) and all(torch.equal(a, b) for a, b in zip(grads32, grads64, strict=True))


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
    assert small.cfg.n_layers == 3 and small.cfg.moe.n_experts == 4 and small.cfg.moe.top_k == 1
    with torch.no_grad():
        torch.testing.assert_close(small.logits(batch), model.logits(batch, sub), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(model.logits(batch), model.logits(batch, sub))
    save_model(small.state_dict(), small.cfg, tmp_path / "m")
    loaded, _ = load_model(tmp_path / "m")
    with torch.no_grad():
        torch.testing.assert_close(loaded.logits(batch), small.logits(batch))
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in model.parameters())


def test_submodels_that_do_not_fit_the_model_are_refused():
    cfg = _cfg(n_layers=4, moe={"n_experts": 8, "top_k": 2})
    for sub in (SubModel(layers=(0, 3)), SubModel(experts=(1, 2, 7), top_k=1), SubModel()):
        sub.check(cfg)  # fits: no error
    for sub, message in ((SubModel(layers=(4,)), r"layers \[4\] \(--layers\).*\[0, 4\)"),
                         (SubModel(layers=()), "--layers"),
                         (SubModel(experts=(0, 8)), r"experts \[0, 8\] \(--experts\).*\[0, 8\)"),
                         (SubModel(experts=(1, 1)), "distinct"),
                         (SubModel(top_k=3), r"--top-k.*\[1, 2\]"),
                         (SubModel(experts=(5,)), "exceeds the 1 experts kept")):
        with pytest.raises(ValueError, match=message):
            sub.check(cfg)
        with pytest.raises(ValueError, match=message):
            export_submodel(_model(n_layers=4, moe={"n_experts": 8, "top_k": 2}), sub)


def test_elastic_sampling_matches_the_configuration():
    cfg = _cfg(n_layers=10, moe={"n_experts": 32, "top_k": 4}, elastic=ElasticConfig(enabled=True, seed=3))
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
    for d in draws[:500]:
        d.check(cfg)  # every draw is a valid sub-model of the configuration


def test_mtp_is_a_switch(samples):
    batch = _batch(_row(samples))
    assert "loss_mtp" not in _model().loss(batch)[1]
    with_mtp = _model(mtp=True)
    assert "loss_mtp" in with_mtp.loss(batch)[1] and with_mtp.mtp is not None


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="model.moe.top_k"):
        _cfg(moe={"top_k": 9}).validate()
    with pytest.raises(ValueError, match="model.moe.impl"):
        _cfg(moe={"impl": "padded"}).validate()
    with pytest.raises(ValueError, match="audio range"):
        _cfg(audio_ranges=((300, 500),)).validate()


def test_both_expert_impls_give_the_same_model(samples):
    batch = _batch(_row(samples))
    grouped, loop = _model(moe={"impl": "grouped"}), _model(moe={"impl": "loop"})
    loop.load_state_dict(grouped.state_dict())
    losses, grads = [], []
    for model in (grouped, loop):
        loss, _ = model.loss(batch)
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


# -- model folders ----------------------------------------------------------------------------------


def test_a_model_folder_with_flat_expert_keys_still_loads(samples, tmp_path):
    """model.json written before the experts' settings moved into `model.moe`."""
    model = _model(moe={"n_experts": 4, "top_k": 1, "n_shared_experts": 2, "router_z_weight": 1e-3}).eval()
    folder = save_model(model.state_dict(), model.cfg, tmp_path / "m")
    doc = json.loads((folder / "model.json").read_text())
    assert doc["config"]["moe"]["n_experts"] == 4  # written nested
    loaded, _ = load_model(folder)
    assert loaded.cfg == model.cfg
    moe = doc["config"].pop("moe")
    moe.pop("impl")  # the old format had no impl
    doc["config"].update(moe)
    (folder / "model.json").write_text(json.dumps(doc))
    old, _ = load_model(folder)
    assert old.cfg == model.cfg  # flat keys mapped into moe, impl at its default
    batch = _batch(_row(samples))
    with torch.no_grad():
        torch.testing.assert_close(old.logits(batch), model.logits(batch))
    doc["config"]["moe"] = {"top_k": 2}
    (folder / "model.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="both nested"):
        load_model(folder)


# -- the attention mask from a batch's columns ----------------------------------------------------


def _segments_of_row(row: dict[str, np.ndarray]) -> list[Segment]:
    """A stream row read back into segment lists, one Python step per segment (how the model did it
    before `mask_from_columns`): padding is a causal text segment of the row's last document."""
    seg = row["segment_ids"]
    starts = np.flatnonzero(np.diff(seg, prepend=seg[0] - 1)).tolist() + [len(seg)]
    out = []
    for s, e in zip(starts[:-1], starts[1:], strict=True):
        kind = ATTENTION_KINDS[int(row["attention"][s])]
        m = int(row["modality"][s])
        out.append(Segment(MODALITIES[m] if m < PAD_MODALITY else "text", s, e - s, kind,
                           int(row["window"][s]) if kind == "window" else None, int(row["doc_ids"][s])))
    return out


def test_mask_indices_of_stream_batches_equal_the_per_row_segment_construction(tmp_path):
    files = [write_shard(tmp_path / f"s{i}.parquet", mixed_samples(seed=i, n=5, frames=(3, 14))) for i in range(2)]
    stream = TokenStream(files, StreamConfig(seq_len=64, group_size=2, audio_window=4, seed=1))
    batches = stream.batches(4)
    padded = windowed = 0
    for _ in range(6):
        rows = next(batches)
        batch = {k: torch.from_numpy(v) for k, v in rows.items()}
        got = mask_indices(batch)
        per_row = [_segments_of_row({k: v[b] for k, v in rows.items()}) for b in range(rows["ids"].shape[0])]
        assert torch.equal(got, build_multimodal_mask(per_row, seq_len=rows["ids"].shape[1]))
        padded += int((rows["modality"] == PAD_MODALITY).any(1).sum())
        audio = rows["modality"] == MODALITY_IDS["audio"]
        windowed += int(audio.sum())
    assert padded > 0 and windowed > 0  # rows that end early (an audio sample) and windowed frames were seen


def test_forward_uses_the_indices_it_is_given(samples):
    model = _model(n_layers=1).eval()
    batch = _batch(_row(samples))
    indices = mask_indices(batch)
    assert indices.dtype == torch.int32 and indices.shape == (1, 1, 96, 4)
    with torch.no_grad():
        torch.testing.assert_close(model(batch)[0], model(batch, indices=indices)[0], rtol=0, atol=0)
        causal = indices.clone()
        causal[..., 2], causal[..., 3] = 0, torch.arange(96, dtype=torch.int32)  # plain causal upper bound
        assert not torch.allclose(model(batch, indices=causal)[0], model(batch)[0])


def test_deployment_tiers_cut_layers_experts_and_top_k():
    from tokenloom.model.elastic import tier_submodel

    cfg = _cfg(n_layers=8, moe={"n_experts": 16, "top_k": 4})
    assert tier_submodel(cfg, "full") == SubModel()
    mid, edge = tier_submodel(cfg, "mid"), tier_submodel(cfg, "edge")
    assert len(mid.layers) == 5 and len(mid.experts) == 10 and mid.top_k is None
    assert len(edge.layers) == 3 and edge.layers[0] == 0 and edge.layers[-1] == 7 and len(edge.experts) == 6
    assert edge.top_k == 1
    for sub in (mid, edge):
        sub.check(cfg)
    with pytest.raises(ValueError, match="tier must be one of"):
        tier_submodel(cfg, "tiny")


@pytest.mark.parametrize("kind", ["image", "text"])
def test_every_parameter_gets_a_gradient_whatever_the_batch_holds(samples, kind):
    """Regression for the gloo abort of 2-rank runs ("Received data size doesn't match expected
    size"): a rank whose batch had no audio target or no pair of text targets skipped the level
    heads or the MTP head, those parameters got no gradient there, ZeRO's reduce buckets then
    differed between ranks and the collective aborted. Every parameter must get a gradient, zero
    if need be, from any batch."""
    rng = np.random.default_rng(1)
    only = [image_sample(rng)] if kind == "image" else [text_sample(rng, 12)]
    model = _model(mtp=True)
    loss, parts = model.loss(_batch(_row(only)))
    loss.backward()
    assert float(parts["count_audio"]) == 0
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert missing == []
    assert all(float(p.grad.abs().sum()) == 0 for p in model.level_heads.parameters())
