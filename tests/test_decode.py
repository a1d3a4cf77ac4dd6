"""data.decode=gpu: workers hand over JPEG bytes and flipped masks, `decode_batch` decodes.

Run on the CPU (`device="cpu"`): the same path as on a GPU but for the decoder library, so
gpu-mode items decoded here must equal cpu-mode items.
"""

import shutil
import subprocess
import sys

import pytest
import torch

from cloudseg.config import load_config
from cloudseg.data import CloudDataset, build_transform, collate
from cloudseg.decode import decode_batch, drawn_flips, require_gpu_decode
from tests.test_bad_input import cmyk, corrupt, grayscale, missing, not_a_jpeg, truncated, wrong_size, zero_byte

# torchvision 0.29 deprecates its JPEG decoder in favour of TorchCodec; it still works.
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")

# Max |difference| between OpenCV's decode (cpu mode) and torchvision's CPU decode, measured
# on the 24 tiny and 3 full-size (1400x2100) synthetic images: 0, as both bundle libjpeg-turbo
# with the same IDCT and chroma upsampling. nvjpeg on a GPU may differ by a few levels
# (torchvision's own test bounds its mean difference by 2): see test_cuda_decode_is_close.
CPU_DECODER_TOLERANCE = 0

# (index, augmentation seed) keys as EpochSampler serves them; with hflip = vflip = 0.5 these
# seeds draw flips for some items and none for others (checked below).
KEYS = [(index, 1000 + index) for index in range(8)]


def both_modes(data_dir, transform_args, keys=KEYS, device="cpu"):
    """(cpu-mode batch, gpu-mode batch before decoding, gpu-mode batch decoded on `device`)."""
    batches = []
    for decode in ("cpu", "gpu"):
        transform = build_transform(*transform_args) if transform_args else None
        dataset = CloudDataset(data_dir, transform=transform, decode=decode)
        batches.append(collate([dataset[key] for key in keys]))
    return batches[0], batches[1], decode_batch(batches[1], device)


@pytest.mark.parametrize("transform_args, expected_flips", [
    ((0.5, 0.5), None),
    ((1.0, 0.0), [True, False]),  # catches horizontal and vertical swapped
    ((0.0, 1.0), [False, True]),
    (None, [False, False]),  # no transform at all
])
def test_gpu_mode_decoded_on_cpu_equals_cpu_mode(tiny_data, transform_args, expected_flips):
    """Catches: the image not flipped (or on the other axis) after decoding, masks flipped
    differently from the image, flips drawn from a different random state than cpu mode's,
    items reordered by collate, keys left over (`flips`) or missing."""
    cpu, encoded, decoded = both_modes(tiny_data, transform_args)
    flips = {tuple(row) for row in encoded["flips"].tolist()}
    if expected_flips is None:
        assert len(flips) > 1  # these seeds exercise both a flipped and an unflipped item
    else:
        assert flips == {tuple(expected_flips)}
    assert decoded.keys() == cpu.keys() and decoded["image_id"] == cpu["image_id"]
    assert torch.equal(decoded["mask"], cpu["mask"])
    assert decoded["image"].shape == cpu["image"].shape == (len(KEYS), 3, 64, 96)
    assert decoded["image"].dtype == torch.uint8
    difference = (decoded["image"].int() - cpu["image"].int()).abs().max().item()
    assert difference <= CPU_DECODER_TOLERANCE


def test_flips_draw_follows_the_seed_as_cpu_mode_does():
    """Catches a probe that consumes the random state differently from the image: with the
    same seed, the flips recorded must be those the transform applies to a real image."""
    transform = build_transform(0.5, 0.5)
    image = torch.arange(12, dtype=torch.uint8).reshape(3, 4).numpy()
    for seed in range(20):
        transform.set_random_seed(seed)
        flipped = transform(image=image)["image"].reshape(3, 4)
        transform.set_random_seed(seed)
        h, v = drawn_flips(transform).tolist()
        expected = image[::-1 if v else 1, ::-1 if h else 1]
        assert (flipped == expected).all(), seed


def test_collate_keeps_the_jpeg_bytes_as_a_list(tiny_data):
    """Catches bytes stacked, padded or decoded in the worker: each entry is the file as on disk."""
    dataset = CloudDataset(tiny_data, decode="gpu")
    batch = collate([dataset[index] for index in range(4)])
    assert isinstance(batch["image"], list) and batch["flips"].shape == (4, 2)
    for image_id, data in zip(batch["image_id"], batch["image"]):
        assert data.tolist() == list((tiny_data / "train_images" / image_id).read_bytes())


