"""torchvision.transforms as core.nn Modules on (C, H, W) and (N, C, H, W) image tensors.

The random transforms draw as torchvision's do (RandomCrop: randint for the top, then for the
left; the flips: rand(1) < p) from a `generator` when one is given: core.Generator is torch's
CPU Mersenne Twister, so `generator=core.Generator().manual_seed(s)` makes the choices that
torchvision makes after `torch.manual_seed(s)`. Without one they draw from core's global
generator (core.manual_seed), which is what DataLoader workers seed one by one: a generator given
here is copied into every worker with one state. A batch gets one draw for all its images, as in
torchvision.
"""

from __future__ import annotations

import enum
import math
from typing import Any, Sequence

import numpy as np

from shoal.core import dtypes
from shoal.core.nn.module import Module
from shoal.core.ops import creation
from shoal.core.tensor import Tensor
from shoal.core.vision import functional as F


class InterpolationMode(enum.Enum):
    """torchvision's interpolation modes that core.vision implements."""

    NEAREST = "nearest"
    BILINEAR = "bilinear"


class Compose(Module):
    """Apply transforms one after another."""

    def __init__(self, transforms: Sequence[Any]) -> None:
        super().__init__()
        self.transforms = list(transforms)
        for i, t in enumerate(self.transforms):
            if isinstance(t, Module):
                self.add_module(str(i), t)

    def forward(self, img: Any) -> Any:
        """img through every transform in order."""
        for t in self.transforms:
            img = t(img)
        return img

    def __repr__(self) -> str:
        body = "".join(f"\n    {t!r}" for t in self.transforms)
        return f"{type(self).__name__}({body}\n)"


class Normalize(Module):
    """(img - mean) / std per channel of a float image."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], inplace: bool = False) -> None:
        super().__init__()
        self.mean, self.std, self.inplace = list(mean), list(std), inplace

    def forward(self, tensor: Tensor) -> Tensor:
        """The normalised image."""
        return F.normalize(tensor, self.mean, self.std, self.inplace)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(mean={self.mean}, std={self.std})"


class Resize(Module):
    """Resize to `size`: (h, w), or an int for the smaller edge (aspect ratio kept)."""

    def __init__(self, size: Any, interpolation: Any = InterpolationMode.BILINEAR,
                 max_size: int | None = None, antialias: bool | None = True) -> None:
        super().__init__()
        if not isinstance(size, (int, Sequence)) or (
                isinstance(size, Sequence) and len(size) not in (1, 2)):
            raise TypeError(f"Size should be int or sequence. Got {type(size)}")
        self.size, self.max_size, self.antialias = size, max_size, antialias
        self.interpolation = InterpolationMode(getattr(interpolation, "value", interpolation))

    def forward(self, img: Tensor) -> Tensor:
        """The resized image."""
        return F.resize(img, self.size, self.interpolation.value, self.max_size, self.antialias)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(size={self.size}, interpolation="
                f"{self.interpolation.value}, max_size={self.max_size}, "
                f"antialias={self.antialias})")


class CenterCrop(Module):
    """The central (h, w) window, zero-padded where the image is smaller."""

    def __init__(self, size: Any) -> None:
        super().__init__()
        self.size = F._size_pair(size, "CenterCrop")  # noqa: SLF001 - the module's own kernel

    def forward(self, img: Tensor) -> Tensor:
        """The cropped image."""
        return F.center_crop(img, self.size)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size})"


class RandomCrop(Module):
    """A random (h, w) window, after optional constant padding (torchvision's draws)."""

    def __init__(self, size: Any, padding: Any = None, pad_if_needed: bool = False,
                 fill: float = 0, padding_mode: str = "constant", *,
                 generator: Any = None) -> None:
        super().__init__()
        if padding_mode != "constant":
            raise ValueError(f"RandomCrop: core.vision pads with a constant only, got "
                             f"padding_mode={padding_mode!r}.")
        self.size = F._size_pair(size, "RandomCrop")  # noqa: SLF001 - the module's own kernel
        self.padding, self.pad_if_needed, self.fill = padding, pad_if_needed, fill
        self.generator = generator

    def forward(self, img: Tensor) -> Tensor:
        """A random crop of the (padded) image."""
        if self.padding is not None:
            img = F.pad(img, _lrtb(self.padding), self.fill)
        h, w = img.shape[-2:]
        th, tw = self.size
        if self.pad_if_needed and w < tw:
            img = F.pad(img, (tw - w, tw - w, 0, 0), self.fill)
        if self.pad_if_needed and h < th:
            img = F.pad(img, (0, 0, th - h, th - h), self.fill)
        h, w = img.shape[-2:]
        if h < th or w < tw:
            raise ValueError(f"Required crop size {(th, tw)} is larger than input image size "
                             f"{(h, w)}")
        if (h, w) == (th, tw):
            return F.crop(img, 0, 0, h, w)
        top = int(creation.randint(0, h - th + 1, size=(1,), generator=self.generator).item())
        left = int(creation.randint(0, w - tw + 1, size=(1,), generator=self.generator).item())
        return F.crop(img, top, left, th, tw)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, padding={self.padding})"


