"""data.decode=gpu: workers hand over JPEG bytes, mask runs and the augmentation they drew;
`decode_batch` decodes and augments on the device.

Everything runs on the CPU here (`device="cpu"`): the same tensor code as on a GPU but for the
JPEG decoder, and torchvision's CPU decoder equals OpenCV's on these images, so gpu-mode
batches decoded here must equal cpu-mode batches.
"""

import random
import shutil
import subprocess
import sys
from pathlib import Path

import albumentations as A
import cv2
import numpy as np
import pytest
import torch
from albumentations.augmentations.geometric.functional import center, create_affine_transformation_matrix

from cloudseg import oof, predict, rle, train
from cloudseg.cli import main
from cloudseg.config import DataConfig, load_config
from cloudseg.data import CloudDataset, build_transform, collate, make_loader, mask_runs
from cloudseg.decode import (check_replayable, decode_batch, draw_steps, on_decode_stream, resolve_decode,
                             warp_affine)
from cloudseg.engine import StepContext, resilient_step
from cloudseg.model import build_model
from cloudseg.synth import synthesize
from cloudseg.task import LABELS
from tests.conftest import TINY
from tests.fake_cuda import H100
from tests.test_bad_input import (cmyk, corrupt, grayscale, missing, not_a_jpeg, set_rle, truncated, wrong_size,
                                  zero_byte)

# torchvision 0.29 deprecates its JPEG decoder in favour of TorchCodec; it still works.
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding:DeprecationWarning")

# Max |difference| between OpenCV's decode (cpu mode) and torchvision's CPU decode, measured
# on the 24 tiny and 3 full-size (1400x2100) synthetic images: 0, as both bundle libjpeg-turbo
# with the same IDCT and chroma upsampling. nvjpeg on a GPU may differ by a few levels
# (torchvision's own test bounds its mean difference by 2): see test_cuda_decode_is_close.
CPU_DECODER_TOLERANCE = 0

# The bilinear warp replays OpenCV 5.0's float32 arithmetic step by step: measured here (x86,
# AVX2) it equals cv2.warpAffine exactly, at 64x96 and at 1400x2100. An OpenCV build that
# rounds one of its three interpolations once more (no FMA) moves a value by under 2^-16,
# which changes the rounded pixel by 1 level, and only where the value lies that close to a
# half: hence at most 1 level on at most 0.1% of pixels. Nearest-neighbour masks must be exact.
WARP_LEVELS, WARP_FRACTION = 1, 1e-3

# (index, augmentation seed) keys as EpochSampler serves them; with p=0.5 these seeds apply
# each step to some items and not to others (checked where it matters).
KEYS = [(index, 1000 + index) for index in range(8)]
ALL = {"hflip": 0.5, "vflip": 0.5, "shift_scale_rotate": 0.5, "brightness_contrast": 0.5, "nodata_band": 0.5}


def transform_for(augment, image_size=(64, 96)):
    return build_transform(**{"hflip": 0, "vflip": 0, **augment}, image_size=image_size) if augment else None


def both_modes(data_dir, augment, keys=KEYS, device="cpu"):
    """(cpu-mode batch, gpu-mode batch before decoding, gpu-mode batch decoded on `device`)."""
    batches = []
    for decode in ("cpu", "gpu"):
        dataset = CloudDataset(data_dir, decode=decode)
        dataset.transform = transform_for(augment, dataset.image_size)
        batches.append(collate([dataset[key] for key in keys]))
    return batches[0], batches[1], decode_batch(batches[1], device)


def assert_images_close(actual, expected, levels=WARP_LEVELS, fraction=WARP_FRACTION):
    difference = (actual.int() - expected.int()).abs()
    assert difference.max() <= levels and (difference > 0).float().mean() <= fraction


# ------------------------------------------------------------------------- masks from runs


def test_mask_runs_of_the_dataset_decode_to_its_masks(tiny_data):
    """Would catch the worker's runs of an image disagreeing with cpu mode's masks (labels
    out of order, masks of the wrong image, a label's runs dropped)."""
    dataset = CloudDataset(tiny_data)
    runs = [mask_runs(dataset.labels, image_id, (64, 96), "train.csv") for image_id in dataset.image_ids[:6]]
    decoded = rle.decode_runs(rle.concat_runs(runs, len(LABELS) * 64 * 96), (6, len(LABELS), 64, 96))
    assert torch.equal(decoded, torch.stack([dataset[index]["mask"] for index in range(6)]))