def test_decode_batch_returns_a_decoded_batch_unchanged(tiny_data):
    """Catches decode_batch re-decoding, moving or copying a batch that cpu mode made."""
    batch = collate([CloudDataset(tiny_data)[index] for index in range(2)])
    assert decode_batch(batch, "cpu") is batch


def test_other_augmentations_are_refused_in_gpu_mode(tiny_data):
    """Catches the check missing at construction, or missing when train.py sets the
    transform afterwards, or missing in the config."""
    band = build_transform(0.5, 0.5, nodata_band=0.5, image_size=(64, 96))
    with pytest.raises(ValueError, match="only flip augmentations, got XYMasking"):
        CloudDataset(tiny_data, transform=band, decode="gpu")
    dataset = CloudDataset(tiny_data, decode="gpu")
    with pytest.raises(ValueError, match="only flip augmentations, got Affine"):
        dataset.transform = build_transform(0.5, 0.5, shift_scale_rotate=0.5)
    CloudDataset(tiny_data, transform=band)  # cpu mode takes any augmentation
    with pytest.raises(ValueError, match="set augment.brightness_contrast to 0"):
        load_config(None, ["data.decode=gpu", "augment.brightness_contrast=0.5"])
    assert load_config(None, ["data.decode=gpu", "augment.hflip=1"]).data.decode == "gpu"


def test_gpu_decode_is_refused_without_cuda():
    """Catches the condition inverted or missing (a cuda device object needs no GPU to exist)."""
    with pytest.raises(ValueError, match="data.decode=gpu needs a CUDA GPU"):
        require_gpu_decode(torch.device("cpu"))
    require_gpu_decode(torch.device("cuda"))


# test_bad_input's spoilers of one image file, each giving (the path named, the message).
BAD_IMAGES = [truncated, zero_byte, not_a_jpeg, grayscale, cmyk, corrupt, wrong_size, missing]


@pytest.mark.parametrize("spoil", BAD_IMAGES, ids=lambda spoil: spoil.__name__)
def test_bad_images_are_caught_by_the_worker_without_decoding(tiny_data, tmp_path, spoil):
    """Catches a check of cpu mode's `read_image` skipped by the header-only read (the size
    is read from the header): each bad file raises naming it, and in skip mode becomes a
    Problem that collate moves aside."""
    data_dir = shutil.copytree(tiny_data, tmp_path / "copy")
    dataset = CloudDataset(data_dir, decode="gpu", image_size=(64, 96))
    named, message = spoil(data_dir, dataset.image_ids[1])
    with pytest.raises((ValueError, FileNotFoundError), match=message) as error:
        dataset[1]
    assert named in str(error.value)
    dataset.on_bad_sample = "skip"
    batch = collate([dataset[index] for index in range(3)])
    assert len(batch["image"]) == 2 and [problem.image_id for problem in batch["skipped"]] == [dataset.image_ids[1]]


def test_undecodable_data_behind_a_valid_header_is_named_at_decode(tiny_data, tmp_path):
    """A file with a frame header but no scan passes the worker's checks; catches the batched
    decode failing without saying which image."""
    data_dir = shutil.copytree(tiny_data, tmp_path / "copy")
    dataset = CloudDataset(data_dir, decode="gpu")
    path = data_dir / "train_images" / dataset.image_ids[1]
    data = path.read_bytes()
    path.write_bytes(data[: data.index(b"\xff\xda")] + b"\xff\xd9")  # cut at the start-of-scan marker
    batch = collate([dataset[index] for index in range(3)])
    with pytest.raises(ValueError, match=f"{path.name}: corrupt JPEG data"):
        decode_batch(batch, "cpu")


@pytest.mark.gpu  # make test-gpu; skipped without CUDA
def test_cuda_decode_is_close_to_cpu_mode(tiny_data):
    """On a GPU: nvjpeg's images within torchvision's own CPU-vs-CUDA bound (mean |diff| < 2),
    masks exact, images on the GPU."""
    cpu, _, decoded = both_modes(tiny_data, (0.5, 0.5), device="cuda")
    assert decoded["image"].device.type == "cuda" and torch.equal(decoded["mask"], cpu["mask"])
    assert (decoded["image"].cpu().float() - cpu["image"].float()).abs().mean() < 2


def test_loader_benchmark_prints_its_table():
    out = subprocess.run([sys.executable, "benchmarks/loader_speed.py", "--height", "64", "--width", "96", "--n", "4",
                          "--workers", "1", "--epochs", "1"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "| cpu decode (OpenCV in workers) |" in out and "| gpu mode, workers only (bytes + masks) |" in out
    assert "unmeasured: no CUDA" in out or "| gpu decode (nvjpeg) |" in out
