"""A checkpoint resumes only onto the data and stream settings it was written with, on a number of
ranks that divides its canonical readers."""

from dataclasses import asdict

import pytest

from tokenloom.datasets import ShardFile, StreamConfig
from tokenloom.trainer.loop import _check_resumable

FILES = [ShardFile("file:///w/a.parquet", 10), ShardFile("file:///w/b.parquet", 5)]


def _client(**changes):
    client = {"data": {"rows": 0, "readers": {}}, "step": 3, "world_size": 2,
              "stream": asdict(StreamConfig(seq_len=64, readers=4)),
              "files": [f.path for f in FILES]}
    client.update(changes)
    return client


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_checkpoint_resumes_on_any_number_of_ranks_dividing_its_readers(world):
    _check_resumable(_client(), "ckpt", world, StreamConfig(seq_len=64), FILES)
    with pytest.raises(ValueError, match=f"divides that \\(this run has {world + 4}\\)"):
        _check_resumable(_client(), "ckpt", world + 4, StreamConfig(seq_len=64), FILES)


@pytest.mark.parametrize(
    ("client", "world", "stream", "files", "message"),
    [
        (_client(), 3, StreamConfig(seq_len=64), FILES, "stream.readers = 4"),
        (_client(), 2, StreamConfig(seq_len=128), FILES, "same stream"),
        (_client(), 2, StreamConfig(seq_len=64), FILES[:1], "another snapshot"),
        ({"step": 1}, 2, StreamConfig(seq_len=64), FILES, "not written by `tokenloom train`"),
    ],
)
def test_mismatches_are_refused_with_a_reason(client, world, stream, files, message):
    with pytest.raises(ValueError, match=message):
        _check_resumable(client, "ckpt", world, stream, files)