def _lrtb(padding: Any) -> tuple:
    """torchvision's padding argument (all sides, (lr, tb) or (l, t, r, b)) as (l, r, t, b)."""
    if isinstance(padding, int):
        return padding, padding, padding, padding
    if len(padding) == 1:
        return (padding[0],) * 4
    if len(padding) == 2:
        return padding[0], padding[0], padding[1], padding[1]
    if len(padding) == 4:
        return padding[0], padding[2], padding[1], padding[3]
    raise ValueError(f"Padding must be an int or a 1, 2, or 4 element tuple, not a "
                     f"{len(padding)} element tuple")


class _RandomFlip(Module):
    def __init__(self, p: float = 0.5, *, generator: Any = None) -> None:
        super().__init__()
        self.p, self.generator = p, generator

    def _flips(self) -> bool:
        return float(creation.rand(1, generator=self.generator).item()) < self.p

    def __repr__(self) -> str:
        return f"{type(self).__name__}(p={self.p})"


class RandomHorizontalFlip(_RandomFlip):
    """Mirror left to right with probability p."""

    def forward(self, img: Tensor) -> Tensor:
        """The image, flipped or not."""
        return F.hflip(img) if self._flips() else img


class RandomVerticalFlip(_RandomFlip):
    """Mirror top to bottom with probability p."""

    def forward(self, img: Tensor) -> Tensor:
        """The image, flipped or not."""
        return F.vflip(img) if self._flips() else img


class RandomResizedCrop(Module):
    """A random window of random area and aspect ratio, resized to `size` (torchvision's draws:
    up to ten tries of area in `scale` and log-uniform ratio in `ratio`, then a central crop)."""

    def __init__(self, size: Any, scale: tuple = (0.08, 1.0), ratio: tuple = (3.0 / 4.0, 4.0 / 3.0),
                 interpolation: Any = InterpolationMode.BILINEAR, antialias: bool | None = True,
                 *, generator: Any = None) -> None:
        super().__init__()
        self.size = F._size_pair(size, "RandomResizedCrop")  # noqa: SLF001 - the module's kernel
        if scale[0] > scale[1] or ratio[0] > ratio[1]:
            raise ValueError(f"RandomResizedCrop: scale and ratio should be of kind (min, max), "
                             f"got scale={scale}, ratio={ratio}.")
        self.scale, self.ratio, self.antialias = tuple(scale), tuple(ratio), antialias
        self.interpolation = InterpolationMode(getattr(interpolation, "value", interpolation))
        self.generator = generator

    def _uniform(self, low: float, high: float) -> float:
        """torch's float32 uniform_(low, high): 24 random bits, scaled in double, rounded."""
        u = float(creation.rand(1, generator=self.generator).item())
        return float(np.float32(low + u * (high - low)))

    def get_params(self, height: int, width: int) -> tuple:
        """(top, left, height, width) of the window, as torchvision's get_params draws it."""
        area = height * width
        log_ratio = np.log(np.asarray(self.ratio, dtype=np.float32))
        for _ in range(10):
            target_area = area * self._uniform(self.scale[0], self.scale[1])
            aspect = float(np.exp(np.float32(self._uniform(float(log_ratio[0]),
                                                            float(log_ratio[1])))))
            w = int(round(math.sqrt(target_area * aspect)))
            h = int(round(math.sqrt(target_area / aspect)))
            if 0 < w <= width and 0 < h <= height:
                top = int(creation.randint(0, height - h + 1, size=(1,),
                                           generator=self.generator).item())
                left = int(creation.randint(0, width - w + 1, size=(1,),
                                            generator=self.generator).item())
                return top, left, h, w
        in_ratio = width / height
        if in_ratio < min(self.ratio):
            w, h = width, int(round(width / min(self.ratio)))
        elif in_ratio > max(self.ratio):
            h, w = height, int(round(height * max(self.ratio)))
        else:
            w, h = width, height
        return (height - h) // 2, (width - w) // 2, h, w

    def forward(self, img: Tensor) -> Tensor:
        """The resized random crop."""
        top, left, h, w = self.get_params(*img.shape[-2:])
        return F.resize(F.crop(img, top, left, h, w), list(self.size), self.interpolation.value,
                        antialias=self.antialias)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(size={self.size}, scale={self.scale}, ratio={self.ratio})"


class ConvertImageDtype(Module):
    """Convert an image's dtype, scaling its values as torchvision does."""

    def __init__(self, dtype: Any) -> None:
        super().__init__()
        self.dtype = dtypes.get(dtype)

    def forward(self, image: Tensor) -> Tensor:
        """The converted image."""
        return F.convert_image_dtype(image, self.dtype)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(dtype={self.dtype!r})"
