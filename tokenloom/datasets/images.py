"""Image inputs: decode untrusted bytes into one plain RGB array, or say why not.

The visual tokenizer should see one kind of input (H x W x 3 uint8 RGB, upright, bounded in
size), whatever the file was: so every oddity found in the wild is normalized here, once,
and written down in the image's `notes`. A file that cannot be normalized is quarantined
with a specific reason, and, as with text in `sources.py`, decoding never raises on bad
content: one broken file must not stop a job.

Size is checked twice, because decoding is where untrusted files cost memory: the declared
width and height are checked before any pixel is decoded (a 69-byte PNG can declare 2.5
billion pixels), and Pillow's own bomb guard is kept, with its warning made an error for
this call only. Large JPEGs are decoded at a reduced scale when they would be downscaled
anyway. Captions travel beside images as sidecar files of the same stem (`cat.png` +
`cat.txt`).
"""

from __future__ import annotations

import codecs
import io
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import (
    BmpImagePlugin,
    GifImagePlugin,
    Image,
    ImageOps,
    JpegImagePlugin,
    PngImagePlugin,
    TiffImagePlugin,
    WebPImagePlugin,
)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif")
CAPTION_SUFFIXES = (".txt", ".caption")

# Only these decoders ever see untrusted bytes: Pillow can also open formats whose loaders
# run external programs (EPS calls Ghostscript). "JPEG" also opens multi-picture (MPO) files.
DECODABLE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")
_HEADER_READERS = (  # read the declared size without Pillow's bomb check, to report it
    PngImagePlugin.PngImageFile,
    JpegImagePlugin.JpegImageFile,
    GifImagePlugin.GifImageFile,
    WebPImagePlugin.WebPImageFile,
    BmpImagePlugin.BmpImageFile,
    TiffImagePlugin.TiffImageFile,
)
_IMAGE_MAGIC = {
    b"\x89PNG": "PNG",
    b"\xff\xd8\xff": "JPEG",
    b"GIF8": "GIF",
    b"BM": "BMP",
    b"II*\x00": "TIFF",
    b"MM\x00*": "TIFF",
}
_OTHER_MAGIC = {
    b"PK\x03\x04": "a ZIP archive",
    b"\x1f\x8b": "a gzip archive",
    b"%PDF": "a PDF document",
    b"fLaC": "FLAC audio",
    b"OggS": "an Ogg file",
    b"ID3": "MP3 audio",
    b"\x7fELF": "an ELF binary",
}
_ORIENTATION_TAG = 0x0112


@dataclass(frozen=True)
class DecodedImage:
    pixels: np.ndarray  # (H, W, 3) uint8 RGB, C-contiguous, upright
    notes: tuple[str, ...]  # every normalization applied, in order; () for a plain RGB file

    @property
    def height(self) -> int:
        return int(self.pixels.shape[0])

    @property
    def width(self) -> int:
        return int(self.pixels.shape[1])


class _Rejected(Exception):
    """Internal: carries a quarantine reason out of the decoding steps."""


def decode_image(
    data: bytes,
    *,
    max_pixels: int = 64_000_000,
    min_side: int = 8,
    max_decoded_pixels: int = 1024 * 1024,
) -> tuple[DecodedImage | None, str | None]:
    """Decode image bytes into (DecodedImage, None), or (None, reason) for a quarantine.

    `max_pixels` bounds the declared size (checked before decoding); `min_side` is the
    smallest width or height accepted; `max_decoded_pixels` bounds the output, which is
    downscaled (aspect ratio kept) when larger. Never raises on bad content. Reasons start
    with one of: "empty file", "content is not an image", "truncated or corrupt image: ",
    "decompression bomb: ", "image too small: ", "unsupported color mode ".
    """
    if not data:
        return None, "empty file"
    notes: list[str] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = _open(data, max_pixels)
            try:
                pixels = _normalize(img, notes, min_side=min_side, max_decoded_pixels=max_decoded_pixels)
            finally:
                img.close()
    except _Rejected as rejected:
        return None, str(rejected)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        return None, _bomb_reason(data, max_pixels)
    return DecodedImage(pixels, tuple(notes)), None


def _open(data: bytes, max_pixels: int) -> Image.Image:
    try:
        img = Image.open(io.BytesIO(data), formats=DECODABLE_FORMATS)
    except Image.UnidentifiedImageError:
        raise _Rejected(_not_an_image_reason(data)) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise
    except Exception as exc:  # Pillow's plugins raise many types on malformed headers
        raise _Rejected(f"truncated or corrupt image: {_message(exc)}") from None
    width, height = img.size
    if width * height > max_pixels:
        img.close()
        raise _Rejected(f"decompression bomb: {width}x{height} pixels exceeds the limit of {max_pixels}")
    return img


