"""`data.decode=gpu`: DataLoader workers hand over JPEG bytes, the GPU decodes them (the data
path's Dataset → loader → model hand-over, moved onto the GPU).

At 1400×2100 the JPEG decode is about half of a training sample's CPU time, and a GPU
machine may have only 2-4 cores per GPU. In gpu mode a worker reads the file's bytes (its
header checked, not decoded), decodes and flips the four masks, and records the flips it
drew; `decode_batch` then decodes a micro-batch's images at once with nvjpeg
(`torchvision.io.decode_jpeg` on a list) and gives each image its item's flips.

Only flips are possible: they are the one augmentation that can be drawn before the image
exists and replayed on it after decoding. The decode accepts `device="cpu"` too, so the
whole path is testable without a GPU.
"""

from __future__ import annotations

import albumentations as A
import numpy as np
import torch

DECODE_MODES = ("cpu", "gpu")

# Each pixel distinct: where the top-left one ends up says which flips the transform drew.
_PROBE = np.arange(4, dtype=np.uint8).reshape(2, 2)


def require_gpu_decode(device: torch.device | str) -> None:
    """Refuse `data.decode=gpu` when training does not run on a CUDA device."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"data.decode=gpu needs a CUDA GPU, but training runs on {device}; use data.decode=cpu")


def check_flips_only(transform) -> None:
    """Refuse a transform gpu mode cannot replay on the decoded image: anything but flips."""
    if transform is None:
        return
    steps = transform.transforms if isinstance(transform, A.Compose) else [transform]
    other = [type(step).__name__ for step in steps if not isinstance(step, (A.HorizontalFlip, A.VerticalFlip))]
    if other:
        raise ValueError(f"data.decode=gpu allows only flip augmentations, got {', '.join(other)}; "
                         "set the other augment.* probabilities to 0 or use data.decode=cpu")


def drawn_flips(transform) -> torch.Tensor:
    """[horizontal, vertical] flips the transform draws now, as a bool tensor.

    The transform runs on a 2×2 probe: a flip's draw does not depend on the image, so this
    consumes the random state exactly as the full image would (cpu mode) after the same seed.
    """
    if transform is None:
        return torch.zeros(2, dtype=torch.bool)
    row, col = np.argwhere(transform(image=_PROBE)["image"].reshape(2, 2) == 0)[0]
    return torch.tensor([bool(col), bool(row)])


def apply_flips(tensor: torch.Tensor, flips: torch.Tensor) -> torch.Tensor:
    """`tensor` (…×H×W) flipped left-right if flips[0], upside down if flips[1]."""
    dims = [dim for dim, flip in zip((-1, -2), flips.tolist()) if flip]
    return tensor.flip(dims) if dims else tensor


def decode_batch(batch: dict, device: torch.device | str) -> dict:
    """The batch with `image` decoded: N×3×H×W uint8 RGB on `device`, flipped as its masks were.

    A batch from gpu mode carries `image` as a list of JPEG byte tensors and `flips` (N×2);
    the result has the keys a cpu-mode batch has. A batch already decoded is returned as is.
    """
    images = batch.get("image")
    if images is None or isinstance(images, torch.Tensor):
        return batch
    decoded = _decode_all(images, batch["image_id"], device)
    flipped = [apply_flips(image, flips) for image, flips in zip(decoded, batch["flips"])]
    out = {key: value for key, value in batch.items() if key != "flips"}
    out["image"] = torch.stack(flipped)
    return out


def _decode_all(data: list[torch.Tensor], image_ids: list[str], device) -> list[torch.Tensor]:
    """Decode in one batched call; on failure, find the image that cannot be decoded and name it.

    The worker checked each file's header, so what fails here is corrupt compressed data
    (`cloudseg check` decodes every image on the CPU and lists such files).
    """
    # Imported here: torchvision adds seconds to `import cloudseg.data`, and cpu mode never needs it.
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return decode_jpeg(list(data), mode=ImageReadMode.RGB, device=device)
    except RuntimeError as error:
        for image_id, one in zip(image_ids, data):
            try:
                decode_jpeg(one, mode=ImageReadMode.RGB, device=device)
            except RuntimeError as single:
                raise ValueError(f"{image_id}: corrupt JPEG data, torchvision cannot decode it ({single})") from None
        raise ValueError(f"images {', '.join(image_ids)}: batched JPEG decode failed ({error})") from None
