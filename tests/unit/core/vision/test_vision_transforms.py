"""core.vision's transforms against torch: torchvision is not a test dependency, so each
reference is torchvision's tensor kernel written out in torch (its interpolate call, its crop
arithmetic, its random draws), as torchvision's source has it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from shoal import core
from shoal.core import vision
from shoal.core.vision import functional as VF

_RNG = np.random.default_rng(0)
BATCH = _RNG.random((2, 3, 17, 23)).astype(np.float32)
IMAGE_U8 = _RNG.integers(0, 256, (3, 19, 26)).astype(np.uint8)
# float32: torch's kernel and core's differ in the association of the weighted sums (and
# torch's vectorised loops may fuse them), a few ulp of values in [0, 1]: 1e-6 absolute.
F32 = {"rtol": 1e-5, "atol": 2e-6}


def _torch_resize(img: torch.Tensor, size: tuple, mode: str, antialias: bool) -> torch.Tensor:
    """torchvision's tensor resize: cast integers to float32, interpolate, round, cast back."""
    squeeze = img.ndim == 3
    x = img[None] if squeeze else img
    out_dtype = x.dtype
    x = x.float() if not x.is_floating_point() else x
    kwargs = {"align_corners": False, "antialias": antialias} if mode == "bilinear" else {}
    out = TF.interpolate(x, size=size, mode=mode, **kwargs)
    if out_dtype == torch.uint8:
        out = out.round().to(out_dtype)
    return out[0] if squeeze else out


@pytest.mark.parametrize("size", [(8, 10), (34, 40), (17, 11), (5, 50), (40, 9)])
@pytest.mark.parametrize("mode,antialias", [("bilinear", False), ("bilinear", True),
                                            ("nearest", False)])
def test_resize_of_a_float_batch_equals_torch(size, mode, antialias):
    mine = VF.resize(core.tensor(BATCH), list(size), mode, antialias=antialias)
    theirs = _torch_resize(torch.tensor(BATCH), size, mode, antialias)
    np.testing.assert_allclose(mine.numpy(), theirs.numpy(), **F32)
    single = vision.Resize(size, vision.InterpolationMode(mode), antialias=antialias)(
        core.tensor(BATCH[1]))
    np.testing.assert_allclose(single.numpy(), theirs[1].numpy(), **F32)


@pytest.mark.parametrize("size", [(9, 13), (38, 52), (19, 7)])
@pytest.mark.parametrize("mode,antialias", [("bilinear", False), ("bilinear", True),
                                            ("nearest", False)])
def test_resize_of_a_uint8_image_equals_torchvisions_float_path(size, mode, antialias):
    mine = VF.resize(core.tensor(IMAGE_U8), list(size), mode, antialias=antialias)
    theirs = _torch_resize(torch.tensor(IMAGE_U8), size, mode, antialias)
    assert mine.dtype is core.uint8
    # torch's vectorised kernel fuses multiply-adds (FMA) in an order that depends on its code
    # path, so its float32 value can differ from core's in the last bit, and a value that sits
    # on a .5 boundary (bilinear weights of few bits make exact ties common) can round the other
    # way: one step at most, on a few percent of pixels (1.1% measured on these sizes).
    diff = np.abs(mine.numpy().astype(int) - theirs.numpy().astype(int))
    assert diff.max() <= (0 if mode == "nearest" else 1)
    assert (diff != 0).mean() < 0.03


