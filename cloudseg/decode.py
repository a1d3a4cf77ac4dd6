"""Where the data path's samples are decoded and augmented: in the DataLoader workers
(`data.decode: cpu`) or on the GPU (`gpu`); `auto`, the default, picks gpu when the run is
on CUDA (`resolve_decode`, which training, validation, out-of-fold and test prediction ask).

At 1400×2100 a sample is a JPEG decode, four full-size RLE decodes, augmentation and
about 20 MB of copies: CPU work that stops scaling before the GPU is fed. In gpu mode a
worker only reads the JPEG's bytes (header checked, not decoded), parses and checks the
four RLE strings into runs (`rle.runs`), and draws the augmentation with the very
albumentations transform the CPU path runs, seeded the same (`draw_steps`): the JPEG and tens
of kilobytes a sample, instead of 20 MB. `decode_batch` then decodes the micro-batch on the
GPU, images with nvjpeg (`torchvision.io.decode_jpeg` on a list) and masks with one batched
RLE decode (`rle.decode_runs`), and replays each item's steps there (`replay`).

The replay computes what albumentations 2.0 with OpenCV 5.0 computes on the CPU: flips and
the no-data band exactly; brightness/contrast through the 256-entry table that
albumentations itself builds for uint8 images; the affine warp from OpenCV's own inverse
matrix with OpenCV's float32 arithmetic (source coordinates, rounding, bilinear weights),
so masks (nearest) and images (bilinear) come out as OpenCV's, bit for bit on the x86 CPUs
measured (see tests/test_decode.py). A transform with a step it cannot replay is refused
when it is set (`check_replayable`). Everything here is device-generic: with
`device="cpu"` the tests run the whole path without a GPU.
"""

from __future__ import annotations

import re

import cv2
import numpy as np
import torch

from cloudseg import rle
from cloudseg.syncs import named_sync
from cloudseg.task import LABELS

ENCODED_KEYS = ("image", "runs", "augment")  # what a gpu-mode item holds that decode_batch turns into tensors

# Every uint8 value in each of three channels: a pixel-wise step applied to it is its lookup table.
_RAMP = np.repeat(np.arange(256, dtype=np.uint8)[None, :, None], 3, axis=2)

# OpenCV's warpAffine maps whole groups of 16 output columns with AVX2 vector instructions
# and the rest of each row with a scalar loop that orders its float32 operations differently.
_VECTOR_COLUMNS = 16


def resolve_decode(mode: str, device: torch.device | str) -> str:
    """`data.decode` for a run on `device`: auto = gpu on a CUDA device, else cpu; gpu without
    CUDA is refused."""
    device = torch.device(device)
    if mode == "auto":
        return "gpu" if device.type == "cuda" else "cpu"
    if mode == "gpu" and device.type != "cuda":
        raise ValueError(f"data.decode=gpu needs a CUDA GPU, but this runs on {device}; use data.decode=auto or cpu")
    return mode


# ---------------------------------------------------------------------------------- in the workers


def check_replayable(transform) -> None:
    """Refuse a transform with a step that gpu mode cannot replay on the device, naming it."""
    if transform is None:
        return
    import albumentations as A  # here, as in each function that needs it: only training augments (a second to import)

    if not isinstance(transform, A.Compose):
        raise ValueError(f"data.decode=gpu replays an A.Compose of steps, got {type(transform).__name__}")
    for step in transform.transforms:
        problem = _unreplayable(step)
        if problem:
            raise ValueError(f"data.decode=gpu cannot replay {type(step).__name__} on the GPU ({problem}); "
                             "use data.decode=cpu")


def _unreplayable(step) -> str | None:
    """Why `step` cannot be replayed, or None."""
    import albumentations as A

    if isinstance(step, (A.HorizontalFlip, A.VerticalFlip)):
        return None
    if isinstance(step, A.XYMasking):
        return None if _zero(step.fill) and _zero(step.fill_mask) else "only fill=0 and fill_mask=0"
    if isinstance(step, A.Affine):
        settings = (step.interpolation, step.mask_interpolation, step.border_mode, step.fit_output)
        if settings != (cv2.INTER_LINEAR, cv2.INTER_NEAREST, cv2.BORDER_CONSTANT, False):
            return "only bilinear images, nearest masks, a constant border and fit_output=False"
        return None if _zero(step.fill) and _zero(step.fill_mask) else "only fill=0 and fill_mask=0"
    if isinstance(step, A.RandomBrightnessContrast):
        return None if step.brightness_by_max else "brightness_by_max=False depends on the decoded image"
    return "not one of the steps gpu mode replays"