def test_bad_rle_fails_in_the_worker_naming_the_file_and_row(tiny_data, tmp_path):
    """A run past the last pixel passes train.csv's syntax check; catches gpu mode handing it
    over unchecked (to fail later on the GPU without a name) instead of raising in the
    worker with the file and row, or becoming a Problem in skip mode."""
    data_dir = shutil.copytree(tiny_data, tmp_path / "copy")
    image_id = CloudDataset(data_dir).image_ids[1]
    named, message = set_rle("6000 200", "ends past the last pixel 6144")(data_dir, image_id)
    dataset = CloudDataset(data_dir, decode="gpu")
    with pytest.raises(ValueError, match=message) as error:
        dataset[1]
    assert named in str(error.value) and str(data_dir / "train.csv") in str(error.value)
    dataset.on_bad_sample = "skip"
    assert dataset[1]["problem"].image_id == image_id


# ------------------------------------------------------------------------- augmentation


@pytest.mark.parametrize("augment", [
    {"hflip": 0.5, "vflip": 0.5}, ALL, {"hflip": 1.0}, {"vflip": 1.0}, {"shift_scale_rotate": 1.0},
    {"brightness_contrast": 1.0}, {"nodata_band": 1.0}, None,
], ids=["flips", "all", "hflip", "vflip", "affine", "brightness", "band", "none"])
def test_gpu_mode_decoded_on_cpu_equals_cpu_mode(tiny_data, augment):
    """The whole gpu path against the cpu path from the same seeds. Would catch: a step
    replayed on the wrong axis or in the wrong order (the band before or after the flips),
    parameters from another random state, the warp's matrix not inverted or inverted the
    other way, a half-pixel shift, masks warped bilinearly, brightness applied to masks,
    items reordered by collate, keys left over (`runs`, `augment`) or missing."""
    cpu, encoded, decoded = both_modes(tiny_data, augment)
    assert decoded.keys() == cpu.keys() and decoded["image_id"] == cpu["image_id"]
    assert torch.equal(decoded["mask"], cpu["mask"])
    assert decoded["image"].shape == cpu["image"].shape == (len(KEYS), 3, 64, 96)
    assert decoded["image"].dtype == torch.uint8
    if augment and "shift_scale_rotate" in augment:
        assert_images_close(decoded["image"], cpu["image"])
    else:  # flips, bands and lookup tables move no pixel between two places: exact
        assert (decoded["image"].int() - cpu["image"].int()).abs().max() <= CPU_DECODER_TOLERANCE
    if augment == ALL:  # these seeds exercise every step on some items and skip it on others
        drawn = [{name for name, _ in steps} for steps in encoded["augment"]]
        for name in ("hflip", "vflip", "blank", "affine", "lut"):
            assert 0 < sum(name in steps for steps in drawn) < len(KEYS), name


@pytest.mark.slow
def test_gpu_mode_equals_cpu_mode_at_full_resolution(tmp_path):
    """At 1400x2100 the affine warp's coordinates reach the thousands, where float32 rounds
    at 1/8000 of a pixel: catches a replay computed in other precision or operation order,
    whose nearest-neighbour picks then differ from OpenCV's at half pixels."""
    data_dir = synthesize(tmp_path, n_train=4, n_test=1, height=1400, width=2100, seed=1)
    keys = [(index, 7 + index) for index in range(4)]
    cpu, _, decoded = both_modes(data_dir, {**ALL, "shift_scale_rotate": 1.0}, keys)
    assert torch.equal(decoded["mask"], cpu["mask"])
    assert_images_close(decoded["image"], cpu["image"])


