"""Images for training (torchvision's names): transforms as Modules, JPEG/PNG decoding."""

from shoal.core.vision import functional, io, transforms
from shoal.core.vision.io import (
    ImageDecodeError, ImageReadMode, decode_image, decode_jpeg, decode_png, read_file, read_image,
)
from shoal.core.vision.transforms import (
    CenterCrop, Compose, ConvertImageDtype, InterpolationMode, Normalize, RandomCrop,
    RandomHorizontalFlip, RandomResizedCrop, RandomVerticalFlip, Resize,
)

__all__ = [
    "functional", "io", "transforms", "ImageDecodeError", "ImageReadMode", "decode_image",
    "decode_jpeg", "decode_png", "read_file", "read_image", "CenterCrop", "Compose",
    "ConvertImageDtype", "InterpolationMode", "Normalize", "RandomCrop", "RandomHorizontalFlip",
    "RandomResizedCrop", "RandomVerticalFlip", "Resize",
]
