"""The unified vocabulary manifest: one id space for every modality.

Layout (ids ascending): a fixed block of special tokens, then the text BPE range, then the
visual code range, then one audio code range per RVQ level. Specials come first so that
adding a modality never moves them; a modality that is absent has an empty range. The
manifest is a JSON document whose id is the hash of its canonical form, so every shard can
name exactly the layout its ids mean, and the model is built from the same document.

One vocabulary per dataset (ARCHITECTURE.md). A dataset's first job pins its manifest; a later
job reuses it, or `extend`s it by appending a range for a modality it did not have yet (after
every existing id, so an audio range added to an image dataset, or a visual range added to an
audio one, never moves an id). A different bundle for a range that exists is refused: the same
ids would mean other tokens. `is_prefix_of` is the check a trainer makes of every job's
manifest against the one it trains with.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenloom.contract import SPECIAL_BLOCK, SPECIAL_TOKENS
from tokenloom.tokenizers.bundle import BundleError, BundleInfo


@dataclass(frozen=True)
class TokenRange:
    """Half-open id range [start, stop) owned by one tokenizer (or one RVQ level)."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def __contains__(self, token_id: int) -> bool:
        return self.start <= token_id < self.stop


@dataclass(frozen=True)
class VocabManifest:
    """The id layout. Build with `VocabManifest.build`; read with `load`."""

    text: TokenRange
    visual: TokenRange
    audio: tuple[TokenRange, ...]
    specials: dict[str, int] = field(default_factory=dict)
    bundles: dict[str, str] = field(default_factory=dict)  # modality -> tokenizer bundle id

    @staticmethod
    def build(
        text_size: int,
        visual_size: int = 0,
        audio_levels: int = 0,
        audio_codebook: int = 0,
        bundles: dict[str, str] | None = None,
    ) -> VocabManifest:
        if text_size <= 0:
            raise ValueError(f"text vocabulary size must be positive, got {text_size}")
        specials = {name: i for i, name in enumerate(SPECIAL_TOKENS)}
        text = TokenRange(SPECIAL_BLOCK, SPECIAL_BLOCK + text_size)
        visual = TokenRange(text.stop, text.stop + visual_size)
        audio, cursor = [], visual.stop
        for _ in range(audio_levels):
            audio.append(TokenRange(cursor, cursor + audio_codebook))
            cursor += audio_codebook
        return VocabManifest(text, visual, tuple(audio), specials, dict(bundles or {}))

    @property
    def size(self) -> int:
        """Total vocabulary size (embedding rows the model needs): past the last range, wherever
        an extension appended it."""
        return max(r.stop for r in (self.text, self.visual, *self.audio))

    def ranges(self) -> dict[str, TokenRange]:
        """The non-empty ranges by name: text, visual, audio0, audio1, ..."""
        named = {"text": self.text, "visual": self.visual, **{f"audio{i}": r for i, r in enumerate(self.audio)}}
        return {name: r for name, r in named.items() if r.size > 0}

    def is_prefix_of(self, other: VocabManifest) -> bool:
        """Every id of this manifest means the same token in `other`: same specials, each of this
        manifest's ranges present in `other` at the same place, made by the same bundle."""
        if any(other.specials.get(name) != i for name, i in self.specials.items()):
            return False  # (a newer manifest may name more specials in the reserved block: never a moved id)
        theirs = other.ranges()
        if any(theirs.get(name) != r for name, r in self.ranges().items()):
            return False
        kinds = {"text"} | ({"visual"} if self.visual.size else set()) | ({"audio"} if self.audio else set())
        return all(self.bundles.get(k) == other.bundles.get(k) for k in kinds)

    def extend(self, bundles: dict[str, BundleInfo], what: str = "this vocabulary") -> VocabManifest:
        """This manifest with a range appended for each bundle's modality that it lacks; itself
        when it has them all. Raises BundleError when a bundle differs from the one that made an
        existing range (naming both); `what` names the owner in that message (a dataset)."""
        text, visual, audio = self.text, self.visual, self.audio
        owned = dict(self.bundles)
        cursor = self.size
        for kind in ("text", "visual", "audio"):
            info = bundles.get(kind)
            if info is None:
                continue
            present = {"text": True, "visual": visual.size > 0, "audio": bool(audio)}[kind]
            if present:
                if owned.get(kind) is None:  # a range no bundle is named for (a bare manifest) is claimed
                    owned[kind] = info.id
                elif owned[kind] != info.id:
                    raise BundleError(
                        f"{what} pins the {kind} tokenizer {owned.get(kind)} (vocabulary {self.id}); this job's is "
                        f"{info.id}, whose ids would mean other tokens: ingest with {owned.get(kind)} or into a new "
                        "dataset (--dataset NEW_NAME)")
                continue
            if kind == "visual":
                visual = TokenRange(cursor, cursor + int(info.config["num_codes"]))
                cursor = visual.stop
            else:
                size, levels = int(info.config["codebook_size"]), int(info.config["levels"])
                audio = tuple(TokenRange(cursor + i * size, cursor + (i + 1) * size) for i in range(levels))
                cursor = audio[-1].stop
            owned[kind] = info.id
        # specials added to the reserved block since this manifest was pinned (<bov>, <eov>) take their
        # fixed slots: no existing id moves
        specials = {**{name: i for i, name in enumerate(SPECIAL_TOKENS)}, **self.specials}
        if (visual, audio, owned, specials) == (self.visual, self.audio, self.bundles, self.specials):
            return self
        if visual.size == 0:  # keep an absent modality's empty range where it was
            visual = self.visual
        return VocabManifest(text, visual, audio, specials, owned)

    @property
    def pad_id(self) -> int:
        return self.specials["<pad>"]

    @property
    def bos_id(self) -> int:
        return self.specials["<bos>"]

    @property
    def eos_id(self) -> int:
        return self.specials["<eos>"]

    def to_dict(self) -> dict:
        return {
            "format": "tokenloom.vocab/1",
            "special_block": SPECIAL_BLOCK,
            "specials": self.specials,
            "text": [self.text.start, self.text.stop],
            "visual": [self.visual.start, self.visual.stop],
            "audio": [[r.start, r.stop] for r in self.audio],
            "bundles": dict(sorted(self.bundles.items())),
        }

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @property
    def id(self) -> str:
        """Content hash of the canonical JSON: the manifest's version."""
        return "vocab-" + hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]

    @staticmethod
    def from_dict(doc: dict) -> VocabManifest:
        if doc.get("format") != "tokenloom.vocab/1":
            raise ValueError(f"not a TokenLoom vocabulary manifest (format={doc.get('format')!r})")
        return VocabManifest(
            text=TokenRange(*doc["text"]),
            visual=TokenRange(*doc["visual"]),
            audio=tuple(TokenRange(*r) for r in doc["audio"]),
            specials={k: int(v) for k, v in doc["specials"].items()},
            bundles=dict(doc.get("bundles", {})),
        )

    def save(self, directory: Path) -> Path:
        """Write `<directory>/<id>.json` (idempotent: same content, same file)."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{self.id}.json"
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))
        return path

    @staticmethod
    def load(path: Path) -> VocabManifest:
        manifest = VocabManifest.from_dict(json.loads(Path(path).read_text()))
        expected = Path(path).stem
        if expected.startswith("vocab-") and manifest.id != expected:
            raise ValueError(f"vocabulary manifest {path} does not hash to its name (got {manifest.id})")
        return manifest


def manifest_from_bundles(bundles: dict[str, BundleInfo]) -> VocabManifest:
    """The manifest of a set of tokenizer bundles, keyed by kind ("text" required, "visual" and
    "audio" when the inputs hold images or audio): the text bundle's vocabulary, the visual
    bundle's codes, one range per RVQ level of the audio bundle."""
    if "text" not in bundles:
        raise ValueError("a vocabulary needs a text tokenizer bundle")
    for kind, info in bundles.items():
        if info.kind != kind:
            raise BundleError(f"bundle {info.id} is a {info.kind} tokenizer, not a {kind} one")
    visual, audio = bundles.get("visual"), bundles.get("audio")
    return VocabManifest.build(
        int(bundles["text"].config["vocab_size"]),
        visual_size=int(visual.config["num_codes"]) if visual else 0,
        audio_levels=int(audio.config["levels"]) if audio else 0,
        audio_codebook=int(audio.config["codebook_size"]) if audio else 0,
        bundles={kind: info.id for kind, info in bundles.items()},
    )
