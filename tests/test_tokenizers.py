from pathlib import Path

import pytest

from tokenloom.tokenizers.bundle import content_hash
from tokenloom.tokenizers.text import TextTokenizer, TextTokenizerConfig, train_text_tokenizer
from tokenloom.tokenizers.vocab import SPECIAL_BLOCK, VocabManifest

SAMPLES = [
    "Return the canonical string representation of the object.",
    "  leading spaces, tabs\tand\nnewlines\n",
    "Unicode: naïve café, Ελληνικά, 日本語, emoji 🧵🪡",
    "def f(x):\n    return x ** 2  # code too",
    "",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_text_round_trip(text_bundle, text):
    tok = TextTokenizer.load(text_bundle.path)
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_batch_encoding_gives_the_ids_of_one_text_at_a_time(text_bundle, corpus_texts):
    """`encode_batch` (the pools' path, HF's offset-free batch call) equals `encode` text by text,
    on the corpus and on text it never learned (unicode, whitespace runs, empty)."""
    tok = TextTokenizer.load(text_bundle.path)
    texts = [*SAMPLES, *corpus_texts[:200], "\u00a0\u2028 mixed\r\nline ends\r", "x" * 5000]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert tok.encode_batch(texts) == [e.ids for e in tok.tokenizer.encode_batch(texts, add_special_tokens=False)]


def test_bpe_compresses_the_language_it_learned(text_bundle, corpus_texts):
    tok = TextTokenizer.load(text_bundle.path)
    sample = " ".join(corpus_texts[:50])
    assert len(tok.encode(sample)) < 0.6 * len(sample.encode())  # bytes-per-token > 1.67 at 600 ids


def test_bundle_id_is_the_content_hash(tmp_path, corpus_texts, text_bundle):
    again = train_text_tokenizer(corpus_texts, tmp_path, TextTokenizerConfig(vocab_size=600))
    assert again.id == text_bundle.id  # same corpus and settings, same bundle
    assert again.id.endswith(content_hash(again.path)[:16])
    other = train_text_tokenizer(corpus_texts[:100], tmp_path, TextTokenizerConfig(vocab_size=400))
    assert other.id != again.id


def test_vocab_size_too_small_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="at least 257"):
        train_text_tokenizer(["abc"], tmp_path, TextTokenizerConfig(vocab_size=100))


def test_vocab_manifest_layout_and_hash(tmp_path: Path):
    m = VocabManifest.build(1000, visual_size=512, audio_levels=2, audio_codebook=64, bundles={"text": "text-x"})
    assert m.text.start == SPECIAL_BLOCK and m.text.size == 1000
    assert m.visual.start == m.text.stop and m.audio[0].start == m.visual.stop
    assert m.size == SPECIAL_BLOCK + 1000 + 512 + 128
    assert len({m.pad_id, m.bos_id, m.eos_id}) == 3 and max(m.specials.values()) < SPECIAL_BLOCK
    loaded = VocabManifest.load(m.save(tmp_path))
    assert loaded == m and loaded.id == m.id
    assert VocabManifest.build(1001).id != VocabManifest.build(1000).id
    tampered = tmp_path / f"{m.id}.json"
    tampered.write_text(tampered.read_text().replace("1016", "1017"))
    with pytest.raises(ValueError, match="does not hash"):
        VocabManifest.load(tampered)
