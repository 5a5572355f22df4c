"""Image inputs: every bad kind gets its own reason, every odd kind is normalized correctly."""

from __future__ import annotations

import io
import json
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tokenloom.datasets.images import (
    CAPTION_SUFFIXES,
    IMAGE_SUFFIXES,
    DecodedImage,
    caption_sidecar,
    decode_image,
    is_caption_of_image,
    read_caption,
)
from tokenloom.samples.images import (
    HELD_OUT,
    PHOTOS,
    sample_photos,
    write_bad_images,
    write_odd_images,
    write_sample_images,
)


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    return write_sample_images(tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="session")
def train_photos() -> dict[str, np.ndarray]:
    return sample_photos("train")


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def decoded(data: bytes, **limits) -> DecodedImage:
    image, reason = decode_image(data, **limits)
    assert reason is None, reason
    assert image is not None
    assert image.pixels.dtype == np.uint8 and image.pixels.ndim == 3 and image.pixels.shape[2] == 3
    assert image.pixels.flags.c_contiguous
    return image


def png_with_header(width: int, height: int) -> bytes:
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    idat = zlib.compress(bytes(100))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


# --- quarantine ---------------------------------------------------------------------------


def test_each_bad_file_gets_its_specific_reason(image_folder):
    expected = write_bad_images(image_folder / "bad")
    assert len(expected) == 6
    for name, reason_start in expected.items():
        image, reason = decode_image((image_folder / "bad" / name).read_bytes())
        assert image is None, name
        assert reason is not None and reason.startswith(reason_start), (name, reason)


def test_bad_reasons_read_exactly(image_folder):
    bad = image_folder / "bad"
    assert decode_image((bad / "one-pixel.png").read_bytes())[1] == (
        "image too small: 1x1 pixels (need at least 8 on each side)"
    )
    assert decode_image((bad / "decompression-bomb.png").read_bytes())[1] == (
        "decompression bomb: 50000x50000 pixels exceeds the limit of 64000000"
    )
    assert decode_image((bad / "text-not-image.png").read_bytes())[1] == (
        "content is not an image (looks like UTF-8 text)"
    )
    assert decode_image(b"") == (None, "empty file")
    assert (
        decode_image((bad / "truncated.png").read_bytes())[1]
        == "truncated or corrupt image: image file is truncated"
    )
    assert "broken data stream" in decode_image((bad / "corrupt.jpg").read_bytes())[1]


def test_not_an_image_reasons_name_what_the_content_looks_like():
    assert (
        decode_image(b"%PDF-1.7\n" + bytes(200))[1] == "content is not an image (looks like a PDF document)"
    )
    assert decode_image(bytes(range(256)) * 4)[1] == (
        "content is not an image in a supported format (PNG, JPEG, GIF, WebP, BMP, TIFF)"
    )
    assert decode_image(b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dJUNK" + bytes(40))[1] == (
        "truncated or corrupt image: PNG signature, but Pillow cannot read the header"
    )
    assert decode_image(b"\xff\xd8\xff\xe0" + bytes(5))[1] == (
        "truncated or corrupt image: JPEG signature, but Pillow cannot read the header"
    )
    assert decode_image(b"\x89PNG\r\n\x1a\n" + b"\x00garbage" * 10)[1].startswith(
        "truncated or corrupt image: "
    )


def test_declared_size_is_checked_before_decoding():
    small = encode(Image.new("RGB", (100, 80), (1, 2, 3)), "PNG")
    assert decode_image(small, max_pixels=5000) == (
        None,
        "decompression bomb: 100x80 pixels exceeds the limit of 5000",
    )
    assert (
        decode_image(small, min_side=81)[1]
        == "image too small: 100x80 pixels (need at least 81 on each side)"
    )
    assert decode_image(small, max_pixels=8000)[1] is None