def test_draws_follow_the_random_state_as_the_cpu_path_does():
    """Same seed, same draws: after the cpu path's transform and `draw_steps`, both random
    generators are in the same state, the same steps applied, with the same affine map and
    no-data band. Would catch: the compose's own draw skipped (it draws even at p=1), a
    step's probability or parameters drawn out of order, the image's height and width
    swapped (the band and the warp's centre depend on them)."""
    shape = (64, 96)
    image, mask = np.zeros((*shape, 3), np.uint8), np.zeros((*shape, 4), np.uint8)
    for seed in range(30):
        cpu, drawn = transform_for(ALL, shape), transform_for(ALL, shape)
        generators = []
        for transform in (cpu, drawn):
            generators.append((np.random.default_rng(seed), random.Random(seed)))
            transform.set_random_state(*generators[-1])
        cpu(image=image, mask=mask)
        steps = dict(draw_steps(drawn, shape))
        assert generators[0][1].getstate() == generators[1][1].getstate(), seed
        assert generators[0][0].bit_generator.state == generators[1][0].bit_generator.state, seed
        applied = {type(step).__name__: step.get_applied_params() for step in cpu.transforms if step.get_applied_params()}
        names = {"XYMasking": "blank", "HorizontalFlip": "hflip", "VerticalFlip": "vflip", "Affine": "affine",
                 "RandomBrightnessContrast": "lut"}
        assert {names[name] for name in applied} == set(steps), seed
        if "Affine" in applied:
            inverse = cv2.invertAffineTransform(applied["Affine"]["matrix"][:2])  # float32, as OpenCV casts it
            assert torch.equal(steps["affine"], torch.from_numpy(inverse).float()), seed
        if "XYMasking" in applied:
            np.testing.assert_array_equal(steps["blank"], applied["XYMasking"]["holes"])


def textured(rng, shape, channels):
    return cv2.GaussianBlur(rng.integers(0, 256, (*shape, channels), dtype=np.uint8), (3, 3), 0)


# Maps of output to input, including exact half-pixel shifts (where rounding ties), a quarter
# turn (the border everywhere but a square) and a shear, plus the random ones build_transform draws.
SPECIAL_MAPS = [np.array([[1, 0, 0.5], [0, 1, -0.5]]), np.array([[0, 1, 3.0], [-1, 0, 90]]),
                np.array([[2, 0.1, -20], [0.05, 0.5, 7.25]])]


@pytest.mark.parametrize("shape", [(64, 96), (64, 100), (37, 53), (48, 2100)])
def test_warp_affine_equals_opencv(shape):
    """Against cv2.warpAffine itself, at widths with and without a remainder of OpenCV's
    16-column vector groups, and on a strip as wide as the Kaggle images, where coordinates
    in the thousands round in float32 at 1/8000 of a pixel. Would catch: rounding ties up
    instead of to even, coordinates computed in float64 or the last columns computed like
    the others (both pick other pixels than OpenCV near half pixels, measured on the strip),
    bilinear weights of the wrong neighbours, the border not 0, the map applied forward."""
    rng = np.random.default_rng(sum(shape))
    maps = SPECIAL_MAPS + [create_affine_transformation_matrix(
        {"x": rng.uniform(-0.0625, 0.0625) * shape[1], "y": rng.uniform(-0.0625, 0.0625) * shape[0]}, {"x": 0, "y": 0},
        {"x": rng.uniform(0.9, 1.1), "y": rng.uniform(0.9, 1.1)}, rng.uniform(-15, 15), center(shape))[:2]
        for _ in range(6)]
    for matrix in maps:
        image, mask = textured(rng, shape, 3), rng.integers(0, 256, (*shape, 4), dtype=np.uint8)
        inverse = cv2.invertAffineTransform(matrix)
        for array, nearest in ((image, False), (mask, True)):
            flags = cv2.INTER_NEAREST if nearest else cv2.INTER_LINEAR
            expected = cv2.warpAffine(array, matrix, shape[::-1], flags=flags, borderMode=cv2.BORDER_CONSTANT)
            warped = warp_affine(torch.from_numpy(array).permute(2, 0, 1), inverse, nearest).permute(1, 2, 0)
            if nearest:
                np.testing.assert_array_equal(warped.numpy(), expected)
            else:
                assert_images_close(warped, torch.from_numpy(expected))


def test_unreplayable_transforms_are_refused():
    """Catches the check missing at construction, missing when train.py sets the transform
    afterwards, or letting through a setting the replay ignores (it would train on images
    unlike the cpu path's)."""
    for step, named in [(A.GaussianBlur(p=1), "GaussianBlur"),
                        (A.Affine(rotate=10, border_mode=cv2.BORDER_REFLECT_101, p=1), "constant border"),
                        (A.Affine(rotate=10, fill=255, p=1), "fill=0"),
                        (A.RandomBrightnessContrast(brightness_by_max=False, p=1), "brightness_by_max"),
                        (A.XYMasking(num_masks_x=1, mask_x_length=5, fill=255, p=1), "fill=0")]:
        with pytest.raises(ValueError, match=named):
            check_replayable(A.Compose([step]))
    check_replayable(transform_for(ALL))  # every augmentation the config offers