def _zero(fill) -> bool:
    return not isinstance(fill, str) and fill is not None and bool(np.all(np.asarray(fill) == 0))


def draw_steps(transform, shape: tuple[int, int]) -> list[tuple[str, torch.Tensor | np.ndarray | None]]:
    """The steps `transform` applies now to an H×W image (`shape`) and their parameters, in
    order, as (name, value) for `replay`, drawn without an image. The values the device needs
    (a warp's inverse map, a lookup table) are CPU tensors, which the loader pins, so that they
    travel with the batch without a blocking copy.

    The draws are albumentations' own, in the order `Compose.__call__` and
    `BasicTransform.__call__` make them (whether the compose and each step apply, then each
    step's parameters), so the random state moves exactly as it does when the CPU path runs
    the transform on the decoded image and masks with the same seed.
    """
    if transform is None:
        return []
    data = {"image": np.broadcast_to(np.zeros((), np.uint8), (*shape, 3))}  # its shape and dtype, no pixels
    if not transform.py_random.random() < transform.p:
        return []
    steps = []
    for step in transform.transforms:
        if step.should_apply():
            params = step.update_transform_params(step.get_params(), data)
            params.update(step.get_params_dependent_on_data(params, data))
            steps += _replay_step(step, params)
    return steps


def _replay_step(step, params: dict) -> list[tuple[str, torch.Tensor | np.ndarray | None]]:
    """What the device needs to replay one drawn step (nothing for a step that changes nothing)."""
    import albumentations as A
    from albumentations.augmentations.geometric.functional import is_identity_matrix

    if isinstance(step, A.HorizontalFlip):
        return [("hflip", None)]
    if isinstance(step, A.VerticalFlip):
        return [("vflip", None)]
    if isinstance(step, A.XYMasking):
        return [("blank", params["holes"])] if len(params["holes"]) else []
    if isinstance(step, A.Affine):  # albumentations skips an identity warp
        if is_identity_matrix(params["matrix"]):
            return []
        inverse = cv2.invertAffineTransform(params["matrix"][:2])
        return [("affine", torch.from_numpy(inverse).float())]  # OpenCV casts the map to float32 too
    lut = step.apply(_RAMP, **params)  # RandomBrightnessContrast: albumentations' own uint8 table
    return [("lut", torch.from_numpy(np.ascontiguousarray(lut[0].T)))]


# ---------------------------------------------------------------------------------- on the device


def decode_batch(batch: dict, device: torch.device | str) -> dict:
    """The batch decoded on `device`: `image` N×3×H×W uint8 RGB and (train split) `mask`
    N×4×H×W uint8, each item's drawn augmentation replayed; the keys a cpu-mode batch has.

    A gpu-mode batch holds lists: `image` (JPEG bytes), `runs` (each item's four masks as one
    `rle.runs` sequence) and `augment` (`draw_steps`). A batch already decoded is returned as is.
    Its tensors arrive pinned (the loader's pin_memory), so every copy to the device here is
    asynchronous: the one host sync is the decode's own (`on_decode_stream`).
    """
    if not isinstance(batch.get("image"), list):
        return batch
    device = torch.device(device)
    images = decode_jpegs(batch["image"], batch["image_id"], device)
    size, count = images[0].shape[-2:], len(images)
    masks = [None] * count
    if "runs" in batch:
        items = [item_runs.to(device, non_blocking=True) for item_runs in batch["runs"]]
        masks = rle.decode_runs(rle.concat_runs(items, len(LABELS) * size.numel()), (count, len(LABELS), *size))
    steps = batch.get("augment", [[]] * count)
    replayed = [replay(image, item_steps, item_masks) for image, item_steps, item_masks in zip(images, steps, masks)]
    out = {key: value for key, value in batch.items() if key not in ENCODED_KEYS}
    out["image"] = torch.stack([image for image, _ in replayed])
    if "runs" in batch:
        out["mask"] = torch.stack([item_masks for _, item_masks in replayed])
    return out