def _normalize(img: Image.Image, notes: list[str], *, min_side: int, max_decoded_pixels: int) -> np.ndarray:
    width, height = img.size
    if min(width, height) < min_side:
        raise _Rejected(f"image too small: {width}x{height} pixels (need at least {min_side} on each side)")
    try:
        frames = getattr(img, "n_frames", 1)
        if frames > 1:
            img.seek(0)
            notes.append(f"{img.format}: first of {frames} frames")
        if width * height > max_decoded_pixels:
            # JPEG decodes at 1/2, 1/4 or 1/8 scale for free; never below the final size
            scale = math.sqrt(max_decoded_pixels / (width * height))
            img.draft(None, (max(1, math.ceil(width * scale)), max(1, math.ceil(height * scale))))
        img.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise
    except Exception as exc:
        raise _Rejected(f"truncated or corrupt image: {_message(exc)}") from None
    img, swapped = _upright(img, notes)
    rgb = _to_rgb(img, notes)
    shown_w, shown_h = (height, width) if swapped else (width, height)  # draft may have shrunk rgb
    if shown_w * shown_h > max_decoded_pixels:
        scale = math.sqrt(max_decoded_pixels / (shown_w * shown_h))
        target = (max(1, int(shown_w * scale)), max(1, int(shown_h * scale)))
        if rgb.size != target:
            rgb = rgb.resize(target, Image.Resampling.LANCZOS, reducing_gap=2.0)
        notes.append(f"downscaled from {shown_w}x{shown_h} to {target[0]}x{target[1]}")
    return np.array(rgb, dtype=np.uint8, order="C")


def _upright(img: Image.Image, notes: list[str]) -> tuple[Image.Image, bool]:
    """Apply the EXIF orientation; also say whether it swapped width and height."""
    try:
        orientation = img.getexif().get(_ORIENTATION_TAG, 1)
    except Exception:  # a malformed EXIF block costs the orientation, not the image
        notes.append("exif unreadable, orientation ignored")
        return img, False
    if orientation not in range(2, 9):
        return img, False
    try:
        upright = ImageOps.exif_transpose(img)
    except Exception as exc:
        notes.append(f"exif orientation {orientation} not applied: {_message(exc)}")
        return img, False
    notes.append(f"exif orientation {orientation} applied")
    return upright, orientation in (5, 6, 7, 8)


def _to_rgb(img: Image.Image, notes: list[str]) -> Image.Image:
    mode = img.mode
    if mode == "RGB":
        return img
    if mode.startswith("I;16") or mode in {"I", "I;32", "F"}:
        return _high_depth_to_rgb(img, notes)
    if mode == "L":
        notes.append("grayscale expanded to RGB")
        return img.convert("RGB")
    if mode == "1":
        notes.append("1-bit expanded to RGB")
        return img.convert("L").convert("RGB")
    if mode in {"P", "PA"}:
        notes.append("palette converted")
        has_alpha = mode == "PA" or "transparency" in img.info
        img = img.convert("RGBA" if has_alpha else "RGB")
        return _composite(img, notes, "palette alpha") if has_alpha else img
    if mode in {"RGBA", "RGBa", "LA", "La"}:
        return _composite(img.convert("RGBA"), notes, mode)
    if mode == "CMYK":
        notes.append("CMYK converted to RGB")
        return img.convert("RGB")
    try:
        converted = img.convert("RGB")
    except Exception as exc:
        raise _Rejected(f"unsupported color mode {mode}: {_message(exc)}") from None
    notes.append(f"{mode} converted to RGB")
    return converted


def _composite(rgba: Image.Image, notes: list[str], what: str) -> Image.Image:
    """Transparent pixels become white, the usual page background, not whatever RGB hid there."""
    low, _ = rgba.getchannel("A").getextrema()
    if low == 255:
        notes.append(f"{what}: opaque alpha dropped")
        return rgba.convert("RGB")
    notes.append(f"{what} composited on white")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")