def test_the_dataset_refuses_an_unreplayable_transform_in_gpu_mode_only(tiny_data):
    blur = A.Compose([A.GaussianBlur(p=1)])
    with pytest.raises(ValueError, match="cannot replay GaussianBlur"):
        CloudDataset(tiny_data, transform=blur, decode="gpu")
    dataset = CloudDataset(tiny_data, decode="gpu")
    with pytest.raises(ValueError, match="cannot replay GaussianBlur"):
        dataset.transform = blur
    CloudDataset(tiny_data, transform=blur)  # cpu mode takes any augmentation
    config = load_config(None, ["data.decode=gpu", *(f"augment.{name}={p}" for name, p in ALL.items())])
    assert config.data.decode == "gpu"  # every configured augmentation is allowed in gpu mode


# ------------------------------------------------------------------------- which mode


def test_auto_is_the_default_and_picks_gpu_on_cuda_only():
    """Would catch auto picking gpu on a CPU (refused there) or cpu on CUDA, an explicit
    choice overridden, or gpu without CUDA let through (a cuda device object needs no GPU)."""
    assert load_config(None).data.decode == "auto"
    assert resolve_decode("auto", torch.device("cuda")) == "gpu"
    assert resolve_decode("auto", "cpu") == "cpu"
    assert resolve_decode("cpu", torch.device("cuda")) == "cpu"
    assert resolve_decode("gpu", torch.device("cuda", 1)) == "gpu"
    with pytest.raises(ValueError, match="data.decode=gpu needs a CUDA GPU, but this runs on cpu"):
        resolve_decode("gpu", torch.device("cpu"))


def test_a_run_in_gpu_mode_equals_one_in_cpu_mode(data_copy, tmp_path, monkeypatch):
    """Training, validation, out-of-fold and test prediction each decode through decode_batch
    when data.decode resolves to gpu (faked here: on the CPU the gpu path decodes there too).
    Would catch one of them reading the encoded batch itself, or building its dataset in cpu
    mode regardless: the whole run must equal the cpu-mode run to the bit."""
    outputs = {}
    for mode in ("cpu", "gpu"):
        asked = []

        def resolve(requested, device, mode=mode):
            asked.append((requested, torch.device(device).type))
            return mode

        for module in (train, oof, predict):
            monkeypatch.setattr(module, "resolve_decode", resolve)
        run = tmp_path / mode
        augment = [f"augment.{name}={p}" for name, p in ALL.items()]
        assert main(["train", "-c", "configs/demo.yaml", "--out", str(run), f"data.dir={data_copy}", *TINY,
                     "train.epochs=1", *augment]) == 0
        assert main(["predict", "--checkpoint", str(run / "best.pt"), "--out", str(run / "submission.csv"),
                     "--device", "cpu"]) == 0
        assert asked == [("auto", "cpu")] * 3  # training (both splits), out-of-fold, test prediction
        with np.load(run / "oof.npz") as saved:
            outputs[mode] = ((run / "metrics.csv").read_text().splitlines()[1].split(",")[:8],
                             saved["probs"], (run / "submission.csv").read_text())
    assert outputs["gpu"][0] == outputs["cpu"][0]  # epoch, step, lr, losses, Dice
    np.testing.assert_array_equal(outputs["gpu"][1], outputs["cpu"][1])
    assert outputs["gpu"][2] == outputs["cpu"][2]


# ------------------------------------------------------------------------- the hand-over


def test_collate_keeps_the_encoded_parts_as_lists(tiny_data):
    """Catches bytes stacked, padded or decoded in the worker (each entry is the file as on
    disk), or masks decoded there instead of handed over as runs."""
    dataset = CloudDataset(tiny_data, transform=transform_for(ALL), decode="gpu")
    batch = collate([dataset[index, index] for index in range(4)])
    assert "mask" not in batch and all(isinstance(batch[key], list) for key in ("image", "runs", "augment"))
    for image_id, data, runs in zip(batch["image_id"], batch["image"], batch["runs"]):
        assert data.tolist() == list((tiny_data / "train_images" / image_id).read_bytes())
        assert runs.shape[0] == 2 and runs.dtype == torch.int64


