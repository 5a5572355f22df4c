"""Long-lived tokenizer services (Ray Serve, `tokenloom pools`): HTTP tokenize equals the ingestion
job's tokens for the same file, bad requests get 413/400 and never reach a replica as a crash,
`pools scale` changes the bounds `pools status` reports, and `ingest --pools service` commits
exactly what a job's own pools commit. Runs on the test session's Ray runtime."""

from __future__ import annotations

import math
import shutil
import socket
from pathlib import Path

import pytest
import requests
import soundfile as sf
import torch

pytestmark = [pytest.mark.integration, pytest.mark.long]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def services(tmp_path_factory, text_bundle):
    from tokenloom.jobs import pools
    from tokenloom.jobs.config import RunConfig
    from tokenloom.jobs.home import Home
    from tokenloom.jobs.ingest import ingest
    from tokenloom.samples.audio import write_sample_audio
    from tokenloom.samples.images import write_sample_images
    from tokenloom.tokenizers.audio import AudioTokenizer, AudioTokenizerConfig
    from tokenloom.tokenizers.audio import publish_bundle as publish_audio
    from tokenloom.tokenizers.visual import VisualTokenizer, VisualTokenizerConfig
    from tokenloom.tokenizers.visual.train import publish_bundle as publish_visual

    root = tmp_path_factory.mktemp("services")
    home = Home(root / "home")
    inputs = root / "inputs"
    write_sample_images(inputs / "images", with_bad_inputs=False, variants=0)
    write_sample_audio(inputs / "audio", with_bad_inputs=False, utterances=2)
    (inputs / "notes.txt").write_text("A plain text document for the tokenizer services.\n")
    cfg = RunConfig()
    cfg.visual_tokenizer = VisualTokenizerConfig(channels=8, latent_channels=16, vit_dim=16, vit_depth=1,
                                                 vit_heads=2, fusion_heads=2, max_pixels=64 * 64)
    cfg.audio_tokenizer = AudioTokenizerConfig(channels=8, max_channels=32, latent_dim=16, levels=2,
                                               codebook_size=32, code_dim=4, chunk_seconds=2.0)
    torch.manual_seed(0)
    visual = VisualTokenizer(cfg.visual_tokenizer)
    visual.init_codebook(torch.rand(64, 3, 32, 32))
    publish_visual(visual.eval(), home.bundles)
    audio = AudioTokenizer(cfg.audio_tokenizer)
    audio.init_codebook(torch.randn(4, 1, 8000) * 0.1)
    publish_audio(audio.eval(), home.bundles)
    shutil.copytree(text_bundle.path, home.bundles / text_bundle.id)
    cfg.ingest.ray.progress_bars = False
    cfg.ingest.dedup.enabled = False
    job = ingest(home, [inputs], "media", cfg)  # the job's own pools (the session's Ray)
    cfg.ingest.service.port = _free_port()
    cfg.ingest.service.max_request_bytes = {"text": 4096, "image": 1 << 20, "audio": 4 << 20}
    status = pools.up(home, cfg, dataset="media")
    try:
        yield home, cfg, inputs, job, status
    finally:
        pools.down(home, cfg)


def _job_rows(home, cfg, dataset: str) -> dict[str, dict]:
    from tokenloom.jobs.home import open_catalog

    rows = open_catalog(home, cfg).scan(dataset, columns=("sample_id", "source", "tokens", "segments")).to_pylist()
    return {r["source"]: r for r in rows}


def test_services_come_up_with_their_labels_and_bounds(services):
    _, _, _, _, status = services
    assert status["application"].endswith("RUNNING")
    for name, label in (("text", "text_pool"), ("image", "image_pool"), ("audio", "audio_pool")):
        svc = status["services"][name]
        assert svc["label"] == label and svc["status"].endswith("HEALTHY")
        assert svc["min_replicas"] == 1 and svc["max_replicas"] >= 1
        assert sum(svc["replicas"].values()) >= 1


