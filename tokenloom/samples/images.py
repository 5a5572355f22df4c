"""Sample images: the photographs scikit-image ships in its wheel, with hand-written captions,
plus odd but valid files and broken ones, for the demo, the tests and the benchmarks.

Offline and identical on every machine: scikit-image's data folder is read, never fetched.
Photos are decoded here with Pillow (alpha composited on white, grayscale expanded to RGB),
which gives the same arrays as the ingestion job's decoder for every bundled photo (checked
in the tests), without this package depending on `datasets`. scikit-image, Pillow and numpy
are imported inside the functions that need them, so importing this module stays cheap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image


# Sample photos: the pictures scikit-image ships inside its wheel (no download, same on every
# machine), each with a caption written by hand from looking at it. Held-out photos are never
# written for ingestion, so a tokenizer trained on the sample folder can be evaluated on them.
PHOTOS: dict[str, tuple[str, str]] = {  # name -> (file in skimage/data, caption)
    "astronaut": (
        "astronaut.png",
        "A smiling astronaut in an orange spacesuit holds a white helmet, "
        "with an American flag and a model of the space shuttle behind her.",
    ),
    "chelsea": ("chelsea.png", "A close-up of a ginger tabby cat's face with yellow-green eyes."),
    "coffee": ("coffee.png", "A red cup of espresso with a spoon on a matching saucer, on a wooden table."),
    "hubble_deep_field": (
        "hubble_deep_field.jpg",
        "Hundreds of distant galaxies of many colours and shapes scattered across the black of deep space.",
    ),
    "immunohistochemistry": (
        "ihc.png",
        "A microscope image of stained tissue: brown-stained glands among small blue cell nuclei.",
    ),
    "motorcycle": (
        "motorcycle_left.png",
        "A red motorcycle parked in a garage in front of shelves of boxes.",
    ),
    "retina": (
        "retina.jpg",
        "A photograph of the back of a human eye: the orange retina, its branching "
        "blood vessels and the bright optic disc.",
    ),
    "rocket": (
        "rocket.jpg",
        "A white rocket on its launch pad at dusk between tall towers, lit by bright floodlights.",
    ),
    "colorwheel": (
        "color.png",
        "A colour wheel on a black background, saturated hues around the rim fading to white at the centre.",
    ),
    "camera": (
        "camera.png",
        "A black-and-white photograph of a man in a dark coat looking through a camera "
        "on a tripod in an open field.",
    ),
    "brick": (
        "brick.png",
        "A grey brick wall seen at an angle, long rows of bricks separated by light mortar.",
    ),
    "grass": ("grass.png", "A grey close-up texture of densely packed blades of grass."),
    "gravel": ("gravel.png", "A grey close-up texture of many small rounded pebbles."),
    "moon": (
        "moon.png",
        "A grey close-up of the surface of the Moon with a few small craters and dark patches.",
    ),
    "page": ("page.png", "A scanned page of printed text under the heading 'Region-based segmentation'."),
    "text": (
        "text.png",
        "Handwritten letters and symbols in rows on a sheet of paper, photographed at an angle.",
    ),
    "coins": ("coins.png", "Twenty-four old coins laid out in four rows on a dark background."),
    "horse": ("horse.png", "The black silhouette of a horse standing in profile on a white background."),
    "clock": ("clock_motion.png", "A round wall clock blurred by motion against a plain grey wall."),
    "cell": ("cell.png", "A grey microscope image of a single round bright cell on a textured background."),
}
HELD_OUT = ("chelsea", "coffee")
PHOTO_SPLITS = ("train", "heldout", "all")
# a mix of formats, as real folders have: .png if gray, .jpg if colour, unless named here
_PHOTO_SUFFIX = {"colorwheel": ".png", "rocket": ".webp", "coins": ".bmp"}
_NO_FLIP = {"page", "text"}  # mirrored writing is not writing
_PHOTO_MAX_SIDE, _PHOTO_MIN_SIDE, _VARIANT_MIN_SIDE = 320, 128, 96


def sample_photos(split: str = "train") -> dict[str, np.ndarray]:
    """The sample photos of a split ("train", "heldout" or "all") as (H, W, 3) uint8 RGB arrays.

    Read from scikit-image's installed data folder (never fetched) at full size: grayscale is
    expanded to three channels, alpha composited on white.
    """
    from importlib.resources import files

    if split not in PHOTO_SPLITS:
        raise ValueError(f"unknown photo split {split!r}; known: {PHOTO_SPLITS}")
    try:
        folder = files("skimage.data")
    except ModuleNotFoundError:
        raise RuntimeError("the sample photos come with scikit-image: pip install scikit-image") from None
    photos = {}
    for name, (filename, _) in PHOTOS.items():
        if (split == "train" and name in HELD_OUT) or (split == "heldout" and name not in HELD_OUT):
            continue
        try:
            photos[name] = _rgb_pixels((folder / filename).read_bytes())
        except OSError as exc:
            raise RuntimeError(f"scikit-image's bundled {filename} did not decode ({exc}); reinstall scikit-image") from None
    return photos


def _rgb_pixels(data: bytes) -> np.ndarray:
    """Encoded image bytes -> (H, W, 3) uint8 RGB, alpha composited on white."""
    import io

    import numpy as np
    from PIL import Image

    image = Image.open(io.BytesIO(data))
    image.load()
    if image.mode in ("RGBA", "LA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    return np.asarray(image.convert("RGB"))


def write_sample_images(out_dir: Path, with_bad_inputs: bool = True, variants: int = 2) -> Path:
    """Write the training photos under `out_dir` (idempotent) and return the folder to ingest.

    Each photo (at most 320 px a side) is written as `.jpg`, `.png`, `.webp` or `.bmp` with a
    caption sidecar `<stem>.txt`, then `variants` crops (at least 96 px a side, odd ones
    mirrored) as `<name>-crop<k>.jpg`, each with its own sidecar. `pairs.jsonl` pairs a few of
    the photos with their captions again, as `{"image": <path relative to it>, "text": ...}`.
    With `with_bad_inputs`, `bad/` holds files to quarantine and `odd/` files to normalize
    (see `write_bad_images` and `write_odd_images`); these have no captions.
    """
    import numpy as np
    from PIL import Image

    if variants < 0:
        raise ValueError(f"variants must be >= 0, got {variants}")
    out_dir = Path(out_dir)
    done = out_dir / ".complete.json"
    settings = {"with_bad_inputs": with_bad_inputs, "variants": variants, "layout": 1}
    try:
        previous = json.loads(done.read_text())
    except (OSError, ValueError):
        previous = {}
    if previous.get("settings") == settings:
        return out_dir
    done.unlink(missing_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    written: list[str] = []

    def save(image: Image.Image, rel: str, caption: str | None = None) -> None:
        path = out_dir / rel
        image.save(path, **({"quality": 88} if path.suffix in {".jpg", ".webp"} else {}))
        written.append(rel)
        if caption is not None:
            path.with_suffix(".txt").write_text(caption + "\n", encoding="utf-8")
            written.append(str(Path(rel).with_suffix(".txt")))

    pairs = []
    for name, pixels in sample_photos("train").items():
        caption = PHOTOS[name][1]
        photo = Image.fromarray(pixels)
        gray = bool(
            np.array_equal(pixels[..., 0], pixels[..., 1]) and np.array_equal(pixels[..., 0], pixels[..., 2])
        )
        if gray:
            photo = photo.convert("L")
        photo = _fit(photo)
        suffix = _PHOTO_SUFFIX.get(name, ".png" if gray else ".jpg")
        save(photo, f"{name}{suffix}", caption)
        if len(pairs) < 4:
            pairs.append(json.dumps({"image": f"{name}{suffix}", "text": caption}, ensure_ascii=False))
        for k in range(1, variants + 1):
            crop = photo.crop(_crop_box(photo.size, k))
            if k % 2 == 1 and name not in _NO_FLIP:
                crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            save(crop, f"{name}-crop{k}.jpg", caption)
    (out_dir / "pairs.jsonl").write_text("\n".join(pairs) + "\n", encoding="utf-8")
    written.append("pairs.jsonl")
    if with_bad_inputs:
        written += [f"bad/{name}" for name in write_bad_images(out_dir / "bad")]
        written += [f"odd/{name}" for name in write_odd_images(out_dir / "odd")]
    for stale in set(previous.get("files", [])) - set(written):  # left by other settings
        (out_dir / stale).unlink(missing_ok=True)
    for folder in (out_dir / "bad", out_dir / "odd"):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    done.write_text(json.dumps({"settings": settings, "files": sorted(written)}))
    return out_dir


def _fit(photo: Image.Image) -> Image.Image:
    """At most 320 px a side, at least 128 px on the short side (or as large as the original)."""
    from PIL import Image

    width, height = photo.size
    scale = min(1.0, _PHOTO_MAX_SIDE / max(width, height))
    if min(width, height) * scale < _PHOTO_MIN_SIDE:
        scale = min(1.0, _PHOTO_MIN_SIDE / min(width, height))
    size = (round(width * scale), round(height * scale))
    return photo if size == photo.size else photo.resize(size, Image.Resampling.LANCZOS)


def _crop_box(size: tuple[int, int], k: int) -> tuple[int, int, int, int]:
    """The k-th crop (k >= 1): three quarters of each side, at a corner or the centre in turn."""
    width, height = size
    crop_w = min(width, max(_VARIANT_MIN_SIDE, round(width * 0.75)))
    crop_h = min(height, max(_VARIANT_MIN_SIDE, round(height * 0.75)))
    fx, fy = [(0.0, 0.0), (1.0, 1.0), (1.0, 0.0), (0.0, 1.0), (0.5, 0.5)][(k - 1) % 5]
    left, top = round((width - crop_w) * fx), round((height - crop_h) * fy)
    return left, top, left + crop_w, top + crop_h


def _pattern(width: int, height: int) -> np.ndarray:
    """A deterministic RGB test card (gradients and hashed noise) that compresses poorly."""
    import numpy as np

    y, x = np.mgrid[0:height, 0:width]
    noise = (x * 7919 + y * 104729) % 61
    return np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), noise * 4], axis=-1).astype(
        np.uint8
    )


def write_bad_images(bad_dir: Path) -> dict[str, str]:
    """Image files every job must quarantine; returns file name -> start of its reason."""
    import struct
    import zlib
    from io import BytesIO

    from PIL import Image

    def encoded(image: Image.Image, fmt: str, **options) -> bytes:
        buffer = BytesIO()
        image.save(buffer, fmt, **options)
        return buffer.getvalue()

    def png_chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    bad_dir = Path(bad_dir)
    bad_dir.mkdir(parents=True, exist_ok=True)
    card = Image.fromarray(_pattern(96, 96))
    png = encoded(card, "PNG")
    (bad_dir / "truncated.png").write_bytes(png[: len(png) * 6 // 10])  # cut inside the pixel data
    jpeg = bytearray(encoded(card, "JPEG", quality=90))
    table = jpeg.find(b"\xff\xc4")  # garble the first Huffman table: the header parses, the scan cannot
    jpeg[table + 5 : table + 41] = bytes(range(200, 236))
    (bad_dir / "corrupt.jpg").write_bytes(bytes(jpeg))
    (bad_dir / "text-not-image.png").write_text("This is a note, not a picture.\n", encoding="utf-8")
    (bad_dir / "one-pixel.png").write_bytes(encoded(Image.new("RGB", (1, 1), (10, 20, 30)), "PNG"))
    bomb_header = struct.pack(">IIBBBBB", 50_000, 50_000, 8, 0, 0, 0, 0)  # 8-bit gray, 2.5 gigapixels
    (bad_dir / "decompression-bomb.png").write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", bomb_header)
        + png_chunk(b"IDAT", zlib.compress(bytes(1000)))
        + png_chunk(b"IEND", b"")
    )
    (bad_dir / "empty.png").write_bytes(b"")
    return {
        "truncated.png": "truncated or corrupt image: ",
        "corrupt.jpg": "truncated or corrupt image: ",
        "text-not-image.png": "content is not an image (looks like UTF-8 text)",
        "one-pixel.png": "image too small: 1x1 pixels",
        "decompression-bomb.png": "decompression bomb: 50000x50000 pixels",
        "empty.png": "empty file",
    }


def write_odd_images(odd_dir: Path) -> dict[str, str]:
    """Unusual but valid image files every job must normalize; returns file name -> a note
    its decoding must carry. Marks for tests: `rgba.png` hides red under alpha 0 on its left
    half; `cmyk.jpg` is pure black (K=255) in its top-left 32x32; `exif-rotated.jpg` stores
    200x120 pixels with orientation 6 and a pure red 24x24 square at its stored top-left,
    and shows upright as 120x200 (astronaut[20:220, 180:300]) with the square top-right;
    `16bit.png` spans 0..65535; `animated.gif` has 3 frames, the first a crop of the astronaut.
    """
    import numpy as np
    from PIL import Image

    odd_dir = Path(odd_dir)
    odd_dir.mkdir(parents=True, exist_ok=True)
    photos = sample_photos("train")
    astronaut, camera = photos["astronaut"], photos["camera"][..., 0]

    Image.fromarray(camera[100:220, 150:310]).save(odd_dir / "grayscale.png")

    rgba = np.dstack([astronaut[40:160, 100:260], np.full((120, 160), 255, np.uint8)])
    rgba[:, :80] = (255, 0, 0, 0)
    Image.fromarray(rgba).save(odd_dir / "rgba.png")

    Image.fromarray(astronaut[200:320, 150:310]).quantize(32).save(odd_dir / "palette.png")

    cmyk = Image.fromarray(astronaut[300:420, 100:260]).convert("CMYK")
    cmyk.paste((0, 0, 0, 255), (0, 0, 32, 32))
    cmyk.save(odd_dir / "cmyk.jpg", quality=92)

    gray = camera[200:320, 200:360].astype(np.float64)
    deep = np.rint((gray - gray.min()) / (gray.max() - gray.min()) * 65535).astype(np.uint16)
    Image.fromarray(deep).save(odd_dir / "16bit.png")

    upright = astronaut[20:220, 180:300].copy()  # 120 wide, 200 high, as it should be shown
    upright[:24, -24:] = (255, 0, 0)
    stored = np.ascontiguousarray(np.rot90(upright))  # as a camera held sideways stores it
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    Image.fromarray(stored).save(odd_dir / "exif-rotated.jpg", quality=95, exif=exif)

    frames = [Image.fromarray(astronaut[top : top + 96, 200:320]) for top in (0, 160, 320)]
    frames[0].save(odd_dir / "animated.gif", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return {
        "grayscale.png": "grayscale expanded to RGB",
        "rgba.png": "RGBA composited on white",
        "palette.png": "palette converted",
        "cmyk.jpg": "CMYK converted to RGB",
        "16bit.png": "16-bit scaled to 8-bit",
        "exif-rotated.jpg": "exif orientation 6 applied",
        "animated.gif": "GIF: first of 3 frames",
    }