# torchvision re-raises every error of its GPU decode as a RuntimeError ("Error while decoding JPEG
# images: ..."), PyTorch's own out-of-memory error included; nvJPEG's allocation failure is its status
# 5 (NVJPEG_STATUS_ALLOCATOR_FAILURE), which torchvision prints last ("Failed to decode batch: 5").
_OUT_OF_MEMORY = re.compile(r"out of memory|:\s*5\s*$", re.IGNORECASE | re.MULTILINE)


def decode_jpegs(data: list[torch.Tensor], image_ids: list[str], device: torch.device) -> list[torch.Tensor]:
    """Decode in one batched call; on failure, find the image that cannot be decoded and name it.
    Out of memory is raised as torch.cuda.OutOfMemoryError, which the training step's retry
    catches (engine.resilient_step), as it catches the model's.

    The worker checked each file's header, so what else fails here is corrupt compressed data
    (`cloudseg check` decodes every image on the CPU and lists those OpenCV refuses). Data damaged
    in the middle of a file that libjpeg only warns about ("Corrupt JPEG data", printed without the
    file's name) is decoded as it comes, here as on the CPU: no check catches it yet.
    """
    # Imported here: torchvision adds seconds to `import cloudseg.data`, and cpu mode never needs it.
    from torchvision.io import ImageReadMode, decode_jpeg

    def decode(items: list[torch.Tensor]) -> list[torch.Tensor]:
        return on_decode_stream(lambda: decode_jpeg(items, mode=ImageReadMode.RGB, device=device), device)

    try:
        return decode(list(data))
    except RuntimeError as error:
        if _OUT_OF_MEMORY.search(str(error)):
            raise torch.cuda.OutOfMemoryError(f"decoding the JPEGs of {', '.join(image_ids)}: {error}") from error
        for image_id, one in zip(image_ids, data):
            try:
                decode([one])
            except RuntimeError as single:
                raise ValueError(f"{image_id}: corrupt JPEG data, torchvision cannot decode it ({single})") from None
        raise ValueError(f"images {', '.join(image_ids)}: batched JPEG decode failed ({error})") from None


_decode_streams: dict[torch.device, torch.cuda.Stream] = {}


def on_decode_stream(decode, device: torch.device) -> list[torch.Tensor]:
    """`decode()` (torchvision's GPU JPEG decode) such that nvJPEG never writes memory that
    queued work still uses; on a CPU, simply `decode()`.

    torchvision takes the decoded images' memory from PyTorch's caching allocator on the
    current stream, and nvJPEG writes it without waiting for the work queued there
    (pytorch/vision PR #9606: 134 of 200 decodes corrupted on an H100). The allocator hands out
    a block as soon as it is freed on its stream, though kernels queued there may still read
    it: right after a micro-batch's backward is queued, that could be its activations or
    gradients. So the decode runs with a stream of its own as the current one, drained first
    (the public fix, torchcodec PR #1634, drains the caller's stream; this one holds no training
    work, so draining it costs nothing and the decode overlaps the queued backward). The images
    then go to the caller's stream: it waits for the decode stream, and each image is recorded
    on it, so that its block returns to the decode stream's pool only once the caller's work on
    it is done (the allocator checks that with events, on the host).
    """
    if device.type != "cuda":
        return decode()
    if device not in _decode_streams:
        _decode_streams[device] = torch.cuda.Stream(device)
    caller, stream = torch.cuda.current_stream(device), _decode_streams[device]
    with torch.cuda.stream(stream):
        with named_sync("decode stream", device):
            stream.synchronize()
        images = decode()
    caller.wait_stream(stream)
    for image in images:
        image.record_stream(caller)
    return images


