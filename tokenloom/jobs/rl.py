"""RL post-training job: a trained model and a verifiable task -> `trainer.rl` -> a run folder.

The model folder names its token space (the manifest `model.json` carries, as for `generate`); the
task's prompts and answers go through the manifest's own text tokenizer, so the RL run reads ids
the way the model was trained to: in this process, or (`pools="service"`) through the long-lived
text service holding that bundle, a round's prompts or replies in one request. Rollout actors run on the local Ray (or `ingest.ray.address`).

`task_data` writes a task's supervised records (a `.jsonl` of `{"text": prompt + answer}`) for the
SFT start: ingest them into a dataset and `tokenloom train`/`finetune` on it, then `tokenloom rl`.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from tokenloom.jobs.home import Home, code_version, model_folder


def task_data(task_name: str, out: Path, records: int, buckets: str = "", seed: int = 0) -> dict:
    """Write `records` supervised lines of a task's buckets to `out/<task>.jsonl`."""
    from tokenloom.trainer.rl.tasks import get_task, parse_buckets, sft_records

    task = get_task(task_name)
    chosen = parse_buckets(task, buckets)
    if records < 1:
        raise ValueError(f"--records must be >= 1, got {records}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{task.name}.jsonl"
    rows = sft_records(task, records, chosen, seed)
    path.write_text("".join(json.dumps({"text": r["text"]}) + "\n" for r in rows))
    return {"task": task.name, "path": str(path), "records": len(rows),
            "buckets": [task.buckets[b] for b in chosen]}


def rl(home: Home, source: str | Path, cfg, run_name: str | None = None, resume_from: str | Path | None = None,
       progress: bool = True, pools: str = "local") -> dict:
    """Post-train the model at `source` (a model folder or run) on `cfg.rl.task`; or resume a run.
    `pools`: "local" encodes prompts and decodes replies with the model's text bundle in this
    process, "service" through the long-lived text service (`tokenloom pools up`), which must hold
    the same bundle: one request per round of replies."""
    from tokenloom.jobs.generate import Generator
    from tokenloom.jobs.train import generation_facts, resume_point
    from tokenloom.model.io import annotate_model
    from tokenloom.trainer.rl.loop import TextCodec, run_rl
    from tokenloom.trainer.rl.tasks import get_task, parse_buckets

    cfg.rl.validate()
    parse_buckets(get_task(cfg.rl.task), cfg.rl.buckets)  # a wrong task or bucket fails before anything loads
    path = Path(source)
    if len(path.parts) == 1 and (home.runs / path).is_dir():
        path = home.runs / path
    gen = Generator.load(home, model_folder(path))
    text = gen.tokenizer("text")
    offset, stop = gen.vocab.text.start, gen.vocab.text.stop

    def encode(s: str) -> list[int]:
        return [i + offset for i in text.encode(s)]

    def decode(ids: list[int]) -> str:
        return text.decode([i - offset for i in ids if offset <= i < stop])

    if pools not in ("local", "service"):
        raise ValueError(f"--pools must be local or service, got {pools!r}")
    codec = TextCodec(encode, decode)
    if pools == "service":
        from tokenloom.jobs.pools import load_state
        from tokenloom.platform.services import ServiceClient

        state = load_state(home)
        services = ServiceClient(state["http"], next(iter(state["defaults"].values()))["vocab"])
        if services.vocab.bundles.get("text") != gen.vocab.bundles.get("text"):
            raise ValueError(f"the tokenizer services tokenize text with bundle {services.vocab.bundles.get('text')}, "
                             f"the model was trained on {gen.vocab.bundles.get('text')}: run `tokenloom pools up "
                             "--dataset` with the model's dataset, or run rl without --pools service")

        def encode_batch(texts: list[str]) -> list[list[int]]:
            return [[i + offset for i in ids] for ids in services.encode_texts(texts)]

        def decode_batch(batch: list[list[int]]) -> list[str]:
            return services.decode_texts([[i - offset for i in ids if offset <= i < stop] for ids in batch])

        codec = TextCodec(lambda s: encode_batch([s])[0], lambda ids: decode_batch([ids])[0], encode_batch,
                          decode_batch)

    checkpoint = resume_point(home, resume_from) if resume_from is not None else None
    if checkpoint is not None and checkpoint.parent.name == "checkpoint":
        run_dir = checkpoint.parent.parent
    else:
        if run_name is not None and (home.runs / run_name).exists():
            raise ValueError(f"run {run_name!r} already exists in {home.runs}; continue it with --resume {run_name} "
                             "or choose another --run")
        run_dir = home.new_dir(f"rl-{cfg.rl.task}", run_name)
    if cfg.rl.rollout_actors:
        from tokenloom.platform.ingest import ensure_ray

        ensure_ray(cfg.ingest)
    provenance = {"init_from": str(gen.folder.resolve()), "vocab_id": gen.vocab.id, "code_version": code_version()}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps({"rl": asdict(cfg.rl), "model": asdict(gen.model.cfg),
                                                     **provenance}, indent=2))
    result = run_rl(gen.model.cfg, gen.model.state_dict(), gen.space, codec, cfg.rl, run_dir,
                    resume_from=checkpoint, progress=progress, provenance=provenance)
    stream = json.loads((gen.folder / "model.json").read_text()).get("stream", {})
    facts = generation_facts(gen.vocab, cfg.stream)
    facts["stream"].update({k: v for k, v in stream.items() if k in facts["stream"]})
    annotate_model(result.model_dir, **facts)  # generate reads the RL'd model like any other
    return {**asdict(result), "task": cfg.rl.task, "buffer": cfg.rl.buffer, "hints": cfg.rl.hints, "pools": pools}