def test_test_split_and_validation_batches_decode_without_augmentation(tiny_data):
    """The test split has no masks and no transform, validation no transform: catches
    decode_batch requiring `runs` or `augment`."""
    test = [CloudDataset(tiny_data, "test", decode=mode) for mode in ("cpu", "gpu")]
    cpu, gpu = (collate([dataset[index] for index in range(3)]) for dataset in test)
    decoded = decode_batch(gpu, "cpu")
    assert decoded.keys() == cpu.keys() and torch.equal(decoded["image"], cpu["image"])
    cpu, _, decoded = both_modes(tiny_data, None, keys=[0, 1, 2])
    assert torch.equal(decoded["mask"], cpu["mask"]) and torch.equal(decoded["image"], cpu["image"])


def test_decode_batch_returns_a_decoded_batch_unchanged(tiny_data):
    """Catches decode_batch re-decoding, moving or copying a batch that cpu mode made."""
    batch = collate([CloudDataset(tiny_data)[index] for index in range(2)])
    assert decode_batch(batch, "cpu") is batch


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
def test_cuda_path_through_the_training_loader_is_close_to_cpu_mode(tiny_data):
    """On a GPU, through the training loader (worker processes, pinned memory): masks decoded
    from runs and warped there exactly as on the CPU, nvjpeg's images within torchvision's
    own CPU-vs-CUDA bound (mean |diff| < 2), all on the GPU, decoded while a long kernel is
    still queued on the stream. Would catch a hand-over that pinning or the workers break, an
    operation that rounds otherwise on CUDA, or one that does not wait for the decode."""
    cpu, _, _ = both_modes(tiny_data, ALL)
    dataset = CloudDataset(tiny_data, decode="gpu")
    dataset.transform = transform_for(ALL, dataset.image_size)
    loader = make_loader(dataset, DataConfig(num_workers=2), len(KEYS), torch.device("cuda"), sampler=KEYS)
    batch = next(iter(loader))
    torch.cuda._sleep(200_000_000)  # a busy stream, as in training: a backward still queued
    decoded = decode_batch(batch, torch.device("cuda"))
    assert decoded["image"].device.type == decoded["mask"].device.type == "cuda"
    assert torch.equal(decoded["mask"].cpu(), cpu["mask"])
    assert (decoded["image"].cpu().float() - cpu["image"].float()).abs().mean() < 2


