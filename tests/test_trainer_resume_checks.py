"""A checkpoint resumes only onto the data, stream settings and rank count it was written with."""

from dataclasses import asdict

import pytest

from tokenloom.datasets import ShardFile, StreamConfig
from tokenloom.trainer.loop import _check_resumable

FILES = [ShardFile("file:///w/a.parquet", 10), ShardFile("file:///w/b.parquet", 5)]


def _client(**changes):
    client = {"data": {"0": {}, "1": {}}, "step": 3, "world_size": 2, "stream": asdict(StreamConfig(seq_len=64)),
              "files": [f.path for f in FILES]}
    client.update(changes)
    return client


def test_matching_checkpoint_is_accepted():
    _check_resumable(_client(), "ckpt", 2, StreamConfig(seq_len=64), FILES)


@pytest.mark.parametrize(
    ("client", "world", "stream", "files", "message"),
    [
        (_client(), 1, StreamConfig(seq_len=64), FILES, "written by 2 ranks"),
        (_client(), 2, StreamConfig(seq_len=128), FILES, "same stream"),
        (_client(), 2, StreamConfig(seq_len=64), FILES[:1], "another snapshot"),
        ({"step": 1}, 2, StreamConfig(seq_len=64), FILES, "not written by `tokenloom train`"),
    ],
)
def test_mismatches_are_refused_with_a_reason(client, world, stream, files, message):
    with pytest.raises(ValueError, match=message):
        _check_resumable(client, "ckpt", world, stream, files)