def test_pillow_bomb_guards_are_caught_and_warnings_left_as_they_were():
    filters_before = list(warnings.filters)
    # 100 megapixels: over Pillow's warning threshold, under its error threshold and our limit
    image, reason = decode_image(png_with_header(10_000, 10_000), max_pixels=10**9)
    assert image is None
    assert reason == f"decompression bomb: 10000x10000 pixels exceeds the limit of {Image.MAX_IMAGE_PIXELS}"
    # 2.5 gigapixels: Pillow raises at open, before our own check can run
    assert decode_image(png_with_header(50_000, 50_000), max_pixels=10**12)[1].startswith(
        "decompression bomb: 50000x50000 pixels exceeds the limit of "
    )
    assert warnings.filters == filters_before


# --- normalization ------------------------------------------------------------------------


def test_each_odd_file_is_normalized_with_its_note(image_folder):
    expected = write_odd_images(image_folder / "odd")
    assert len(expected) == 7
    for name, note in expected.items():
        image = decoded((image_folder / "odd" / name).read_bytes())
        assert note in image.notes, (name, image.notes)


def test_plain_rgb_is_returned_untouched():
    pixels = np.random.default_rng(0).integers(0, 256, (40, 30, 3), dtype=np.uint8)
    image = decoded(encode(Image.fromarray(pixels), "PNG"))
    assert image.notes == ()
    assert np.array_equal(image.pixels, pixels)
    assert (image.height, image.width) == (40, 30)


def test_rgba_transparent_becomes_white_and_opaque_is_kept(image_folder, train_photos):
    image = decoded((image_folder / "odd" / "rgba.png").read_bytes())
    assert image.pixels.shape == (120, 160, 3)
    assert (image.pixels[:, :80] == 255).all()  # red hidden under alpha 0 must not show
    assert np.array_equal(image.pixels[:, 80:], train_photos["astronaut"][40:160, 180:260])


def test_half_transparent_alpha_blends_with_white():
    rgba = Image.new("RGBA", (16, 16), (0, 0, 0, 128))
    image = decoded(encode(rgba, "PNG"))
    assert image.notes == ("RGBA composited on white",)
    assert np.abs(image.pixels.astype(int) - 127).max() <= 1


def test_gray_alpha_and_palette_transparency_become_white():
    la = Image.new("LA", (16, 16), (0, 255))
    la.paste((0, 0), (0, 0, 8, 16))
    image = decoded(encode(la, "PNG"))
    assert (image.pixels[:, :8] == 255).all() and (image.pixels[:, 8:] == 0).all()

    palette = Image.new("P", (16, 16), 0)
    palette.putpalette([10, 20, 30] + [200, 0, 0] * 255)
    palette.paste(1, (8, 0, 16, 16))
    image = decoded(encode(palette, "PNG", transparency=0))
    assert "palette converted" in image.notes
    assert (image.pixels[:, :8] == 255).all()
    assert (image.pixels[:, 8:] == (200, 0, 0)).all()


def test_palette_png_matches_its_palette_colors(image_folder):
    path = image_folder / "odd" / "palette.png"
    assert Image.open(path).mode == "P"
    image = decoded(path.read_bytes())
    assert np.array_equal(image.pixels, np.asarray(Image.open(path).convert("RGB")))
    assert len(np.unique(image.pixels.reshape(-1, 3), axis=0)) <= 32


def test_grayscale_is_expanded_to_three_equal_channels(image_folder):
    path = image_folder / "odd" / "grayscale.png"
    image = decoded(path.read_bytes())
    gray = np.asarray(Image.open(path))
    for channel in range(3):
        assert np.array_equal(image.pixels[..., channel], gray)
    one_bit = Image.new("1", (10, 10), 0)
    one_bit.paste(1, (0, 0, 5, 10))
    bits = decoded(encode(one_bit, "PNG")).pixels
    assert (bits[:, :5] == 255).all() and (bits[:, 5:] == 0).all()