def test_loader_benchmark_prints_its_table():
    """On the CPU, named: the rows of any device."""
    out = subprocess.run([sys.executable, "benchmarks/loader_speed.py", "--height", "64", "--width", "96", "--n", "4",
                          "--workers", "1", "--epochs", "1", "--device", "cpu"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert "| cpu mode: decode + augment in the workers |" in out
    assert "| gpu mode: the workers' share (bytes, runs, draws) |" in out
    assert "| gpu mode: + decode and augment on cpu |" in out
    assert "main-process CPU ms/sample" in out


# ------------------------------------------------------------------------- the decode's stream


def test_the_gpu_decode_runs_on_a_drained_stream_of_its_own_and_hands_its_images_to_the_caller(fake_cuda,
                                                                                                monkeypatch):
    """On a fake GPU (cuda:0), with the sync debug mode at "error" as tests/test_gpu.py sets it:
    the decoder's stream is drained, the decode runs with it as the current stream (torchvision
    allocates its outputs there), then the caller's stream waits for it and each image is
    recorded on the caller's stream, in that order; the caller's stream is current again after.
    Would catch: a decode on the caller's stream, where queued backward kernels may still read
    the memory nvJPEG overwrites (so until issue #22); images freed back to the decoder's pool
    while the caller still uses them (no record_stream); the caller reading them before the
    decode (no wait_stream); and the drain made as an unnamed sync (it would raise here)."""
    from cloudseg import decode

    cuda = fake_cuda(H100)
    monkeypatch.setattr(decode, "_decode_streams", {})
    caller = torch.cuda.current_stream(0)
    images = [torch.zeros(3, 4, 6, dtype=torch.uint8), torch.ones(3, 4, 6, dtype=torch.uint8)]

    def fake_decode():
        cuda.calls.append(("decode on", torch.cuda.current_stream(0).name))
        return images

    torch.cuda.set_sync_debug_mode("error")
    assert decode.on_decode_stream(fake_decode, torch.device("cuda", 0)) is images
    own = decode._decode_streams[torch.device("cuda", 0)].name
    assert own != caller.name
    assert cuda.calls == [("synchronize stream", own, 0), ("decode on", own), ("wait_stream", caller.name, own),
                          ("record_stream", caller.name), ("record_stream", caller.name)]
    assert torch.cuda.current_stream(0) is caller and torch.cuda.get_sync_debug_mode() == 2
    with pytest.raises(RuntimeError, match="synchronizing"):  # the fake is as strict as torch outside it
        caller.synchronize()


def test_on_the_cpu_the_decode_is_called_as_it_is(fake_cuda):
    """Catches the stream dance reaching for CUDA when the device is the CPU."""
    cuda = fake_cuda(H100)
    assert on_decode_stream(lambda: ["decoded"], torch.device("cpu")) == ["decoded"]
    assert cuda.calls == []


def test_named_syncs_are_counted_and_only_named_ones_pass(fake_cuda):
    """Would catch: a sync given a name that docs/memory-and-gpus.md does not list (a typo
    would hide a real sync from the count), or the debug mode left lifted after the sync."""
    from cloudseg import syncs

    fake_cuda(H100)
    torch.cuda.set_sync_debug_mode("warn")
    before = syncs.counts["window end"]
    with syncs.named_sync("window end", torch.device("cuda", 0)):
        assert torch.cuda.get_sync_debug_mode() == 0
    assert torch.cuda.get_sync_debug_mode() == 1 and syncs.counts["window end"] == before + 1
    with pytest.raises(KeyError, match="'windowend' is not a named sync"):
        with syncs.named_sync("windowend", torch.device("cuda", 0)):
            pass
    documented = Path("docs/memory-and-gpus.md").read_text()
    assert all(f"`{name}`" in documented for name in syncs.NAMED)


# ------------------------------------------------------------------------- out of memory in the decode

# What torchvision raises for a CUDA decode that ran out of memory: every C++ error re-raised as
# "Error while decoding JPEG images: " + what(), here PyTorch's allocator's own message.
TORCHVISION_OOM = ("Error while decoding JPEG images: CUDA out of memory. Tried to allocate 8.41 GiB. GPU 0 has a "
                   "total capacity of 10.75 GiB of which 1.02 GiB is free.")


def gpu_mode_windows(data_dir, window_count=2, micro_batch=4, accumulation=2):
    """Windows of gpu-mode batches (JPEG bytes and runs), `accumulation` loader batches each."""
    dataset = CloudDataset(data_dir, decode="gpu")
    keys = iter(range(len(dataset)))
    return [[collate([dataset[next(keys)] for _ in range(micro_batch)]) for _ in range(accumulation)]
            for _ in range(window_count)]


@pytest.mark.parametrize("message", [TORCHVISION_OOM, "Error while decoding JPEG images: Failed to decode batch: 5"])
def test_an_out_of_memory_error_of_the_decode_halves_the_micro_batch_and_redoes_the_window_exactly(
        tiny_data, monkeypatch, message):
    """On the CPU: torchvision's decode raises its wrapped out-of-memory RuntimeError (PyTorch's
    message, or nvJPEG's allocator status 5) for any batch of more than 2 images. The retry
    must see torch.cuda.OutOfMemoryError, halve the micro-batch 4 → 2 and redo the window (the
    failure comes at the window's second micro-batch, after the first one's backward): the
    weights equal, to the bit, those of a run at micro-batch 2 from the start (float64). Would
    catch: the error turned into "corrupt JPEG data" (ValueError: the run dies, so until
    issue #22), or a retry that keeps the failed attempt's gradients."""
    import torchvision.io

    real_decode = torchvision.io.decode_jpeg

    large_batches = []

    def decode_jpeg(data, *args, **kwargs):  # the first batch of 4 decodes: its backward has run when the next fails
        if isinstance(data, list) and len(data) > 2:
            large_batches.append(1)
            if len(large_batches) > 1:
                raise RuntimeError(message)
        return real_decode(data, *args, **kwargs)

    def trained(micro_batch):
        torch.manual_seed(0)
        model = build_model(load_config("configs/demo.yaml", [*TINY, "model.norm=group"]).model, pretrained=False)
        model = model.double().train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ctx = StepContext(model, optimizer, torch.amp.GradScaler("cpu", enabled=False), torch.device("cpu"))
        for window in gpu_mode_windows(tiny_data):
            _, micro_batch = resilient_step(ctx, window, micro_batch)
        return model, micro_batch

    reference, _ = trained(2)
    monkeypatch.setattr(torchvision.io, "decode_jpeg", decode_jpeg)
    recovered, micro_batch = trained(4)
    assert micro_batch == 2
    for (name, p), q in zip(recovered.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), name
