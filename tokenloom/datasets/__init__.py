"""datasets: raw sources and readers; token streams (shuffle, rank split, pack, state)."""

from tokenloom.datasets.stream import ShardFile, SourceSpec, StreamConfig, StreamState, TokenStream

__all__ = ["ShardFile", "SourceSpec", "StreamConfig", "StreamState", "TokenStream", "shard_files"]


def shard_files(catalog, dataset: str, at: str | int | None = None) -> list[ShardFile]:
    """The data files of a dataset snapshot (current when `at` is None), as stream inputs."""
    return [ShardFile(f.path, f.record_count) for f in catalog.data_files(dataset, at)]