def test_http_tokenize_equals_the_ingestion_jobs_tokens_for_the_same_file(services):
    """A real HTTP client against the gateway; the record is named as the job named it (source, "file")."""
    home, cfg, inputs, _, _ = services
    url = f"http://127.0.0.1:{cfg.ingest.service.port}"
    rows = _job_rows(home, cfg, "media")
    text = inputs / "notes.txt"
    got = requests.post(f"{url}/tokenize/text", json={"text": text.read_text()},
                        params={"source": str(text), "record": "file"}, timeout=120).json()
    assert got["ids"] == rows[str(text)]["tokens"] and got["sample_id"] == rows[str(text)]["sample_id"]
    image = next(p for p in sorted((inputs / "images").iterdir()) if p.suffix == ".png" and p.with_suffix(".txt").exists())
    got = requests.post(f"{url}/tokenize/image", data=image.read_bytes(), timeout=120,
                        params={"source": str(image), "record": "file", "text": image.with_suffix(".txt").read_text()})
    assert got.status_code == 200, got.text
    assert got.json()["ids"] == rows[str(image)]["tokens"] and got.json()["segments"] == rows[str(image)]["segments"]
    clip = next(p for p in sorted((inputs / "audio").iterdir()) if p.suffix == ".wav" and p.with_suffix(".txt").exists())
    got = requests.post(f"{url}/tokenize/audio", data=clip.read_bytes(), timeout=120,
                        params={"source": str(clip), "record": "file", "text": clip.with_suffix(".txt").read_text()})
    assert got.status_code == 200, got.text
    assert got.json()["ids"] == rows[str(clip)]["tokens"]
    frames = sf.info(clip).frames * 50 // sf.info(clip).samplerate
    assert abs(next(s for s in got.json()["segments"] if s["modality"] == "audio")["grid"][0] - frames) <= 2
    # and back: the text answer detokenizes to the document
    back = requests.post(f"{url}/detokenize/text", json={"ids": rows[str(text)]["tokens"],
                                                          "segments": rows[str(text)]["segments"]}, timeout=120)
    assert back.json()["text"] == [text.read_text()]


def test_bad_requests_get_413_or_400_and_the_services_stay_up(services):
    home, cfg, _, _, _ = services
    url = f"http://127.0.0.1:{cfg.ingest.service.port}"
    too_big = requests.post(f"{url}/tokenize/text", json={"text": "x" * 5000}, timeout=60)
    assert too_big.status_code == 413 and "limit of 4096 bytes" in too_big.json()["error"]
    assert requests.post(f"{url}/tokenize/text", data=b"{not json", timeout=60).status_code == 400
    assert requests.post(f"{url}/tokenize/text", json={"txt": "wrong field"}, timeout=60).status_code == 400
    broken = requests.post(f"{url}/tokenize/image", data=b"\x89PNG\r\n\x1a\n truncated", timeout=120)
    assert broken.status_code == 400 and "image" in broken.json()["error"]
    assert requests.post(f"{url}/tokenize/audio", data=b"RIFF....not a wav", timeout=120).status_code == 400
    assert requests.post(f"{url}/tokenize/video", data=b"x", timeout=60).status_code == 404
    assert requests.get(f"{url}/tokenize/text", timeout=60).status_code == 405
    ok = requests.post(f"{url}/tokenize/text", json={"text": "still here"}, timeout=60)  # nothing crashed
    assert ok.status_code == 200 and len(ok.json()["ids"]) > 2
    # a valid image the quality filters drop (one flat grey) makes no sample: 422 with the filter, and
    # a job's client (generate --pools service) gets that reason as its one-line error
    import io

    import numpy as np
    from PIL import Image

    from tokenloom.jobs.pools import load_state
    from tokenloom.platform.services import ServiceClient, ServiceError

    flat = io.BytesIO()
    Image.fromarray(np.full((64, 64, 3), 128, dtype=np.uint8)).save(flat, format="PNG")
    dropped = requests.post(f"{url}/tokenize/image", data=flat.getvalue(), timeout=120)
    assert dropped.status_code == 422 and "quality filter" in dropped.json()["error"], dropped.text
    client = ServiceClient(url, load_state(home)["defaults"]["text"]["vocab"])
    with pytest.raises(ServiceError, match=r"refused the request \(422\): dropped by the quality filter"):
        client.parts("image", flat.getvalue())