def replay(image: torch.Tensor, steps: list, masks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An image (3×H×W) and its masks (4×H×W, or None) with `draw_steps`'s steps applied in
    order, as the CPU path applies them: the masks with nearest-neighbour warps and without
    brightness/contrast."""
    for name, value in steps:
        if name == "lut":
            lut = value.to(image.device, non_blocking=True)
            image = lut.gather(1, image.flatten(1).long()).view_as(image)
            continue
        if name == "affine":  # where each output pixel samples: once for the image and its masks
            value = _source_coordinates(value, image.shape[-2:], image.device)
        image = _geometric(image, name, value, nearest=False)
        masks = None if masks is None else _geometric(masks, name, value, nearest=True)
    return image, masks


def _geometric(tensor: torch.Tensor, name: str, value, nearest: bool) -> torch.Tensor:
    """One flip, no-data band or warp (`value`: the source coordinates) of a C×H×W tensor."""
    if name == "hflip":
        return tensor.flip(-1)
    if name == "vflip":
        return tensor.flip(-2)
    if name == "blank":
        return blank(tensor, value)
    return _warp(tensor, *value, nearest=nearest)


def blank(tensor: torch.Tensor, holes: np.ndarray) -> torch.Tensor:
    """A copy with each hole (x1, y1, x2, y2, as XYMasking draws them) set to 0."""
    tensor = tensor.clone()
    for x1, y1, x2, y2 in holes.tolist():
        tensor[..., y1:y2, x1:x2] = 0
    return tensor


def warp_affine(tensor: torch.Tensor, inverse, nearest: bool) -> torch.Tensor:
    """`cv2.warpAffine` of a C×H×W uint8 tensor with a constant 0 border, given the inverse
    map (output pixel → input position, 2×3): nearest-neighbour or bilinear, as OpenCV 5.0
    computes them in float32 (see `_source_coordinates`)."""
    return _warp(tensor, *_source_coordinates(inverse, tensor.shape[-2:], tensor.device), nearest=nearest)


def _warp(tensor: torch.Tensor, x: torch.Tensor, y: torch.Tensor, nearest: bool) -> torch.Tensor:
    """The warp of `tensor` that samples it at (x, y) for each output pixel."""
    if nearest:
        return _pick(tensor, x.round(), y.round())  # round half to even, as OpenCV's cvRound
    left, top = x.floor(), y.floor()
    fx, fy = x - left, y - top
    upper = _lerp(fx, _pick(tensor, left, top), _pick(tensor, left + 1, top))
    lower = _lerp(fx, _pick(tensor, left, top + 1), _pick(tensor, left + 1, top + 1))
    return _lerp(fy, upper, lower).round().clamp(0, 255).to(torch.uint8)  # rounded half to even


def _source_coordinates(inverse, shape, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The input position (x, y, float32 H×W each) that each output pixel samples, given the
    inverse map (2×3, OpenCV casts it to float32), with OpenCV's float32 operations: per row
    x = M1·y + M2 (a multiply, then an add), per pixel fma(M0, column, that). The last columns
    that make no whole vector group take OpenCV's scalar loop: fma(column, M0, M1·y) + M2.
    Nearest picks at exact half pixels depend on it. The map is copied to the device without
    waiting (pinned when it comes from the loader)."""
    height, width = shape
    rows = torch.as_tensor(inverse, dtype=torch.float32).to(device, non_blocking=True)
    row = torch.arange(height, dtype=torch.float32, device=device)[:, None]
    column = torch.arange(width, dtype=torch.float32, device=device)
    scalar = width - width % _VECTOR_COLUMNS  # the first column of the scalar loop
    coordinates = []
    for m0, m1, m2 in rows:
        coordinate = _fma(m0, column, row * m1 + m2)
        coordinate[:, scalar:] = _fma(column[scalar:], m0, row * m1) + m2
        coordinates.append(coordinate)
    return coordinates[0], coordinates[1]


def _lerp(t: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a + t·(b - a) in float32 as OpenCV computes it: b - a, then a fused multiply-add."""
    a = a.float()
    return _fma(t, b.float() - a, a)


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a·b + c in float32, rounded once as an FMA instruction does: in float64 the product of
    two float32 values is exact, and so is its sum with a third at the magnitudes here
    (pixel values, coordinates below 2^12), which leaves the one rounding to float32. In
    place, so that one float64 temporary is alive at a time."""
    exact = c.double().broadcast_to(torch.broadcast_shapes(a.shape, b.shape, c.shape)).contiguous()
    return exact.addcmul_(a, b).float()


def _pick(tensor: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """tensor[:, y, x] at whole-numbered positions (float H×W), 0 (the border) outside the image."""
    height, width = tensor.shape[-2:]
    inside = (x >= 0) & (x < width) & (y >= 0) & (y < height)
    index = (y.clamp(0, height - 1) * width + x.clamp(0, width - 1)).long().flatten()
    picked = tensor.flatten(-2).index_select(-1, index).view(tensor.shape)
    return picked * inside
