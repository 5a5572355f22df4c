"""Long-lived tokenizer services on Ray Serve: one deployment per modality, and an HTTP gateway.

Why services. A job's actor pool starts its actors (and loads its tokenizers) per job; a service
keeps replicas warm between jobs, scales them with load, and answers other clients too: the HTTP
gateway for anyone, `ingest --pools service` for ingestion jobs (they call the deployments through
Serve handles instead of starting actors), `generate` and RL rollouts for prompts (`ServiceClient`).

- `TokenizerService` (deployments `text`, `image`, `audio` of the application `tokenizers`):
  each replica holds the modality's pool worker (`platform/workers.py`, the same code a job's
  actors run, so a service's rows equal a job's), built for the worker arguments it is asked with
  (the job's bundles and manifest) and kept for the next call; the replicas carry the pool's
  resource label and scale between `min_replicas` and `max_replicas` on ongoing requests.
- `Gateway` (route `/`): `POST /tokenize/{text,image,audio}` and `POST /detokenize/{...}` on
  127.0.0.1 (`ingest.service.host`). Bodies are bounded per modality before they are read whole
  (413), malformed ones get 400 with the reason, and a record the worker rejects (a corrupt image)
  gets 400 with the worker's quarantine reason: a bad request never reaches a replica as a crash.

Tokenize bodies: text, `{"text": "..."}` (or `{"texts": [...]}`: a batch in one request, answered
as `{"samples": [...]}` in order); image and audio, the file's bytes, with the caption or
transcript as the `text` query parameter. `source` and `record` (query) name the record as an
ingestion job would (`source` the file's path, `record` "file"), so its sample id, and with it the
text-first layout choice, is the job's: the ids then equal the job's for the same file. The
answer is the shard contract: `{"sample_id", "ids", "segments"}`. Detokenize bodies are that
answer's `{"ids", "segments"}` (or `{"batch": [...]}` of them, answered as `{"batch": [...]}`); the
answer lists the parts: text as strings, images as base64
PNG, audio as base64 WAV (16-bit, the bundle's rate).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import tempfile
from dataclasses import dataclass, field

import pyarrow as pa

APP = "tokenizers"
MODALITIES = ("text", "image", "audio")


@dataclass
class ServiceConfig:
    """`[ingest.service]`: the long-lived tokenizer services (`tokenloom pools up`)."""

    host: str = "127.0.0.1"  # where the HTTP gateway listens; 127.0.0.1 unless configured otherwise
    port: int = 8700
    # replicas per modality: text scales from 1 to as many as the cluster's CPUs allow (0 = that)
    min_replicas: dict[str, int] = field(default_factory=lambda: {"text": 1, "image": 1, "audio": 1})
    max_replicas: dict[str, int] = field(default_factory=lambda: {"text": 0, "image": 2, "audio": 2})
    target_ongoing_requests: float = 2.0  # the autoscaler adds a replica above this load per replica
    # how long a load must last before the autoscaler adds (removes) replicas; Serve's defaults
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    num_cpus: float = 0.5  # per replica
    # the largest request body per modality (bytes): a larger one is refused with 413
    max_request_bytes: dict[str, int] = field(default_factory=lambda: {
        "text": 1 << 20, "image": 16 << 20, "audio": 32 << 20})

    def validate(self) -> None:
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError("ingest.service: upscale_delay_s and downscale_delay_s must be >= 0")
        for m in MODALITIES:
            lo, hi = self.min_replicas.get(m, 1), self.max_replicas.get(m, 0)
            if lo < 0 or (hi and hi < max(lo, 1)):
                raise ValueError(f"ingest.service: {m} replicas must satisfy 0 <= min <= max (max 0: the cluster's "
                                 f"CPUs), got {lo}..{hi}")


def autoscaling(cfg: ServiceConfig, modality: str, cluster_cpus: float) -> dict:
    """Serve's `autoscaling_config` of a modality's deployment."""
    lo = cfg.min_replicas.get(modality, 1)
    hi = cfg.max_replicas.get(modality, 0) or max(1, int(cluster_cpus / max(cfg.num_cpus, 1e-9)))
    return {"min_replicas": lo, "max_replicas": max(hi, lo, 1), "target_ongoing_requests": cfg.target_ongoing_requests,
            "upscale_delay_s": cfg.upscale_delay_s, "downscale_delay_s": cfg.downscale_delay_s}


class TokenizerService:
    """One modality's replicas (see the module docstring); `defaults`: the worker arguments HTTP
    requests are tokenized with."""

    def __init__(self, modality: str, defaults: dict):
        from tokenloom.platform.pools import worker_for

        self.modality, self.defaults = modality, defaults
        self._decoders: dict | None = None
        worker_for(modality, defaults)  # warm: the tokenizer is loaded before the first request

    def tokenize(self, batch: pa.Table, worker_kwargs: dict | None = None) -> pa.Table:
        from tokenloom.platform.pools import tokenize_batch

        if self.modality == "audio" and batch.column("blob").null_count < batch.num_rows:  # bytes (HTTP), not paths
            return self._tokenize_audio_bytes(batch, worker_kwargs)
        return tokenize_batch(batch, self.modality, worker_kwargs or self.defaults)

    def _tokenize_audio_bytes(self, batch: pa.Table, worker_kwargs: dict | None) -> pa.Table:
        """Audio sent as bytes (HTTP): written to a file of this replica, which the worker reads in blocks."""
        from tokenloom.platform.pools import tokenize_batch

        blobs, paths = batch.column("blob").to_pylist(), []
        try:
            for blob in blobs:
                fd, path = tempfile.mkstemp(suffix=".audio")
                with os.fdopen(fd, "wb") as f:
                    f.write(blob or b"")
                paths.append(path)
            media = pa.array(paths, pa.string())
            batch = batch.set_column(batch.schema.get_field_index("media"), "media", media)
            batch = batch.set_column(batch.schema.get_field_index("blob"), "blob", pa.nulls(len(paths), pa.large_binary()))
            return tokenize_batch(batch, "audio", worker_kwargs or self.defaults)
        finally:
            for path in paths:
                os.unlink(path)

    def detokenize(self, ids: list[int], segments: list[dict]) -> dict:
        import numpy as np

        from tokenloom.tokenizers.sequence import ImagePart, SampleLayout, TextPart
        from tokenloom.tokenizers.vocab import VocabManifest

        vocab = VocabManifest.from_dict(self.defaults["vocab"])
        parts = SampleLayout(vocab).disassemble(np.asarray(ids, dtype=np.int64), segments)
        decode = self._decoder()
        out: dict = {"text": [], "images": [], "audio": []}
        for part in parts:
            kind = "text" if isinstance(part, TextPart) else "images" if isinstance(part, ImagePart) else "audio"
            if kind not in decode:
                raise ValueError(f"the {self.modality} service cannot decode {kind} parts")
            out[kind].append(decode[kind](part))
        return out

    def detokenize_many(self, samples: list[tuple[list[int], list[dict]]]) -> list[dict]:
        """`detokenize` of each (ids, segments), in order: a batch in one request."""
        return [self.detokenize(ids, segments) for ids, segments in samples]

    def _decoder(self) -> dict:
        if self._decoders is not None:
            return self._decoders
        import numpy as np
        import soundfile as sf
        import torch
        from PIL import Image

        from tokenloom.tokenizers.text import TextTokenizer

        paths = self.defaults["bundle_paths"]
        text = TextTokenizer.load(paths["text"])
        decoders = {"text": lambda part: text.decode(part.ids.tolist())}
        if "visual" in paths:
            from tokenloom.tokenizers.visual import load_visual, to_pixels

            visual = load_visual(paths["visual"]).eval()

            def image(part) -> str:
                with torch.no_grad():
                    pixels = to_pixels(visual.decode(torch.from_numpy(np.asarray(part.codes))[None])[0])
                buffer = io.BytesIO()
                Image.fromarray(pixels).save(buffer, format="PNG")
                return base64.b64encode(buffer.getvalue()).decode()

            decoders["images"] = image
        if "audio" in paths:
            from tokenloom.tokenizers.audio import load_audio

            audio = load_audio(paths["audio"]).eval()

            def speech(part) -> str:
                with torch.no_grad():
                    wav = audio.decode(torch.from_numpy(np.asarray(part.codes))[None])[0, 0].clamp(-1, 1).numpy()
                buffer = io.BytesIO()
                sf.write(buffer, wav, audio.cfg.sample_rate, format="WAV", subtype="PCM_16")
                return base64.b64encode(buffer.getvalue()).decode()

            decoders["audio"] = speech
        self._decoders = decoders
        return decoders


def http_records(modality: str, body: bytes, query: dict[str, str]) -> tuple[pa.Table, bool]:
    """A request body as parsed records (`platform.ingest.RECORD_SCHEMA`), as a job's read step
    makes them, and whether the body was a batch (`{"texts": [...]}`); ValueError (a 400) when the
    body cannot be one."""
    from tokenloom.datasets import sources
    from tokenloom.platform.ingest import RECORD_SCHEMA

    source = query.get("source") or "http"
    record = query.get("record") or hashlib.sha256(body).hexdigest()[:16]
    sid = sources.sample_id(source, record)
    row = {"sample_id": sid, "source": source, "record": record, "modality": modality, "payload": None,
           "error": None, "blob": None, "media": None}
    if modality == "text":
        try:
            doc = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"the body is not JSON: {exc}") from None
        if isinstance(doc, dict) and "texts" in doc:  # a batch: a record per text, named by its position
            texts = doc["texts"]
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t.strip() for t in texts):
                raise ValueError('the body must be {"texts": [<non-empty strings>, ...]}')
            return pa.Table.from_pylist([{**row, "sample_id": sources.sample_id(source, f"{record}:{k}"),
                                          "record": f"{record}:{k}", "payload": t} for k, t in enumerate(texts)],
                                        schema=RECORD_SCHEMA), True
        if not isinstance(doc, dict) or not isinstance(doc.get("text"), str) or not doc["text"].strip():
            raise ValueError('the body must be {"text": "<a non-empty string>"} or {"texts": [...]}')
        row["payload"] = doc["text"]
    else:
        if not body:
            raise ValueError(f"the body must be the {modality} file's bytes, got none")
        row["payload"] = (query.get("text") or "").strip() or None  # as a caption sidecar is read
        row["blob"] = body  # audio: the service writes it to a file its worker reads
    return pa.Table.from_pylist([row], schema=RECORD_SCHEMA), False


class Gateway:
    """The HTTP routes (see the module docstring) in front of the modality deployments."""

    def __init__(self, handles: dict, max_request_bytes: dict[str, int]):
        self.handles, self.limits = handles, max_request_bytes

    async def __call__(self, request):
        from starlette.responses import JSONResponse

        parts = request.url.path.strip("/").split("/")
        if len(parts) != 2 or parts[0] not in ("tokenize", "detokenize") or parts[1] not in MODALITIES:
            return JSONResponse({"error": f"no route {request.url.path}: POST /tokenize/{{text,image,audio}} or "
                                          "/detokenize/{text,image,audio}"}, status_code=404)
        action, modality = parts
        if request.method != "POST":
            return JSONResponse({"error": "use POST"}, status_code=405)
        handle = self.handles.get(modality)
        if handle is None:
            return JSONResponse({"error": f"no {modality} service is up (its bundle is missing)"}, status_code=503)
        limit = self.limits.get(modality, 1 << 20) if action == "tokenize" else 64 << 20
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return JSONResponse({"error": f"request body of {declared} bytes exceeds the {modality} limit of "
                                          f"{limit} bytes"}, status_code=413)
        body = b""
        async for chunk in request.stream():  # counted as it arrives: a body without a length is bounded too
            body += chunk
            if len(body) > limit:
                return JSONResponse({"error": f"request body exceeds the {modality} limit of {limit} bytes"},
                                    status_code=413)
        try:
            if action == "detokenize":
                doc = json.loads(body)
                if isinstance(doc, dict) and isinstance(doc.get("batch"), list):  # many samples, one call
                    for k, item in enumerate(doc["batch"]):
                        if not isinstance(item, dict) or not isinstance(item.get("ids"), list):
                            raise ValueError(f'batch item {k} must be {{"ids": [...], "segments": [...]}}')
                    return JSONResponse({"batch": await handle.detokenize_many.remote(
                        [(item["ids"], item.get("segments") or []) for item in doc["batch"]])})
                if not isinstance(doc, dict) or not isinstance(doc.get("ids"), list):
                    raise ValueError('the body must be {"ids": [...], "segments": [...]} or {"batch": [...]}')
                return JSONResponse(await handle.detokenize.remote(doc["ids"], doc.get("segments") or []))
            batch, many = http_records(modality, body, dict(request.query_params))
        except (ValueError, json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        if many:  # {"texts": [...]}: each text's sample, in order
            rows = (await handle.tokenize.remote(batch)).to_pylist()
            bad = next((k for k, r in enumerate(rows) if r["error"] is not None or r["tokens"] is None), None)
            if bad is not None:
                reason = rows[bad]["error"] or f"dropped by the quality filter {rows[bad]['filter']}"
                return JSONResponse({"error": f"text {bad}: {reason}"}, status_code=400)
            return JSONResponse({"samples": [{"sample_id": r["sample_id"], "ids": r["tokens"], "segments": r["segments"]}
                                             for r in rows]})
        out = (await handle.tokenize.remote(batch)).to_pylist()[0]
        if out["error"] is not None:
            return JSONResponse({"error": out["error"], "sample_id": out["sample_id"]}, status_code=400)
        if out["tokens"] is None:  # a valid record a quality filter dropped (as a job would): no sample
            return JSONResponse({"error": f"dropped by the quality filter {out['filter']}: {out['filter_reason']}",
                                 "sample_id": out["sample_id"]}, status_code=422)
        return JSONResponse({"sample_id": out["sample_id"], "ids": out["tokens"], "segments": out["segments"]})


def application(defaults: dict[str, dict], labels: dict[str, str], cfg: ServiceConfig, cluster_cpus: float,
                bounds: dict[str, tuple[int, int]] | None = None):
    """The Serve application: a deployment per modality in `defaults` (their worker arguments) and
    the gateway. `bounds` overrides a modality's (min, max) replicas (`pools scale`)."""
    from ray import serve

    handles = {}
    for modality, kwargs in sorted(defaults.items()):
        scale = autoscaling(cfg, modality, cluster_cpus)
        if bounds and modality in bounds:
            scale.update(min_replicas=bounds[modality][0], max_replicas=bounds[modality][1])
        options = {"num_cpus": cfg.num_cpus}
        if labels.get(modality):
            options["resources"] = {labels[modality]: 1}
        handles[modality] = serve.deployment(TokenizerService, name=modality, autoscaling_config=scale,
                                             ray_actor_options=options, max_ongoing_requests=8).bind(modality, kwargs)
    gateway = serve.deployment(Gateway, name="gateway", num_replicas=1, ray_actor_options={"num_cpus": 0.1})
    return gateway.bind(handles, cfg.max_request_bytes)