def test_scale_changes_the_bounds_status_reports(services):
    from tokenloom.jobs import pools

    home, cfg, _, _, _ = services
    scaled = pools.scale(home, cfg, "text", 2, 3)
    assert (scaled["services"]["text"]["min_replicas"], scaled["services"]["text"]["max_replicas"]) == (2, 3)
    again = pools.status(home, cfg)
    assert (again["services"]["text"]["min_replicas"], again["services"]["text"]["max_replicas"]) == (2, 3)
    assert again["services"]["image"]["min_replicas"] == 1  # the others keep theirs
    with pytest.raises(ValueError, match="--min"):
        pools.scale(home, cfg, "text", 3, 2)


def test_ingest_through_the_services_commits_what_the_jobs_own_pools_commit(services):
    from tokenloom.jobs.ingest import ingest

    home, cfg, inputs, job, _ = services
    cfg.ingest.pools_mode = "service"
    try:
        result = ingest(home, [inputs], "media-via-service", cfg)
    finally:
        cfg.ingest.pools_mode = "job"
    assert {m: p["mode"] for m, p in result.pools.items()} == {"text": "service", "image": "service",
                                                               "audio": "service"}
    assert (result.samples, result.tokens, result.quarantined) == (job.samples, job.tokens, job.quarantined)
    mine, theirs = _job_rows(home, cfg, "media-via-service"), _job_rows(home, cfg, "media")
    assert {s: r["tokens"] for s, r in mine.items()} == {s: r["tokens"] for s, r in theirs.items()}


def _model_on_services_manifest(home, out):
    """A tiny random model whose manifest is the services' (the dataset's): (folder, manifest)."""
    from tokenloom.jobs.pools import load_state
    from tokenloom.model.config import ModelConfig, MoEConfig
    from tokenloom.model.io import save_model
    from tokenloom.model.unified import UnifiedModel
    from tokenloom.tokenizers.vocab import VocabManifest

    vocab = VocabManifest.from_dict(load_state(home)["defaults"]["text"]["vocab"])
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab.size, audio_ranges=tuple((r.start, r.stop) for r in vocab.audio), dim=32,
                      n_layers=1, n_heads=2, max_seq_len=2048, moe=MoEConfig(n_experts=2, top_k=1, expert_hidden=16))
    return save_model(UnifiedModel(cfg).state_dict(), cfg, out, {"vocab": vocab.to_dict()}), vocab


def test_generate_through_the_services_equals_generate_with_its_own_tokenizers(services, tmp_path):
    """A model whose manifest is the services' (the dataset's): a prompt of an image, an audio clip
    and text, tokenized by the services, gives the same prompt positions and greedy ids as the same
    prompt tokenized in-process; a model trained on other bundles is refused with the reason."""
    import json

    from tokenloom.jobs.generate import generate

    home, _, inputs, _, _ = services
    folder, vocab = _model_on_services_manifest(home, tmp_path / "model")
    image = next(p for p in sorted((inputs / "images").iterdir()) if p.suffix == ".png")
    clip = next(p for p in sorted((inputs / "audio").iterdir()) if p.suffix == ".wav")
    ask = {"prompt": "Describe what you see and hear.", "image": image, "audio": clip, "temperature": 0.0,
           "max_new_tokens": 6}
    local = generate(home, folder, "text", **ask)
    served = generate(home, folder, "text", pools="service", **ask)
    assert served["pools"] == "service" and served["prompt_positions"] == local["prompt_positions"] > 20
    assert served["ids"] == local["ids"]
    other = {**vocab.to_dict(), "bundles": {**vocab.bundles, "text": "text-0000000000"}}
    (folder / "model.json").write_text(json.dumps({**json.loads((folder / "model.json").read_text()), "vocab": other}))
    with pytest.raises(ValueError, match="tokenize text with bundle"):
        generate(home, folder, "text", pools="service", **ask)