def test_resize_gradient_equals_torch():
    data = BATCH.astype(np.float64)
    for antialias, size in [(False, (9, 30)), (True, (7, 12)), (False, (40, 11))]:
        x, xt = core.tensor(data, requires_grad=True), torch.tensor(data, requires_grad=True)
        out = VF.resize(x, list(size), antialias=antialias)
        out_t = TF.interpolate(xt, size=size, mode="bilinear", align_corners=False,
                               antialias=antialias)
        w = _RNG.standard_normal(tuple(out_t.shape))
        (out * core.tensor(w)).sum().backward()
        (out_t * torch.tensor(w)).sum().backward()
        # float64: the same weights applied in another order, a few ulp of double.
        np.testing.assert_allclose(x.grad.numpy(), xt.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_resize_output_sizes_follow_torchvision():
    """torchvision's _compute_resized_output_size, worked by hand."""
    assert VF.resized_output_size((17, 23), 10) == [10, 13]  # 10 * 23 / 17 = 13.5 -> 13
    assert VF.resized_output_size((23, 17), [10]) == [13, 10]
    assert VF.resized_output_size((17, 23), 10, max_size=12) == [9, 12]  # 12 * 10 / 13 = 9.2
    assert VF.resized_output_size((17, 23), (5, 7)) == [5, 7]
    with pytest.raises(ValueError, match="must be strictly greater"):
        VF.resized_output_size((17, 23), 10, max_size=10)
    img = core.tensor(BATCH)
    assert tuple(vision.Resize(10)(img).shape) == (2, 3, 10, 13)
    assert vision.Resize((17, 23))(img) is img  # torchvision returns the same image


def test_normalize_equals_the_formula_and_refuses_what_torchvision_refuses():
    mean, std = [0.1, 0.2, 0.3], [0.5, 0.25, 2.0]
    out = vision.Normalize(mean, std)(core.tensor(BATCH))
    expected = (torch.tensor(BATCH) - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[
        :, None, None]
    np.testing.assert_allclose(out.numpy(), expected.numpy(), **F32)
    img = core.tensor(BATCH[0].copy())
    assert vision.Normalize(mean, std, inplace=True)(img) is img
    np.testing.assert_allclose(img.numpy(), expected[0].numpy(), **F32)
    with pytest.raises(TypeError, match="should be a float tensor"):
        vision.Normalize(mean, std)(core.tensor(IMAGE_U8))
    with pytest.raises(ValueError, match="std evaluated to zero"):
        vision.Normalize(mean, [1.0, 0.0, 1.0])(core.tensor(BATCH))
    with pytest.raises(ValueError, match=r"tensor image of size \(\.\.\., C, H, W\)"):
        vision.Normalize(mean, std)(core.ones(4, 4))
    x = core.tensor(BATCH.astype(np.float64), requires_grad=True)
    vision.Normalize(mean, std)(x).sum().backward()
    np.testing.assert_allclose(x.grad.numpy()[0, :, 0, 0], 1 / np.array(std))


def _torch_center_crop(img: torch.Tensor, th: int, tw: int) -> torch.Tensor:
    """torchvision.transforms.functional.center_crop on a tensor, as its source does it."""
    h, w = img.shape[-2:]
    if tw > w or th > h:
        pads = [(tw - w) // 2 if tw > w else 0, (th - h) // 2 if th > h else 0,
                (tw - w + 1) // 2 if tw > w else 0, (th - h + 1) // 2 if th > h else 0]
        img = TF.pad(img, (pads[0], pads[2], pads[1], pads[3]))
        h, w = img.shape[-2:]
        if tw == w and th == h:
            return img
    top, left = int(round((h - th) / 2.0)), int(round((w - tw) / 2.0))
    return img[..., top:top + th, left:left + tw]


@pytest.mark.parametrize("size", [(8, 8), (16, 22), (17, 23), (9, 24), (20, 30), 5, [7]])
def test_center_crop_equals_torchvision(size):
    th, tw = (size, size) if isinstance(size, int) else (size * 2 if len(size) == 1 else size)
    mine = vision.CenterCrop(size)(core.tensor(BATCH))
    theirs = _torch_center_crop(torch.tensor(BATCH), th, tw)
    assert tuple(mine.shape) == tuple(theirs.shape)
    np.testing.assert_array_equal(mine.numpy(), theirs.numpy())


@pytest.mark.parametrize("seed", [0, 1, 7])
@pytest.mark.parametrize("kwargs", [{}, {"padding": 2}, {"padding": (1, 3)},
                                    {"pad_if_needed": True, "size": (20, 30)}])
def test_random_crop_makes_torchvisions_draws_for_a_seed(seed, kwargs):
    kwargs = dict(kwargs)
    th, tw = size = kwargs.pop("size", (12, 15))
    crop = vision.RandomCrop(size, generator=core.Generator().manual_seed(seed), **kwargs)
    mine = crop(core.tensor(IMAGE_U8))
    torch.manual_seed(seed)
    img = torch.tensor(IMAGE_U8)
    padding = kwargs.get("padding")
    if padding is not None:
        lr, tb = (padding, padding) if isinstance(padding, int) else padding
        img = TF.pad(img, (lr, lr, tb, tb))
    if kwargs.get("pad_if_needed"):
        h, w = img.shape[-2:]
        img = TF.pad(img, (max(tw - w, 0),) * 2 + (max(th - h, 0),) * 2)
    h, w = img.shape[-2:]
    top = torch.randint(0, h - th + 1, size=(1,)).item()  # torchvision's RandomCrop.get_params
    left = torch.randint(0, w - tw + 1, size=(1,)).item()
    np.testing.assert_array_equal(mine.numpy(), img[..., top:top + th, left:left + tw].numpy())


@pytest.mark.parametrize("cls,dim", [(vision.RandomHorizontalFlip, -1),
                                     (vision.RandomVerticalFlip, -2)])
def test_random_flips_make_torchvisions_draws_for_a_seed(cls, dim):
    flip = cls(p=0.5, generator=core.Generator().manual_seed(3))
    torch.manual_seed(3)
    flipped = 0
    for _ in range(12):
        mine = flip(core.tensor(BATCH))
        theirs = torch.tensor(BATCH)
        if torch.rand(1) < 0.5:  # torchvision's draw
            theirs = theirs.flip(dim)
            flipped += 1
        np.testing.assert_array_equal(mine.numpy(), theirs.numpy())
    assert 0 < flipped < 12  # both outcomes were exercised
    assert cls(p=0.0)(core.tensor(BATCH)).numpy().tobytes() == BATCH.tobytes()


def test_convert_image_dtype_equals_torchvisions_formulas():
    u8 = torch.tensor(IMAGE_U8)
    as_float = vision.ConvertImageDtype(core.float32)(core.tensor(IMAGE_U8))
    np.testing.assert_allclose(as_float.numpy(), (u8.float() / 255).numpy(), **F32)
    floats = torch.tensor(BATCH)
    back = vision.ConvertImageDtype(core.uint8)(core.tensor(BATCH))
    assert back.dtype is core.uint8
    expected = (floats * (255 + 1.0 - 1e-3)).to(torch.uint8)
    np.testing.assert_array_equal(back.numpy(), expected.numpy())
    wider = vision.ConvertImageDtype(core.int32)(core.tensor(IMAGE_U8))
    np.testing.assert_array_equal(wider.numpy(), (u8.to(torch.int32) * 2**23).numpy())
    narrower = VF.convert_image_dtype(wider, core.uint8)
    np.testing.assert_array_equal(narrower.numpy(), IMAGE_U8)
    assert VF.convert_image_dtype(core.tensor(BATCH), core.float64).dtype is core.float64
    with pytest.raises(RuntimeError, match="cannot be performed safely"):
        VF.convert_image_dtype(core.tensor(BATCH), core.int32)


def test_compose_is_a_module_and_applies_in_order():
    pipeline = vision.Compose([vision.CenterCrop(12), vision.ConvertImageDtype(core.float32),
                               vision.Normalize([0.5] * 3, [0.5] * 3)])
    assert isinstance(pipeline, core.nn.Module)
    out = pipeline(core.tensor(IMAGE_U8))
    expected = (_torch_center_crop(torch.tensor(IMAGE_U8), 12, 12).float() / 255 - 0.5) / 0.5
    np.testing.assert_allclose(out.numpy(), expected.numpy(), **F32)
    assert "CenterCrop" in repr(pipeline)
    assert [type(m).__name__ for m in pipeline.children()] == [
        "CenterCrop", "ConvertImageDtype", "Normalize"]


def test_gradients_flow_through_crops_flips_and_padding_as_in_torch():
    data = BATCH.astype(np.float64)
    x, xt = core.tensor(data, requires_grad=True), torch.tensor(data, requires_grad=True)
    out = VF.crop(VF.hflip(VF.vflip(x)), -2, 3, 12, 25)  # leaves the image at the top and right
    flipped = xt.flip(-1).flip(-2)
    out_t = TF.pad(flipped, (0, 5, 2, 0))[..., 0:12, 3:28]
    np.testing.assert_array_equal(out.detach().numpy(), out_t.detach().numpy())
    w = _RNG.standard_normal(tuple(out_t.shape))
    (out * core.tensor(w)).sum().backward()
    (out_t * torch.tensor(w)).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), xt.grad.numpy())


def _torch_rrc_params(height, width, scale, ratio):
    """torchvision's RandomResizedCrop.get_params, as its source has it."""
    import math

    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = torch.randint(0, height - h + 1, size=(1,)).item()
            j = torch.randint(0, width - w + 1, size=(1,)).item()
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


@pytest.mark.parametrize("scale,ratio", [((0.08, 1.0), (3 / 4, 4 / 3)), ((0.5, 0.9), (0.5, 2.0)),
                                         ((0.99, 1.0), (3.0, 4.0))])
def test_random_resized_crop_makes_torchvisions_draws_for_a_seed(scale, ratio):
    """The last case cannot fit its ratio, so all ten tries fail and the central fallback runs."""
    for seed in range(8):
        rrc = vision.RandomResizedCrop((7, 9), scale, ratio,
                                       generator=core.Generator().manual_seed(seed))
        torch.manual_seed(seed)
        assert rrc.get_params(19, 26) == _torch_rrc_params(19, 26, scale, ratio), seed
    rrc = vision.RandomResizedCrop(8, scale, ratio, generator=core.Generator().manual_seed(1))
    torch.manual_seed(1)
    top, left, h, w = _torch_rrc_params(19, 26, scale, ratio)
    expected = _torch_resize(torch.tensor(IMAGE_U8)[..., top:top + h, left:left + w], (8, 8),
                             "bilinear", True)
    mine = rrc(core.tensor(IMAGE_U8))
    assert tuple(mine.shape) == (3, 8, 8)
    # The same crop resized as torchvision does (uint8 through float32: see the resize test).
    assert np.abs(mine.numpy().astype(int) - expected.numpy().astype(int)).max() <= 1