class ServiceError(ValueError):
    """A tokenizer service could not be reached or refused a request (one line, with the reason)."""


class ServiceClient:
    """The HTTP gateway as a job calls it (`generate --pools service`, RL rollouts): a record in,
    its parts out, in tokenizer-local ids (`tokenizers.sequence`), so the caller lays them out in
    its own vocabulary. `vocab` is the manifest the services answer with (`pools.json`)."""

    def __init__(self, url: str, vocab: dict, timeout_s: float = 300.0):
        from tokenloom.tokenizers.vocab import VocabManifest

        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.vocab = VocabManifest.from_dict(vocab)

    def _post(self, path: str, body: bytes, what: str, query: dict[str, str] | None = None) -> dict:
        """`POST {url}/{path}` -> the JSON answer; ServiceError (one line) when refused or unreachable."""
        import urllib.error
        import urllib.parse
        import urllib.request

        url = f"{self.url}/{path}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
        request = urllib.request.Request(url, data=body, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = response.read()
        except urllib.error.HTTPError as exc:
            raise ServiceError(f"the {what} service refused the request ({exc.code}): "
                               f"{_error_of(exc.read())}") from None
        except OSError as exc:
            raise ServiceError(f"the tokenizer services at {self.url} do not answer ({exc}): run `tokenloom pools "
                               "up`, or run without --pools service") from None
        try:
            doc = json.loads(answer)
        except (json.JSONDecodeError, UnicodeDecodeError):
            doc = None
        if not isinstance(doc, dict):
            raise ServiceError(f"the {what} service answered something that is not JSON: {answer[:200]!r}")
        return doc

    def tokenize(self, modality: str, body: bytes, query: dict[str, str] | None = None) -> tuple[list[int], list[dict]]:
        """`POST /tokenize/{modality}`: the sample's ids and segments in the services' manifest."""
        doc = self._post(f"tokenize/{modality}", body, modality, query)
        try:
            ids, segments = doc["ids"], doc["segments"]
        except KeyError:
            raise ServiceError(f"the {modality} service answered something that is not a tokenized sample: "
                               f"{str(doc)[:200]}") from None
        if ids is None:
            raise ServiceError(f"the {modality} service made no sample of the record") from None
        return ids, segments

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids in the text tokenizer's own (local) ids, from one `/tokenize/text` batch;
        what the services' bundle encodes in-process, without the sample's <bos>/<eos>."""
        import numpy as np

        from tokenloom.tokenizers.sequence import SampleLayout, TextPart

        if not texts:
            return []
        doc = self._post("tokenize/text", json.dumps({"texts": list(texts)}).encode(), "text")
        samples = doc.get("samples")
        if not isinstance(samples, list) or len(samples) != len(texts):
            raise ServiceError(f"the text service answered {str(doc)[:200]} for {len(texts)} texts")
        layout, out = SampleLayout(self.vocab), []
        for sample in samples:
            parts = layout.disassemble(np.asarray(sample["ids"], dtype=np.int64), sample["segments"])
            out.append([int(i) for p in parts if isinstance(p, TextPart) for i in p.ids])
        return out

    def decode_texts(self, ids: list[list[int]]) -> list[str]:
        """Each list of local text ids as text, from one `/detokenize/text` batch (the services'
        bundle decodes it)."""
        import numpy as np

        from tokenloom.tokenizers.sequence import SampleLayout, TextPart

        if not ids:
            return []
        layout, batch = SampleLayout(self.vocab), []
        for local in ids:
            tokens, segments = layout.assemble([TextPart(np.asarray(local, dtype=np.int64))])
            batch.append({"ids": [int(t) for t in tokens], "segments": segments})
        doc = self._post("detokenize/text", json.dumps({"batch": batch}).encode(), "text")
        answers = doc.get("batch")
        if not isinstance(answers, list) or len(answers) != len(ids):
            raise ServiceError(f"the text service answered {str(doc)[:200]} for {len(ids)} samples")
        return ["".join(a.get("text") or []) for a in answers]

    def parts(self, modality: str, body: bytes, query: dict[str, str] | None = None) -> list:
        """The record's parts (`ImagePart`, `AudioPart`, `TextPart`) in tokenizer-local ids."""
        import numpy as np

        from tokenloom.tokenizers.sequence import SampleLayout

        ids, segments = self.tokenize(modality, body, query)
        return SampleLayout(self.vocab).disassemble(np.asarray(ids, dtype=np.int64), segments)


def _error_of(body: bytes) -> str:
    """The `error` of a gateway's JSON error answer, else the body's start."""
    try:
        return str(json.loads(body)["error"])
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError):
        return body[:200].decode(errors="replace")