def test_batch_routes_encode_and_decode_as_the_bundle_does_in_process(services):
    """`{"texts": [...]}` and `{"batch": [...]}` answer each item as its own request would, in order;
    `ServiceClient.encode_texts`/`decode_texts` equal the services' text bundle run in-process."""
    from tokenloom.jobs.pools import load_state
    from tokenloom.platform.services import ServiceClient
    from tokenloom.tokenizers.text import TextTokenizer

    home, cfg, _, _, _ = services
    url = f"http://127.0.0.1:{cfg.ingest.service.port}"
    defaults = load_state(home)["defaults"]["text"]
    client = ServiceClient(url, defaults["vocab"])
    tok = TextTokenizer.load(defaults["bundle_paths"]["text"])
    texts = ["sort 3 1 2 =", " 1 2 3", "add 12+7 =", "  spaces, ünïcode and\nlines  "]
    assert client.encode_texts(texts) == [list(tok.encode(t)) for t in texts]
    ids = [list(tok.encode(t)) for t in texts] + [[]]
    assert client.decode_texts(ids) == [tok.decode(i) for i in ids]
    many = requests.post(f"{url}/tokenize/text", json={"texts": texts[:2]}, timeout=120).json()["samples"]
    one = [requests.post(f"{url}/tokenize/text", json={"text": t}, timeout=120).json() for t in texts[:2]]
    assert [s["ids"] for s in many] == [s["ids"] for s in one] and len({s["sample_id"] for s in many}) == 2
    for body in ({"texts": []}, {"texts": ["fine", 3]}, {"texts": "not a list"}, {"batch": [{"nope": 1}]}):
        route = "detokenize" if "batch" in body else "tokenize"
        answer = requests.post(f"{url}/{route}/text", json=body, timeout=120)
        assert answer.status_code == 400 and answer.json()["error"], body


def test_rl_through_the_services_equals_rl_with_its_own_tokenizer(services, tmp_path):
    """RL whose prompts are encoded and replies decoded by the text service (`rl --pools service`,
    one request per round) is the run the model's own text bundle gives: every record the same;
    a model on another text bundle is refused."""
    import json

    from tokenloom.jobs.config import RunConfig
    from tokenloom.jobs.rl import rl

    home, _, _, _, _ = services
    folder, _ = _model_on_services_manifest(home, tmp_path / "model")
    cfg = RunConfig()
    for key, value in dict(task="sort", buckets="0,1", batch_queries=2, group_size=3, oversample=2, round_tokens=3,
                           max_response_tokens=6, steps=3, rollout_actors=0, eval_every=0, eval_queries=2,
                           checkpoint_every=0).items():
        setattr(cfg.rl, key, value)
    local = rl(home, folder, cfg, run_name="rl-local", progress=False)
    served = rl(home, folder, cfg, run_name="rl-served", progress=False, pools="service")
    assert served["pools"] == "service" and served["steps"] == local["steps"] == 3

    def records(doc):
        timing = ("seconds", "busy", "time")
        return [{k: v for k, v in json.loads(line).items() if not any(t in k for t in timing)}
                for line in (Path(doc["run_dir"]) / "metrics.jsonl").read_text().splitlines()]

    mine, theirs = records(served), records(local)
    assert len(mine) == len(theirs) >= 3
    for x, y in zip(mine, theirs, strict=True):  # the same tokens, queries and counts; floats to rounding
        assert x.keys() == y.keys()
        for k in x:
            assert math.isclose(x[k], y[k], rel_tol=1e-6, abs_tol=1e-6) if isinstance(x[k], float) else x[k] == y[k], k
    assert served["pass_at_1"] == local["pass_at_1"]
    # services that hold another text bundle than the model's are refused before anything runs
    from tokenloom.jobs.pools import _state_path

    path = _state_path(home)
    kept = path.read_text()
    state = json.loads(kept)
    state["defaults"]["text"]["vocab"]["bundles"]["text"] = "text-0000000000"
    try:
        path.write_text(json.dumps(state))
        with pytest.raises(ValueError, match="tokenize text with bundle text-0000000000"):
            rl(home, folder, cfg, run_name="rl-refused", progress=False, pools="service")
    finally:
        path.write_text(kept)
