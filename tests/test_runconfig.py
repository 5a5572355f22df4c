import pytest

from tokenloom.runconfig import load_run_config


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