def _high_depth_to_rgb(img: Image.Image, notes: list[str]) -> Image.Image:
    """Scale 16-bit, 32-bit integer and float pixels to 0..255; Pillow's convert would clip.

    16-bit data maps 0..65535 to 0..255. A 32-bit integer image whose values fit in 0..65535
    holds 16-bit data (how many TIFF and older PNG readers store it), and a float image in
    0..1 is normalized intensity; anything else is stretched from its own min..max.
    """
    mode = img.mode
    values = np.asarray(img)
    if mode.startswith("I;16"):
        scaled = _scale(values, 0.0, 65535.0)
        notes.append("16-bit scaled to 8-bit")
    elif mode == "F":
        values = np.nan_to_num(values.astype(np.float32), nan=0.0, posinf=0.0, neginf=0.0)
        low, high = float(values.min()), float(values.max())
        if low >= 0.0 and high <= 1.0:
            scaled = _scale(values, 0.0, 1.0)
            notes.append("float [0, 1] scaled to 8-bit")
        else:
            scaled = _scale(values, low, high)
            notes.append(f"float stretched from [{low:g}, {high:g}] to 8-bit")
    else:
        low, high = int(values.min()), int(values.max())
        if low >= 0 and high <= 65535:
            scaled = _scale(values, 0.0, 65535.0)
            notes.append("32-bit integer (16-bit range) scaled to 8-bit")
        else:
            scaled = _scale(values, float(low), float(high))
            notes.append(f"32-bit integer stretched from [{low}, {high}] to 8-bit")
    notes.append("grayscale expanded to RGB")
    return Image.fromarray(np.repeat(scaled[..., None], 3, axis=2), mode="RGB")


def _scale(values: np.ndarray, low: float, high: float) -> np.ndarray:
    if high <= low:
        return np.clip(np.rint(values), 0, 255).astype(np.uint8)
    unit = (values.astype(np.float32) - np.float32(low)) * np.float32(255.0 / (high - low))
    return np.clip(np.rint(unit), 0, 255).astype(np.uint8)  # float32: exact for 16-bit, half the memory


def _bomb_reason(data: bytes, max_pixels: int) -> str:
    """Pillow refused the size before we could read it: read the header again, unchecked."""
    limit = max_pixels if Image.MAX_IMAGE_PIXELS is None else min(max_pixels, Image.MAX_IMAGE_PIXELS)
    for reader in _HEADER_READERS:
        try:
            with reader(io.BytesIO(data)) as header:
                width, height = header.size
        except Exception:
            continue
        return f"decompression bomb: {width}x{height} pixels exceeds the limit of {limit}"
    return f"decompression bomb: declared size exceeds the limit of {limit} pixels"


def _not_an_image_reason(data: bytes) -> str:
    for magic, kind in _IMAGE_MAGIC.items():
        if data.startswith(magic):
            return f"truncated or corrupt image: {kind} signature, but Pillow cannot read the header"
    if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
        return "truncated or corrupt image: WebP signature, but Pillow cannot read the header"
    for magic, kind in _OTHER_MAGIC.items():
        if data.startswith(magic):
            return f"content is not an image (looks like {kind})"
    head = data[:8192]
    if b"\x00" not in head:
        try:
            codecs.getincrementaldecoder("utf-8")().decode(head, final=len(data) <= len(head))
        except UnicodeDecodeError:
            pass
        else:
            return "content is not an image (looks like UTF-8 text)"
    return "content is not an image in a supported format (PNG, JPEG, GIF, WebP, BMP, TIFF)"


def _message(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def caption_sidecar(image_path: Path) -> Path | None:
    """The caption file beside an image (`cat.png` -> `cat.txt` or `cat.caption`), if any."""
    image_path = Path(image_path)
    for suffix in CAPTION_SUFFIXES:
        for spelled in (suffix, suffix.upper()):
            candidate = image_path.with_suffix(spelled)
            if candidate.is_file():
                return candidate
    return None


def is_caption_of_image(path: Path) -> bool:
    """A `.txt`/`.caption` file with an image of the same stem beside it: a caption, not a document."""
    path = Path(path)
    if path.suffix.lower() not in CAPTION_SUFFIXES:
        return False
    return any(
        path.with_suffix(spelled).is_file()
        for suffix in IMAGE_SUFFIXES
        for spelled in (suffix, suffix.upper())
    )


def read_caption(path: Path) -> tuple[str | None, str | None]:
    """(caption, None), or (None, None) when the file holds no text, or (None, reason)."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        return None, f"caption unreadable: {exc.strerror or exc}"
    if b"\x00" in data:
        return None, "caption is binary (NUL bytes), not text"
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        return None, f"caption is not valid UTF-8 at byte {exc.start}"
    text = text.strip()
    return (text, None) if text else (None, None)