def test_cmyk_black_stays_black(image_folder):
    path = image_folder / "odd" / "cmyk.jpg"
    assert Image.open(path).mode == "CMYK"
    image = decoded(path.read_bytes())
    assert image.pixels.shape == (120, 160, 3)
    assert image.pixels[4:28, 4:28].max() < 40
    assert image.pixels[40:, 40:].mean() > 80  # the rest is the orange suit, not inverted


def test_16bit_range_is_scaled_not_clipped(image_folder):
    path = image_folder / "odd" / "16bit.png"
    raw = np.asarray(Image.open(path)).astype(np.float64)
    assert raw.min() == 0 and raw.max() == 65535
    image = decoded(path.read_bytes())
    assert image.pixels.min() == 0 and image.pixels.max() == 255
    assert np.array_equal(image.pixels[..., 1], np.rint(raw / 257).astype(np.uint8))
    assert len(np.unique(image.pixels)) > 100  # clipping would leave almost everything at 255


def test_32bit_integer_and_float_images_are_scaled():
    ramp = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.int32)
    image = decoded(encode(Image.fromarray(ramp, mode="I"), "TIFF"))
    assert "32-bit integer (16-bit range) scaled to 8-bit" in image.notes
    assert image.pixels[0, 0, 0] == 0 and image.pixels[-1, -1, 0] == 255

    signed = np.linspace(-1000, 3000, 64 * 64).reshape(64, 64).astype(np.int32)
    image = decoded(encode(Image.fromarray(signed, mode="I"), "TIFF"))
    assert "32-bit integer stretched from [-1000, 3000] to 8-bit" in image.notes
    assert image.pixels[0, 0, 0] == 0 and image.pixels[-1, -1, 0] == 255

    unit = np.zeros((16, 16), np.float32)
    unit[:, 8:] = 0.5
    unit[0, 0] = 1.0
    image = decoded(encode(Image.fromarray(unit, mode="F"), "TIFF"))
    assert "float [0, 1] scaled to 8-bit" in image.notes
    assert image.pixels[0, 0, 0] == 255 and image.pixels[5, 12, 0] == 128 and image.pixels[5, 2, 0] == 0

    wide = np.linspace(-5.0, 5.0, 256, dtype=np.float32).reshape(16, 16)
    image = decoded(encode(Image.fromarray(wide, mode="F"), "TIFF"))
    assert image.pixels.min() == 0 and image.pixels.max() == 255


def test_exif_orientation_6_turns_the_image_upright(image_folder, train_photos):
    path = image_folder / "odd" / "exif-rotated.jpg"
    assert Image.open(path).size == (200, 120)  # as stored
    image = decoded(path.read_bytes())
    assert image.notes == ("exif orientation 6 applied",)
    assert image.pixels.shape == (200, 120, 3)
    top_right, top_left = image.pixels[4:20, -20:-4].astype(int), image.pixels[4:20, 4:20].astype(int)
    assert (top_right[..., 0] > 200).all() and (top_right[..., 1:] < 60).all()  # the stored top-left
    assert not ((top_left[..., 0] > 200) & (top_left[..., 1] < 60)).all()
    upright = train_photos["astronaut"][20:220, 180:300].astype(int)
    assert np.abs(image.pixels[30:, :].astype(int) - upright[30:, :]).mean() < 6


def test_gif_gives_its_first_frame(image_folder):
    path = image_folder / "odd" / "animated.gif"
    image = decoded(path.read_bytes())
    assert image.notes[0] == "GIF: first of 3 frames"
    with Image.open(path) as gif:
        first = np.asarray(gif.convert("RGB"))
        gif.seek(1)
        second = np.asarray(gif.convert("RGB"))
    assert np.array_equal(image.pixels, first)
    assert np.abs(image.pixels.astype(int) - second.astype(int)).mean() > 10


def test_animated_webp_gives_its_first_frame():
    frames = [Image.new("RGB", (32, 24), color) for color in ((200, 0, 0), (0, 200, 0), (0, 0, 200))]
    data = encode(frames[0], "WEBP", save_all=True, append_images=frames[1:], lossless=True, duration=50)
    image = decoded(data)
    assert image.notes == ("WEBP: first of 3 frames",)
    assert (image.pixels == (200, 0, 0)).all()


