import pytest

from tokenloom.jobs.config import load_run_config


def test_toml_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[train]\nsteps = 12\nlr = 0.01\n[model]\ndim = 96\n[ingest.pools.text]\nmax_actors = 3\n')
    cfg = load_run_config(path, ["train.steps=7", "train.save_checkpoint=false", "train.betas=0.8,0.9",
                                 "ingest.pools.text.batch_size=16"])
    assert cfg.train.steps == 7 and cfg.train.lr == 0.01 and cfg.model.dim == 96
    assert cfg.train.save_checkpoint is False and cfg.train.betas == (0.8, 0.9)
    assert cfg.ingest.pools["text"].max_actors == 3 and cfg.ingest.pools["text"].batch_size == 16


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.stepz=3"], "unknown config key 'train.stepz'"),
        (["train.steps=many"], "takes a int"),
        (["train=3"], "is a section"),
        (["steps"], "is not key=value"),
        (["train.save_checkpoint=maybe"], "takes true/false"),
        (["ingest.pools.text=3"], "is a section per modality"),
        (["train.betas=0.9"], "takes 2 comma-separated values"),
    ],
)
def test_bad_overrides_say_what_is_wrong(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_run_config(None, overrides)


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_run_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 1")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_run_config(bad)


def test_warmup_follows_the_run_length_unless_set():
    from tokenloom.trainer import TrainConfig

    for steps, warmup in ((1, 1), (5, 1), (30, 3), (300, 30)):
        cfg = TrainConfig(steps=steps)
        cfg.validate()  # a plain run of any length is valid
        assert cfg.warmup == warmup and cfg.deepspeed_config()["scheduler"]["params"]["warmup_num_steps"] == warmup
    assert TrainConfig(steps=30, warmup_steps=7).warmup == 7
    with pytest.raises(ValueError, match=r"train.warmup_steps \(31\) must be in \[0, train.steps=30\]"):
        TrainConfig(steps=30, warmup_steps=31).validate()


def test_recipes_load_by_name_and_differ_from_the_defaults():
    from tokenloom.jobs.config import RECIPES, RunConfig

    assert sorted(p.stem for p in RECIPES.glob("*.toml")) == ["demo", "finetune", "gpu", "rl", "tiny"]
    assert load_run_config("gpu").model.moe.n_experts == 64
    finetune = load_run_config("finetune").train  # the seed's fine-tuning defaults
    assert (finetune.lr, finetune.weight_decay, finetune.grad_clip, finetune.checkpoint_every) == (2e-5, 0.01, 1.0, 50)
    tiny, demo = load_run_config("tiny"), load_run_config(RECIPES / "demo.toml")
    assert (tiny.model.dim, tiny.train.steps, tiny.demo.corpus_bytes) == (64, 30, 400_000)
    assert (demo.model.dim, demo.train.steps, demo.text_tokenizer.vocab_size) == (128, 300, 2048)
    assert demo.visual_tokenizer != RunConfig().visual_tokenizer
    rl = load_run_config("rl")  # a task's SFT start (near-duplicate records kept) and its RL run
    assert (rl.ingest.dedup.near_text, rl.text_tokenizer.vocab_size, rl.rl.task) == (False, 300, "sort")
    assert load_run_config("rl", ["rl.misc.token_band.text=0.4,3", "rl.hint.gamma=0.1"]).rl.misc.token_band["text"] \
        == (0.4, 3.0)
    floors = [load_run_config("rl", [f"rl.hint.pass_floor={v}"]).rl.hint.pass_floor for v in ("0.1", "none")]
    assert floors == [0.1, None]  # an optional number from the command line: a number, or none
    with pytest.raises(FileNotFoundError, match="neither a file nor a recipe"):
        load_run_config("no-such-recipe")
