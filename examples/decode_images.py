"""Decode JPEG and PNG files in DataLoader workers and batch them for training.

No downloads: it writes a folder of small generated images (half JPEG, half PNG) first, then
reads them back the way a training input pipeline does: each worker process decodes its files
with core.vision.read_image, and the transforms (random crop, flip, dtype conversion,
normalisation) run on the (C, H, W) uint8 tensors before the batches are collated.

    python examples/decode_images.py --images 64 --workers 2 --batch-size 16
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from shoal import core
from shoal.core import vision
from shoal.core.data import DataLoader, Dataset


def write_images(folder: Path, count: int, size: int, seed: int) -> list:
    """`count` generated RGB images (colour gradients with a square), alternately JPEG and PNG;
    returns (path, label) pairs, the label being which corner the square sits in."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 255, size, dtype=np.float64)
    items = []
    for i in range(count):
        pixels = np.empty((size, size, 3), dtype=np.float64)
        pixels[..., 0] = ramp[None, :]
        pixels[..., 1] = ramp[:, None]
        pixels[..., 2] = rng.uniform(0, 255)
        label = int(rng.integers(4))
        top, left = (label // 2) * size // 2, (label % 2) * size // 2
        pixels[top:top + size // 4, left:left + size // 4] = 255
        path = folder / f"img{i:04d}.{'jpg' if i % 2 else 'png'}"
        Image.fromarray(pixels.astype(np.uint8)).save(path)
        items.append((str(path), label))
    return items


class ImageFolder(Dataset):
    """(image, label) pairs decoded from files on access, in whichever process asks."""

    def __init__(self, items: list, transform: core.nn.Module) -> None:
        self.items, self.transform = items, transform

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        path, label = self.items[index]
        image = vision.read_image(path, vision.ImageReadMode.RGB)  # (3, H, W) uint8
        return self.transform(image), label


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--size", type=int, default=40, help="side of the generated images")
    parser.add_argument("--crop", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", "--batch_size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    transform = vision.Compose([
        vision.RandomCrop(args.crop),
        vision.RandomHorizontalFlip(),
        vision.ConvertImageDtype(core.float32),
        vision.Normalize(mean=[0.5, 0.5, 0.5], std=[0.25, 0.25, 0.25]),
    ])
    with tempfile.TemporaryDirectory() as tmp:
        items = write_images(Path(tmp), args.images, args.size, args.seed)
        loader = DataLoader(ImageFolder(items, transform), batch_size=args.batch_size,
                            shuffle=True, num_workers=args.workers, timeout=60,
                            generator=core.Generator().manual_seed(args.seed))
        start, seen = time.perf_counter(), 0
        for images, labels in loader:
            if tuple(images.shape[1:]) != (3, args.crop, args.crop) or images.dtype != core.float32:
                print(f"unexpected batch {tuple(images.shape)} {images.dtype}", file=sys.stderr)
                return 1
            seen += images.shape[0]
        elapsed = time.perf_counter() - start
    print(f"decoded and transformed {seen} images in {elapsed:.2f}s with {args.workers} "
          f"workers; last batch {tuple(images.shape)} {images.dtype}, labels {labels.tolist()}")
    return 0 if seen == args.images else 1


if __name__ == "__main__":
    sys.exit(main())
