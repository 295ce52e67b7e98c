"""torchvision.io's image decoding: JPEG and PNG bytes to (C, H, W) uint8 tensors, via Pillow.

Pillow (the `vision` extra) decodes with libjpeg-turbo and zlib, the libraries torchvision's own
decoders use. A palette PNG comes out as RGB (RGBA with a transparency entry), as libpng expands
it for torchvision; 16-bit PNGs are refused (core has no uint16 dtype).
"""

from __future__ import annotations

import enum
import io
import os
from typing import Any

import numpy as np

from shoal.core.errors import ShoalError
from shoal.core.tensor import Tensor


class ImageDecodeError(ShoalError, RuntimeError):
    """Bytes that are not a JPEG or PNG image shoal can decode."""


class ImageReadMode(enum.Enum):
    """The channels to decode to: as stored, or converted to gray / RGB, with or without alpha."""

    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4
    RGBA = 4


_PIL_MODE = {ImageReadMode.GRAY: "L", ImageReadMode.GRAY_ALPHA: "LA",
             ImageReadMode.RGB: "RGB", ImageReadMode.RGB_ALPHA: "RGBA"}
_KEEP = {"L": "L", "LA": "LA", "RGB": "RGB", "RGBA": "RGBA", "1": "L", "CMYK": "RGB",
         "YCbCr": "RGB", "La": "LA", "RGBa": "RGBA", "I;16": None, "I;16B": None, "I": None}


def _pillow() -> Any:
    try:
        from PIL import Image  # noqa: PLC0415 - optional: the `vision` extra
    except ImportError as exc:
        raise ImportError("core.vision's image decoding needs Pillow: pip install "
                          "'shoal[vision]' (or pillow).") from exc
    return Image


def read_file(path: str | os.PathLike) -> Tensor:
    """A file's bytes as a 1-D uint8 tensor."""
    with open(path, "rb") as f:
        return Tensor(np.frombuffer(f.read(), dtype=np.uint8).copy())


def _bytes_of(data: Any, op: str) -> bytes:
    if not isinstance(data, Tensor):
        raise TypeError(f"{op}: expected a Tensor of bytes, got {type(data).__name__}.")
    arr = data.numpy(force=True)
    if arr.dtype != np.uint8:
        raise RuntimeError(f"Expected a torch.uint8 tensor, got {data.dtype!r}.")
    if arr.ndim != 1 or arr.size == 0:
        raise RuntimeError(f"Expected a non empty 1-dimensional tensor, got shape "
                           f"{tuple(arr.shape)}.")
    return arr.tobytes()


def _decode(raw: bytes, mode: ImageReadMode, expect: str | None, op: str) -> Tensor:
    Image = _pillow()
    try:
        img = Image.open(io.BytesIO(raw))
        kind = img.format
        if expect is not None and kind != expect:
            raise ImageDecodeError(f"{op}: the data is a {kind} image, not {expect}.")
        if kind not in ("JPEG", "PNG"):
            raise ImageDecodeError(f"{op}: unsupported image format {kind}; JPEG and PNG are "
                                   "decoded.")
        img.load()
    except (OSError, SyntaxError, ValueError) as exc:
        raise ImageDecodeError(f"{op}: the data is not a JPEG or PNG image Pillow can decode "
                               f"({exc}).") from exc
    img = _convert(img, ImageReadMode(mode), op)
    arr = np.asarray(img, dtype=np.uint8)
    if arr.ndim == 2:
        arr = arr[:, :, None]
    return Tensor(np.ascontiguousarray(arr.transpose(2, 0, 1)))


def _convert(img: Any, mode: ImageReadMode, op: str) -> Any:
    """The Pillow image in the channels `mode` asks for."""
    if img.mode == "P":  # palette: expanded as libpng does
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
    if mode is ImageReadMode.UNCHANGED:
        if img.mode not in _KEEP or _KEEP[img.mode] is None:
            raise ImageDecodeError(f"{op}: images of Pillow mode {img.mode!r} (16-bit or "
                                   "float samples) are not supported; core has no uint16.")
        target = _KEEP[img.mode]
    else:
        target = _PIL_MODE[mode]
    return img if img.mode == target else img.convert(target)


def decode_image(input: Tensor, mode: ImageReadMode = ImageReadMode.UNCHANGED) -> Tensor:  # noqa: A002
    """A JPEG or PNG image (a 1-D uint8 tensor of its bytes) as a (C, H, W) uint8 tensor."""
    return _decode(_bytes_of(input, "decode_image"), mode, None, "decode_image")


def decode_jpeg(input: Tensor, mode: ImageReadMode = ImageReadMode.UNCHANGED) -> Tensor:  # noqa: A002
    """A JPEG image's bytes as a (C, H, W) uint8 tensor."""
    return _decode(_bytes_of(input, "decode_jpeg"), mode, "JPEG", "decode_jpeg")


def decode_png(input: Tensor, mode: ImageReadMode = ImageReadMode.UNCHANGED) -> Tensor:  # noqa: A002
    """A PNG image's bytes as a (C, H, W) uint8 tensor."""
    return _decode(_bytes_of(input, "decode_png"), mode, "PNG", "decode_png")


def read_image(path: str | os.PathLike, mode: ImageReadMode = ImageReadMode.UNCHANGED) -> Tensor:
    """Read and decode a JPEG or PNG file to a (C, H, W) uint8 tensor."""
    return decode_image(read_file(path), mode)