# --- size bound ---------------------------------------------------------------------------


def gradient(width: int, height: int) -> Image.Image:
    y, x = np.mgrid[0:height, 0:width]
    return Image.fromarray(
        np.stack([x * 255 // width, y * 255 // height, np.full_like(x, 90)], -1).astype(np.uint8)
    )


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_downscale_respects_the_pixel_budget_and_aspect(fmt):
    image = decoded(encode(gradient(2000, 1000), fmt), max_decoded_pixels=100_000)
    height, width, _ = image.pixels.shape
    assert height * width <= 100_000
    assert height * width > 0.98 * 100_000
    assert abs(width / height - 2.0) < 0.01
    assert image.notes == (f"downscaled from 2000x1000 to {width}x{height}",)
    # still the same picture: red grows left to right, green top to bottom
    assert image.pixels[height // 2, 5, 0] < 20 and image.pixels[height // 2, -5, 0] > 235
    assert image.pixels[5, width // 2, 1] < 20 and image.pixels[-5, width // 2, 1] > 235


def test_downscale_uses_the_upright_size():
    exif = Image.Exif()
    exif[0x0112] = 6
    data = encode(gradient(2000, 1000), "JPEG", exif=exif)
    image = decoded(data, max_decoded_pixels=100_000)
    height, width, _ = image.pixels.shape
    assert height > width and height * width <= 100_000
    assert image.notes == ("exif orientation 6 applied", f"downscaled from 1000x2000 to {width}x{height}")


def test_no_downscale_within_the_budget():
    image = decoded(encode(gradient(300, 200), "PNG"), max_decoded_pixels=60_000)
    assert image.pixels.shape == (200, 300, 3) and image.notes == ()


# --- captions -----------------------------------------------------------------------------


def test_caption_sidecars_are_found_by_stem(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "cat.png")
    assert caption_sidecar(tmp_path / "cat.png") is None
    (tmp_path / "cat.caption").write_text("A cat.")
    assert caption_sidecar(tmp_path / "cat.png") == tmp_path / "cat.caption"
    (tmp_path / "cat.txt").write_text("A cat, again.")
    assert caption_sidecar(tmp_path / "cat.png") == tmp_path / "cat.txt"  # .txt comes first
    assert CAPTION_SUFFIXES[0] == ".txt" and ".webp" in IMAGE_SUFFIXES

    assert is_caption_of_image(tmp_path / "cat.txt")
    assert is_caption_of_image(tmp_path / "cat.caption")
    assert not is_caption_of_image(tmp_path / "cat.png")
    (tmp_path / "notes.txt").write_text("A document, not a caption.")
    assert not is_caption_of_image(tmp_path / "notes.txt")
    (tmp_path / "dog.JPG").write_bytes(b"")
    (tmp_path / "dog.txt").write_text("A dog.")
    assert is_caption_of_image(tmp_path / "dog.txt")
    assert caption_sidecar(tmp_path / "dog.JPG") == tmp_path / "dog.txt"


def test_read_caption(tmp_path):
    path = tmp_path / "c.txt"
    path.write_bytes(b"\xef\xbb\xbf  A cat on a mat.\n\n")
    assert read_caption(path) == ("A cat on a mat.", None)
    path.write_bytes(b"  \n\t\n")
    assert read_caption(path) == (None, None)
    path.write_bytes("caf\xe9".encode("latin-1"))
    assert read_caption(path) == (None, "caption is not valid UTF-8 at byte 3")
    path.write_bytes(b"abc\x00def")
    assert read_caption(path) == (None, "caption is binary (NUL bytes), not text")


# --- sample photos and folder -------------------------------------------------------------


def test_sample_photo_splits_are_disjoint_and_complete(train_photos):
    heldout = sample_photos("heldout")
    assert set(heldout) == set(HELD_OUT)
    assert not set(train_photos) & set(heldout)
    assert set(train_photos) | set(heldout) == set(PHOTOS)
    for pixels in [*train_photos.values(), *heldout.values()]:
        assert pixels.dtype == np.uint8 and pixels.ndim == 3 and pixels.shape[2] == 3
        assert min(pixels.shape[:2]) >= 128
    assert train_photos["astronaut"].shape == (512, 512, 3)
    assert np.array_equal(train_photos["camera"][..., 0], train_photos["camera"][..., 2])
    assert len({caption for _, caption in PHOTOS.values()}) == len(PHOTOS)
    with pytest.raises(ValueError, match="unknown photo split"):
        sample_photos("test")


def test_sample_folder_images_all_decode_with_their_captions(image_folder):
    images = sorted(p for p in image_folder.iterdir() if p.suffix in IMAGE_SUFFIXES)
    train = [name for name in PHOTOS if name not in HELD_OUT]
    assert len(images) == 3 * len(train)  # each photo and two variants
    assert {p.suffix for p in images} >= {".png", ".jpg", ".webp", ".bmp"}
    assert not any(p.stem.split("-")[0] in HELD_OUT for p in images)
    for path in images:
        image = decoded(path.read_bytes())
        assert min(image.pixels.shape[:2]) >= 96, path.name
        sidecar = caption_sidecar(path)
        assert sidecar is not None and is_caption_of_image(sidecar)
        assert read_caption(sidecar) == (PHOTOS[path.stem.split("-")[0]][1], None)
    crops = [decoded((image_folder / f"astronaut-crop{k}.jpg").read_bytes()).pixels for k in (1, 2)]
    assert np.abs(crops[0].astype(int) - crops[1].astype(int)).mean() > 10
    total = sum(p.stat().st_size for p in image_folder.rglob("*") if p.is_file())
    assert total < 3_000_000


def test_first_variant_is_a_mirrored_crop(image_folder):
    photo = decoded((image_folder / "astronaut.jpg").read_bytes()).pixels.astype(int)
    crop = decoded((image_folder / "astronaut-crop1.jpg").read_bytes()).pixels.astype(int)
    region = photo[: crop.shape[0], : crop.shape[1]]
    assert np.abs(crop - region[:, ::-1]).mean() < 6
    assert np.abs(crop - region).mean() > 20


def test_pairs_point_at_real_images_with_their_captions(image_folder):
    lines = (image_folder / "pairs.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) >= 3
    for line in lines:
        pair = json.loads(line)
        assert set(pair) == {"image", "text"}
        image_path = image_folder / pair["image"]
        decoded(image_path.read_bytes())
        assert read_caption(caption_sidecar(image_path)) == (pair["text"], None)


def test_write_sample_images_is_idempotent_and_follows_its_settings(tmp_path):
    folder = write_sample_images(tmp_path, variants=2)
    stamps = {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}
    assert write_sample_images(tmp_path, variants=2) == folder
    assert {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()} == stamps

    write_sample_images(tmp_path, with_bad_inputs=False, variants=1)
    assert not (folder / "bad").exists() and not (folder / "odd").exists()
    assert (folder / "astronaut-crop1.jpg").exists() and not (folder / "astronaut-crop2.jpg").exists()
    assert not (folder / "astronaut-crop2.txt").exists()


def test_sample_photos_decode_as_ingestion_decodes_them():
    """samples/ decodes the bundled photos with Pillow alone; ingestion's decoder gives the same pixels."""
    from importlib.resources import files

    folder = files("skimage.data")
    photos = sample_photos("all")
    assert len(photos) == len(PHOTOS)
    for name, (filename, _) in PHOTOS.items():
        decoded, problem = decode_image((folder / filename).read_bytes(), max_decoded_pixels=100_000_000)
        assert problem is None and np.array_equal(decoded.pixels, photos[name]), name
