"""Text tokenizer: byte-level BPE trained and run by Hugging Face `tokenizers`.

Byte-level means every input string is representable (no unknown token), so the only text
that can fail is text that is not valid Unicode in the first place, and that is caught
upstream when bytes are decoded. Ids from the BPE model are local (0..vocab-1); the
manifest's text range offset turns them into unified ids.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tokenloom.tokenizers import bundle


@dataclass
class TextTokenizerConfig:
    vocab_size: int = 4096
    min_frequency: int = 2


class TextTokenizer:
    """A loaded text bundle: local BPE ids <-> strings."""

    def __init__(self, tokenizer: Tokenizer, bundle_id: str):
        self.tokenizer = tokenizer
        self.bundle_id = bundle_id

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @staticmethod
    def load(path: Path) -> TextTokenizer:
        info = bundle.load_info(path)
        if info.kind != "text":
            raise bundle.BundleError(f"bundle {info.id} is a {info.kind} tokenizer, not a text tokenizer")
        try:
            tokenizer = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
        except Exception as exc:  # the tokenizers library raises a bare Exception for unreadable files
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise bundle.BundleError(f"tokenizer bundle {info.id} is damaged: {Path(path) / 'tokenizer.json'}: "
                                     f"{reason}") from None
        return TextTokenizer(tokenizer, info.id)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # the same ids as `encode_batch`, without the character offsets nothing here reads
        # (1.4-1.7x faster on the ingestion corpus: bench/bench_ingest.py prints both)
        return [e.ids for e in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)


def _new_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_text_tokenizer(
    texts: Iterator[str] | Iterable[str], store: Path, config: TextTokenizerConfig
) -> bundle.BundleInfo:
    """Train a byte-level BPE on `texts` and publish it as a bundle under `store`."""
    if config.vocab_size < 257:
        raise ValueError(
            f"vocab_size must be at least 257 (256 bytes plus merges), got {config.vocab_size}"
        )
    tok = _new_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    staging = bundle.staging_dir(store)
    tok.save(str(staging / "tokenizer.json"))
    vocab_size = tok.get_vocab_size()
    (staging / bundle.CONFIG_NAME).write_text(
        json.dumps(
            {
                "kind": "text",
                "format": "hf-tokenizers/byte-level-bpe",
                "vocab_size": vocab_size,
                "requested_vocab_size": config.vocab_size,
                "min_frequency": config.min_frequency,
                "code_ranges": {"text": [0, vocab_size]},
            },
            indent=2,
            sort_keys=True,
        )
    )
    return bundle.publish(staging, store, "text")
