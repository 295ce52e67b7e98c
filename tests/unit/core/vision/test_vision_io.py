"""core.vision's JPEG/PNG decoding: lossless round trips, channel modes, errors, and the
DataLoader example that decodes in worker processes."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from shoal import core
from shoal.core import vision

ROOT = Path(__file__).resolve().parents[4]
_RNG = np.random.default_rng(0)
RGB = _RNG.integers(0, 256, (21, 17, 3)).astype(np.uint8)
RGBA = _RNG.integers(0, 256, (9, 14, 4)).astype(np.uint8)
GRAY = _RNG.integers(0, 256, (12, 8)).astype(np.uint8)


def _encode(array: np.ndarray, fmt: str, mode: str | None = None, **kwargs) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array, mode=mode).save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def _bytes(data: bytes) -> core.Tensor:
    return core.tensor(np.frombuffer(data, dtype=np.uint8))


@pytest.mark.parametrize("array,channels", [(RGB, 3), (RGBA, 4), (GRAY, 1)])
def test_png_round_trips_exactly_as_chw_uint8(array, channels):
    out = vision.decode_png(_bytes(_encode(array, "PNG")))
    assert out.dtype is core.uint8 and out.ndim == 3 and out.shape[0] == channels
    expected = array if array.ndim == 3 else array[:, :, None]
    np.testing.assert_array_equal(out.numpy(), expected.transpose(2, 0, 1))
    assert vision.decode_image(_bytes(_encode(array, "PNG"))).numpy().tobytes() == (
        out.numpy().tobytes())


def test_read_image_reads_a_file(tmp_path):
    path = tmp_path / "pic.png"
    Image.fromarray(RGB).save(path)
    np.testing.assert_array_equal(vision.read_image(path).numpy(), RGB.transpose(2, 0, 1))
    raw = vision.read_file(str(path))
    assert raw.dtype is core.uint8 and raw.ndim == 1 and raw.numpy().tobytes() == path.read_bytes()


def test_jpeg_decodes_to_the_image_it_encoded_within_the_codecs_loss():
    ramp = np.linspace(0, 255, 48)
    smooth = np.stack([ramp[None, :].repeat(32, 0), ramp[:32, None].repeat(48, 1),
                       np.full((32, 48), 90.0)], axis=-1).astype(np.uint8)
    out = vision.decode_jpeg(_bytes(_encode(smooth, "JPEG", quality=95)))
    assert out.dtype is core.uint8 and tuple(out.shape) == (3, 32, 48)
    # Quality 95 on a smooth image: libjpeg's error stays within a few levels per pixel.
    err = np.abs(out.numpy().astype(int) - smooth.transpose(2, 0, 1).astype(int))
    assert err.mean() < 2 and err.max() <= 12
    gray = vision.decode_image(_bytes(_encode(GRAY, "JPEG", quality=95)))
    assert tuple(gray.shape) == (1, 12, 8)


@pytest.mark.parametrize("mode,channels,pil", [
    (vision.ImageReadMode.GRAY, 1, "L"), (vision.ImageReadMode.GRAY_ALPHA, 2, "LA"),
    (vision.ImageReadMode.RGB, 3, "RGB"), (vision.ImageReadMode.RGB_ALPHA, 4, "RGBA")])
def test_read_modes_convert_channels(mode, channels, pil):
    data = _bytes(_encode(RGBA, "PNG"))
    out = vision.decode_image(data, mode)
    assert out.shape[0] == channels
    expected = np.asarray(Image.fromarray(RGBA).convert(pil))
    expected = expected if expected.ndim == 3 else expected[:, :, None]
    np.testing.assert_array_equal(out.numpy(), expected.transpose(2, 0, 1))


def test_a_palette_png_expands_to_rgb_as_libpng_does():
    palette = Image.fromarray(RGB).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    buf = io.BytesIO()
    palette.save(buf, format="PNG")
    out = vision.decode_image(_bytes(buf.getvalue()))
    np.testing.assert_array_equal(out.numpy(),
                                  np.asarray(palette.convert("RGB")).transpose(2, 0, 1))


def test_errors_are_clear():
    with pytest.raises(vision.ImageDecodeError, match="not a JPEG or PNG image"):
        vision.decode_image(_bytes(b"definitely not an image"))
    with pytest.raises(RuntimeError, match="Expected a torch.uint8 tensor"):
        vision.decode_image(core.ones(10))
    with pytest.raises(RuntimeError, match="non empty 1-dimensional"):
        vision.decode_image(core.zeros(2, 3, dtype=core.uint8))
    with pytest.raises(vision.ImageDecodeError, match="not PNG"):
        vision.decode_png(_bytes(_encode(RGB, "JPEG")))
    with pytest.raises(vision.ImageDecodeError, match="unsupported image format GIF"):
        vision.decode_image(_bytes(_encode(RGB, "GIF")))
    wide = np.arange(12, dtype=np.uint16).reshape(3, 4) * 5000
    with pytest.raises(vision.ImageDecodeError, match="16-bit"):
        vision.decode_image(_bytes(_encode(wide, "PNG")))
    assert issubclass(vision.ImageDecodeError, RuntimeError)


def test_the_example_decodes_in_dataloader_workers():
    """examples/decode_images.py: two worker processes decode JPEGs and PNGs into batches."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "decode_images.py"), "--images", "24",
         "--workers", "2", "--batch-size", "8"],
        capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "decoded and transformed 24 images" in done.stdout
    assert "(8, 3, 32, 32) core.float32" in done.stdout
