import json
import logging
import re
import shutil

import numpy as np
import pandas as pd
import pytest
import torch

from cloudseg import model as model_module
from cloudseg import startclock
from cloudseg import train as train_module
from cloudseg.checkpoint import load_checkpoint, save_checkpoint
from cloudseg.cli import main
from cloudseg.config import ModelConfig, from_dict, load_config
from cloudseg.model import build_model, train_mode
from tests.conftest import TINY
from cloudseg.postprocess import postprocess, remove_small_components
from cloudseg.predict import write_submission
from cloudseg.train import train



@pytest.fixture
def data(tiny_data, tmp_path):
    return shutil.copytree(tiny_data, tmp_path / "data")


def tiny_config(data, *more):
    return load_config("configs/demo.yaml", [f"data.dir={data}", *TINY, *more])


def test_train_predict_evaluate_through_the_cli(data, tmp_path, capsys, caplog, monkeypatch):
    run = tmp_path / "run"
    caplog.set_level(logging.INFO, logger="cloudseg")
    monkeypatch.setattr(startclock, "_first_run", [True])  # as in a new process, whatever ran in this one
    assert main(["train", "-c", "configs/demo.yaml", "--out", str(run), f"data.dir={data}", *TINY]) == 0
    assert {"best.pt", "last.pt", "config.yaml", "metrics.csv", "train.log"} <= {p.name for p in run.iterdir()}
    metrics = pd.read_csv(run / "metrics.csv")
    assert metrics["epoch"].tolist() == [1, 2]
    assert {"train_loss", "valid_loss", "dice", "dice_Fish", "dice_Sugar", "lr", "images_per_s", "peak_allocated_mb",
            "peak_reserved_mb"} <= set(metrics)
    assert metrics["dice"].between(0, 1).all()
    saved = load_config(run / "config.yaml")
    assert saved.data.image_size == (64, 96)  # resolved from the data and saved
    best = load_checkpoint(run / "best.pt")
    assert best["epoch"] == metrics.loc[metrics["dice_tuned"][::-1].idxmax(), "epoch"]  # the last of equals
    assert {"model", "optimizer", "scheduler", "scaler", "epoch", "step", "rng", "config", "metrics"} <= set(best)

    # every run tunes itself on best.pt's out-of-fold probabilities: the same images and search
    # that chose best.pt, so the tuned CV Dice is that epoch's dice_tuned (up to the uint8 rounding
    # of probabilities computed in other batch sizes), and never below the config's rule
    tuned = json.loads((run / "postprocess.json").read_text())
    assert tuned["cv_dice"]["after"]["mean"] == pytest.approx(metrics["dice_tuned"].max(), abs=2e-3)
    assert tuned["cv_dice"]["after"]["mean"] >= tuned["cv_dice"]["before"]["mean"]
    assert "best validation Dice" in capsys.readouterr().out
    first_steps = [record.message for record in caplog.records if "first optimizer step" in record.message]
    assert len(first_steps) == 1, first_steps  # once, at the first window: not each epoch's
    assert_the_start_adds_up(first_steps[0])

    sub = tmp_path / "submission.csv"
    assert main(["predict", "--checkpoint", str(run / "best.pt"), "--out", str(sub), "--device", "cpu"]) == 0
    assert f"the tuned rule of {(run / 'postprocess.json').resolve()}" in caplog.text  # applied by default
    frame = pd.read_csv(sub, keep_default_na=False)
    expected = pd.read_csv(data / "sample_submission.csv")["Image_Label"]
    assert frame["Image_Label"].tolist() == expected.tolist()
    assert main(["evaluate", "--submission", str(sub), "--truth", str(data / "test_solution.csv")]) == 0
    assert "mean Dice" in capsys.readouterr().out

    # what the checkpoint's model was built with is refused as an override, not ignored (predict
    # built the checkpoint's model and wrote a submission as if the override had applied)
    for override, key, was, now in (("model.encoder=resnet34", "model.encoder", "'mobilenet_v2'", "'resnet34'"),
                                    ("data.image_size=[128, 192]", "data.image_size", "[64, 96]", "[128, 192]"),
                                    ("train.channels_last=false", "train.channels_last", "True", "False")):
        assert main(["predict", "--checkpoint", str(run / "best.pt"), "--out", str(tmp_path / "no.csv"),
                     "--device", "cpu", override]) == 2
        assert capsys.readouterr().err.strip() == (
            f"cloudseg: error: {key} comes from the checkpoint ({was} in {run / 'best.pt'}), "
            f"not from an override ({now}); it applies to training")
    assert not (tmp_path / "no.csv").exists()
    assert main(["predict", "--checkpoint", str(run / "best.pt"), "--out", str(run), "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip() == (  # told before predicting, not by the final rename
        f"cloudseg: error: {run}: --out is a folder, not a file; name the submission's CSV (submission.csv)")


def assert_the_start_adds_up(line: str) -> None:
    """Issue #60's clock: the time to the first optimizer step, by stage in the order they run,
    adding up to its total (each rounded to 0.1 s)."""
    total, stages = re.fullmatch(r".*first optimizer step ([\d.]+) s after the command started: (.*)", line).groups()
    seconds = dict(re.fullmatch(r"(.+) ([\d.]+) s", stage).groups() for stage in stages.split(", "))
    assert [name.split(" (")[0] for name in seconds] == ["start-up", "data index", "model", "probes", "set-up",
                                                         "first window"]
    assert sum(map(float, seconds.values())) == pytest.approx(float(total), abs=0.051 * len(seconds))
    assert 0 < float(seconds["start-up"]) < float(total)


def test_existing_run_is_not_overwritten(data, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "last.pt").write_bytes(b"x")
    assert main(["train", "-c", "configs/demo.yaml", "--out", str(run), f"data.dir={data}", *TINY]) == 2
    assert "--resume" in capsys.readouterr().err


def test_resumed_run_ends_with_the_same_parameters_as_a_straight_run(data, tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    train(tiny_config(data), straight)

    real_validate, calls = train_module.validate, []

    def crash_in_epoch_two(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_validate(*args, **kwargs)

    interrupted = tmp_path / "interrupted"
    monkeypatch.setattr(train_module, "validate", crash_in_epoch_two)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_config(data), interrupted)
    assert load_checkpoint(interrupted / "last.pt")["epoch"] == 1
    monkeypatch.setattr(train_module, "validate", real_validate)
    assert main(["train", "--resume", str(interrupted)]) == 0

    a, b = load_checkpoint(straight / "last.pt"), load_checkpoint(interrupted / "last.pt")
    assert a["step"] == b["step"] and b["epoch"] == 2
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert pd.read_csv(interrupted / "metrics.csv")["epoch"].tolist() == [1, 2]


def test_a_resume_downloads_no_encoder_weights(data, tmp_path, monkeypatch):
    """A run trained with model.encoder_weights=imagenet, resumed where no download works: it
    continues from last.pt's weights. Would catch a resume that builds the model with the
    download (which last.pt's weights then replace): offline it failed, and its advice,
    model.encoder_weights=null, is refused on a resume."""
    run = tmp_path / "run"
    train(tiny_config(data, "train.epochs=1"), run)
    saved = load_checkpoint(run / "last.pt")
    saved["config"]["model"]["encoder_weights"] = "imagenet"  # as a run trained online
    save_checkpoint(run / "last.pt", saved)

    def offline(config):
        raise RuntimeError(f"could not get the {config.encoder_weights!r} weights: no internet")

    monkeypatch.setattr(model_module, "_download_weights", offline)
    assert main(["train", "--resume", str(run), "train.epochs=2"]) == 0
    assert load_checkpoint(run / "last.pt")["epoch"] == 2


def test_a_crash_between_an_epoch_s_checkpoints_leaves_best_pt_as_metrics_csv_says(data, tmp_path, monkeypatch):
    """CPU. The process dies at the second checkpoint written at the end of epoch 2 (each epoch
    the best: best_epoch made to say so), then resumes. Would catch: last.pt written before
    best.pt (the resume takes epoch 2 as done, and best.pt keeps epoch 1 for good while
    metrics.csv names epoch 2)."""
    monkeypatch.setattr(train_module, "best_epoch", lambda history: len(history) - 1)
    real_save, saves = train_module.save_checkpoint, []

    def dying_at_epoch_two_s_second_save(path, state):
        if state["epoch"] == 2 and state.get("progress") is None:
            saves.append(path.name)
            if len(saves) == 2:
                raise KeyboardInterrupt
        return real_save(path, state)

    monkeypatch.setattr(train_module, "save_checkpoint", dying_at_epoch_two_s_second_save)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_config(data), tmp_path / "run")
    assert main(["train", "--resume", str(tmp_path / "run")]) == 0
    assert len(saves) > 2  # epoch 2 redone
    best, last = (load_checkpoint(tmp_path / "run" / name)["epoch"] for name in ("best.pt", "last.pt"))
    assert best == last == 2
    assert pd.read_csv(tmp_path / "run" / "metrics.csv")["epoch"].tolist() == [1, 2]


def test_an_out_that_is_a_file_is_one_line_naming_it(data, tmp_path, capsys):
    """Would catch: FileExistsError's traceback (exit 1) where --out names a file, or
    NotADirectoryError's where it lies under one."""
    (tmp_path / "file").write_text("")
    for out in (tmp_path / "file", tmp_path / "file" / "run"):
        assert main(["train", "-c", "configs/demo.yaml", "--out", str(out), f"data.dir={data}", *TINY]) == 2
        error = capsys.readouterr().err.strip()
        assert error.startswith("cloudseg: error: ") and str(tmp_path / "file") in error and "\n" not in error


def test_a_resume_refuses_what_its_state_was_made_with_and_records_what_it_changes(data, tmp_path, capsys):
    """CPU, a finished 2-epoch run resumed. Would catch: train.lr or weight decay taken silently
    (the optimizer's and scheduler's states loaded over them: the new value in config.yaml, the
    old one used), another fold validated on images the run trained on, a model override ending
    in load_state_dict's many lines, config.yaml left saying 2 epochs after a resume to 3, or a
    -c or --out given with --resume and silently ignored, fewer epochs than done taken (config.yaml
    rewritten for a run that trains nothing), a weights-only checkpoint copied over last.pt failing
    with KeyError 'rng' (naming nothing), or a precision with fp16's loss scaling where the run had
    none (GradScaler's error naming nothing; train.precision=auto on another GPU may do it)."""
    run = tmp_path / "run"
    train(tiny_config(data), run)
    for override, key in (("train.lr=1e-2", "train.lr"), ("train.weight_decay=0.5", "train.weight_decay"),
                          ("data.fold=1", "data.fold"), ("model.encoder=resnet34", "model.encoder"),
                          ("train.effective_batch=8", "train.effective_batch")):
        assert main(["train", "--resume", str(run), override]) == 2
        error = capsys.readouterr().err.strip()
        assert error.startswith(f"cloudseg: error: {run}/last.pt: a resumed run keeps the {key} it trained with (")
        assert "\n" not in error
    for ignored in (["-c", "configs/demo.yaml"], ["--out", str(tmp_path / "elsewhere")]):
        assert main(["train", "--resume", str(run), *ignored]) == 2
        assert "leave out -c and --out" in capsys.readouterr().err
    assert main(["train", "--resume", str(run), "train.precision=fp16"]) == 2  # what auto may take on another GPU
    assert capsys.readouterr().err.strip() == (
        f"cloudseg: error: {run}/last.pt: the run trained in bf16 or fp32 and train.precision=fp16 is fp16 here: "
        "resume with train.precision=bf16 or train.precision=fp32")
    assert main(["train", "--resume", str(run), "train.epochs=1"]) == 2  # fewer than done: config.yaml kept
    assert capsys.readouterr().err.strip() == (f"cloudseg: error: {run}/last.pt: the run has done 2 epochs; "
                                               "train.epochs=1 asks for fewer")
    assert load_config(run / "config.yaml").train.epochs == 2
    shutil.copy(run / "last.pt", tmp_path / "last.pt")
    weights_only = {key: value for key, value in load_checkpoint(run / "last.pt").items()
                    if key not in ("optimizer", "rng")}  # as an epochs/epochN.pt of train.swa holds
    save_checkpoint(run / "last.pt", weights_only)
    assert main(["train", "--resume", str(run)]) == 2
    assert "last.pt: not a checkpoint a run can go on from (no optimizer, rng)" in capsys.readouterr().err
    (tmp_path / "last.pt").replace(run / "last.pt")
    assert main(["train", "--resume", str(run), "train.lr=3e-3", "train.epochs=3"]) == 0  # lr as it was: no change
    assert load_config(run / "config.yaml").train.epochs == 3
    assert pd.read_csv(run / "metrics.csv")["epoch"].tolist() == [1, 2, 3]


def test_a_resume_to_more_epochs_steps_at_the_longer_schedule_s_rate(data, tmp_path):
    """A finished 2-epoch run (cosine, at 0 by its end) resumed with train.epochs=3: its optimizer's
    rate is the 3-epoch schedule's at the step reached, as a fresh scheduler stepped there says.
    Would catch the first step of the resume taken at the old schedule's last rate (0)."""
    from cloudseg.config import resumed_config
    from cloudseg.train import lr_schedule

    run = tmp_path / "run"
    train(tiny_config(data), run)
    saved = load_checkpoint(run / "last.pt")
    config = resumed_config(saved["config"], ["train.epochs=3"], "last.pt")
    resumed, _, _ = train_module.start(config, run, resume=True)
    reference = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=config.train.lr)
    schedule = lr_schedule(reference, config.train, 3 * saved["step"] // 2)
    for _ in range(saved["step"]):
        reference.step()
        schedule.step()
    assert schedule.get_last_lr()[0] > 0.1 * config.train.lr  # the longer schedule is far from its end
    assert resumed.step.optimizer.param_groups[0]["lr"] == pytest.approx(schedule.get_last_lr()[0], rel=1e-12)


def test_deterministic_training_runs_with_deterministic_algorithms_and_refuses_no_op(data, tmp_path, monkeypatch):
    """train.deterministic=true on the CPU (the GPU's bit-exact resume is tests/test_gpu.py's).
    Would catch: the switch not reaching speed_switches, and an op of the step that PyTorch has
    no deterministic algorithm for (it raises in this mode)."""
    seen = []
    real_step = train_module.resilient_step

    def step(*args, **kwargs):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return real_step(*args, **kwargs)

    monkeypatch.setattr(train_module, "resilient_step", step)
    was = torch.are_deterministic_algorithms_enabled()
    try:
        train(tiny_config(data, "train.deterministic=true"), tmp_path / "run")
    finally:
        torch.use_deterministic_algorithms(was)
    assert seen and all(seen)


def test_scheduler_and_optimizer_step_once_per_window(data, tmp_path):
    config = tiny_config(data, "train.epochs=3")
    train(config, tmp_path / "run")
    state = load_checkpoint(tmp_path / "run" / "last.pt")
    train_images = 24 - int((pd.read_csv(data / "folds.csv")["fold"] == 0).sum())
    windows_per_epoch = -(-train_images // 4)
    assert state["step"] == 3 * windows_per_epoch
    assert state["scheduler"]["last_epoch"] == state["step"]
    adam_steps = {int(s["step"]) for s in state["optimizer"]["state"].values()}
    assert adam_steps == {state["step"]}  # AdamW's own counter agrees


# ---------------------------------------------------------------- config


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.lrr=0.1", "train.lrr: unknown key"),
        ("train.epochs=ten", "train.epochs: .*integer"),
        ("train.effective_batch=10", r"effective_batch \(10\) must be a multiple of train.micro_batch \(4\)"),
        ("model.norm=layer", "model.norm: .*'batch', 'frozen' or 'group'"),
        ("train.precision=fp8", "train.precision"),
        ("data.image_size=[1400,0]", r"data.image_size.1: .*greater than 0"),  # not after the model is built
        ("train.epochs=true", r"train.epochs: give a number, not true or false"),  # pydantic alone: 1 epoch
        ("predict.threshold=false", r"predict.threshold: give a number, not true or false"),  # alone: 0.0 each
        ("predict.gate=[0.1,0.2,true,0.3]", r"predict.gate: give a number, not true or false"),
        ("train.speedups.autotune=off", r"train.speedups.autotune: YAML reads off, on, yes and no as false and true"),
        ("train.lr=.inf", r"train.lr: .*finite number"),  # YAML's infinity
        ("predict.threshold=.nan", r"predict.threshold.0: .*finite number"),
        ("nonsense", "not of the form"),
        ("predict.min_area=-5", r"predict.min_area.0: .*greater than or equal to 0"),  # taken as 0 before
        ("train.lr=[1", r"override 'train.lr=\[1', line 1, column 3: not valid YAML"),  # not yaml's traceback
    ],
)
def test_config_errors_name_the_key(override, message, capsys):
    with pytest.raises(ValueError, match=message):
        load_config("configs/fullres.yaml", [override])
    assert main(["train", "-c", "configs/fullres.yaml", override]) == 2
    assert "cloudseg: error:" in capsys.readouterr().err


def test_unknown_key_in_yaml_is_an_error(tmp_path):
    (tmp_path / "c.yaml").write_text("train:\n  epochs: 2\n  epoch: 3\n")
    with pytest.raises(ValueError, match=r"c\.yaml: train\.epoch: unknown key"):
        load_config(tmp_path / "c.yaml")


def test_each_bad_key_is_told_as_the_override_that_set_it_or_else_the_file(tmp_path):
    """Would catch: every problem put on the config file, which has no train.lrr to fix (the
    user's typo was on the command line), or on the last override."""
    (tmp_path / "c.yaml").write_text("train:\n  epochs: 0\n  lr: 0.1\n")
    with pytest.raises(ValueError) as error:
        load_config(tmp_path / "c.yaml", ["train.lrr=0.1", "train.lr=2", "train.lr=-1", "predict.tta=x"])
    assert str(error.value) == (
        f"{tmp_path / 'c.yaml'}: train.epochs: Input should be greater than or equal to 1 (got 0); "
        "override 'train.lr=-1': train.lr: Input should be greater than 0 (got -1); "
        "override 'train.lrr=0.1': train.lrr: unknown key; "
        "override 'predict.tta=x': predict.tta: Input should be 'none', 'hflip', 'hvflip' or 'd4-lite' (got 'x')")
    # keys that do not fit together: the override the problem names, else the file
    (tmp_path / "c.yaml").write_text("train:\n  effective_batch: 6\n  micro_batch: 4\n")
    for overrides, origin in ((["train.epochs=3"], tmp_path / "c.yaml"),
                              (["train.micro_batch=4", "train.effective_batch=10"], "override 'train.effective_batch=10'")):
        with pytest.raises(ValueError, match=f"^{re.escape(str(origin))}: train: train.effective_batch \\(\\d+\\) must be"):
            load_config(tmp_path / "c.yaml", overrides)
    # a typo in the section: pydantic tells it at the section the override made
    with pytest.raises(ValueError, match=r"^override 'trian\.lr=0\.1': trian: unknown key$"):
        load_config(tmp_path / "c.yaml", ["train.effective_batch=8", "trian.lr=0.1"])


def test_config_keys_lists_every_key_and_refuses_overrides_it_would_ignore(capsys):
    """Would catch: `cloudseg config --keys train.lrr=1` listing the keys, exit 0, the bad
    override never looked at."""
    assert main(["config", "--keys"]) == 0
    assert "train.epochs = " in capsys.readouterr().out
    assert main(["config", "--keys", "train.lrr=1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "cloudseg: error: cloudseg config --keys lists every key; it takes no overrides (train.lrr=1)")


def test_a_config_file_that_is_not_yaml_is_one_line_naming_it_and_the_line(tmp_path, capsys):
    """Would catch: yaml's ParserError and its traceback (exit 1) for a bracket left open."""
    (tmp_path / "c.yaml").write_text("seed: 1\ntrain: [\n")
    assert main(["train", "-c", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == (f"cloudseg: error: {tmp_path / 'c.yaml'}, line 3, column 1: not valid "
                                               "YAML (expected the node content, but found '<stream end>')")
    assert not (tmp_path / "run").exists()


def test_shipped_configs_say_what_the_issue_asks():
    full = load_config("configs/fullres.yaml")
    assert full.data.image_size == (1400, 2100) and full.model.encoder == "resnet34"
    assert full.model.encoder_weights == "imagenet" and full.train.precision == "auto"
    assert (full.train.micro_batch, full.train.effective_batch, full.train.accumulation_steps) == (4, 16, 4)
    demo = load_config("configs/demo.yaml")
    assert demo.data.image_size is None and demo.model.encoder_weights is None


def test_overrides_parse_as_yaml_and_round_trip():
    config = load_config("configs/demo.yaml", ["data.image_size=[128, 192]", "predict.threshold=0.3", "train.grad_clip=null"])
    assert config.data.image_size == (128, 192) and config.predict.threshold == (0.3,) * 4
    assert config.train.grad_clip is None
    assert from_dict(config.model_dump(mode="json")) == config


# ---------------------------------------------------------------- model


def small_model(**kw):
    return build_model(ModelConfig(encoder="resnet18", encoder_weights=None, decoder_channels=(16, 8, 8, 8, 8), **kw))


def test_model_takes_uint8_at_any_size_and_crops_back():
    model = small_model().eval()
    images = torch.randint(0, 256, (2, 3, 50, 70), dtype=torch.uint8)
    with torch.no_grad():
        assert model(images).shape == (2, 4, 50, 70)


def test_frozen_norm_keeps_encoder_statistics():
    model = small_model(norm="frozen")
    before = model.unet.encoder.bn1.running_mean.clone()
    decoder_bn = next(m for m in model.unet.decoder.modules() if isinstance(m, torch.nn.BatchNorm2d))
    decoder_before = decoder_bn.running_mean.clone()
    train_mode(model, "frozen")
    model(torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8))
    assert torch.equal(model.unet.encoder.bn1.running_mean, before)
    assert not torch.equal(decoder_bn.running_mean, decoder_before)  # the decoder still adapts


def test_group_norm_replaces_every_batchnorm():
    model = small_model(norm="group")
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert sum(isinstance(m, torch.nn.GroupNorm) for m in model.modules()) > 10


def test_group_norm_keeps_the_batchnorm_scale_and_shift():
    from cloudseg.model import batchnorm_to_groupnorm

    block = torch.nn.Sequential(torch.nn.Conv2d(3, 48, 1), torch.nn.BatchNorm2d(48))
    with torch.no_grad():
        block[1].weight.copy_(torch.linspace(0.5, 2, 48))
        block[1].bias.copy_(torch.linspace(-1, 1, 48))
    batchnorm_to_groupnorm(block)
    assert isinstance(block[1], torch.nn.GroupNorm) and block[1].num_groups == 16  # gcd(32, 48)
    assert torch.equal(block[1].weight, torch.linspace(0.5, 2, 48))
    assert torch.equal(block[1].bias, torch.linspace(-1, 1, 48))


def test_offline_weight_download_says_what_to_do(monkeypatch):
    from cloudseg import model as model_module

    real = model_module._unet

    def offline(config, weights):
        if weights:
            raise ConnectionError("Name or service not known")
        return real(config, weights)

    monkeypatch.setattr(model_module, "_unet", offline)
    with pytest.raises(RuntimeError, match=r"model\.encoder_weights=null.*pre-fill the model cache"):
        build_model(ModelConfig(encoder="resnet18", encoder_weights="imagenet"))


def test_bad_encoder_name_is_a_config_error():
    with pytest.raises(ValueError, match="model.encoder='resnet999'"):
        build_model(ModelConfig(encoder="resnet999", encoder_weights=None))


# ---------------------------------------------------------------- post-processing and submission


def test_threshold_per_class_and_min_area():
    probs = np.zeros((1, 4, 10, 10), np.float32)
    probs[0, :, :5, :5] = 0.6  # a 25-pixel blob in every class
    probs[0, :, 8, 8] = 0.9  # and a 1-pixel speck
    masks = postprocess(probs, thresholds=(0.5, 0.7, 0.5, 0.5), min_areas=(0, 0, 2, 30))
    assert masks[0, 0].sum() == 26  # both kept
    assert masks[0, 1].sum() == 1  # only the speck clears 0.7
    assert masks[0, 2].sum() == 25  # speck removed, blob kept
    assert masks[0, 3].sum() == 0  # blob smaller than 30


def test_remove_small_components_uses_8_connectivity():
    mask = np.zeros((5, 5), np.uint8)
    mask[0, 0] = mask[1, 1] = mask[2, 2] = 1  # diagonal chain: one component of 3
    assert remove_small_components(mask, 3).sum() == 3


def test_submission_is_checked_before_it_is_written(tiny_data, tmp_path):
    sample = tiny_data / "sample_submission.csv"
    rows = pd.read_csv(sample, keep_default_na=False).assign(EncodedPixels="").values.tolist()
    with pytest.raises(ValueError, match="rows"):
        write_submission(rows[:-1], sample, tmp_path / "s.csv")
    rows[0][1] = "1 999999"
    with pytest.raises(ValueError, match="does not decode"):
        write_submission(rows, sample, tmp_path / "s.csv")
    assert not (tmp_path / "s.csv").exists()
    rows[0][1] = "1 5"
    write_submission(list(reversed(rows)), sample, tmp_path / "s.csv")
    written = pd.read_csv(tmp_path / "s.csv", keep_default_na=False)
    assert written["Image_Label"].tolist() == pd.read_csv(sample)["Image_Label"].tolist()


@pytest.mark.slow
def test_full_resolution_forward_pads_to_1408x2112_and_crops_back():
    model = build_model(ModelConfig(encoder="resnet34", encoder_weights=None)).eval()
    seen = []
    model.unet.register_forward_pre_hook(lambda module, args: seen.append(tuple(args[0].shape)))
    with torch.no_grad():
        logits = model(torch.randint(0, 256, (1, 3, 1400, 2100), dtype=torch.uint8))
    assert seen == [(1, 3, 1408, 2112)] and logits.shape == (1, 4, 1400, 2100)


@pytest.mark.parametrize("tta", ["hflip", "hvflip", "d4-lite"])
def test_tta_unflips_exactly(tta):
    """A model that is flip-equivariant by construction gives the same probabilities with TTA;
    a model that is not (a fixed position bias) shows the average of the flipped views."""
    from cloudseg.predict import TTA_FLIPS, predict_probs

    images = torch.randint(0, 256, (2, 3, 6, 8), dtype=torch.uint8)
    equivariant = lambda x: (x.float()[:, :1].repeat(1, 4, 1, 1) - 128) / 64  # pixel-wise: commutes with flips
    np.testing.assert_allclose(predict_probs(equivariant, images, tta=tta), predict_probs(equivariant, images), atol=1e-6)
    ramp = torch.arange(8.0).expand(2, 4, 6, 8)
    positional = lambda x: ramp - 3.5  # depends on the column only
    expected = sum(torch.sigmoid(ramp - 3.5).flip(d) if d else torch.sigmoid(ramp - 3.5) for d in TTA_FLIPS[tta])
    np.testing.assert_allclose(predict_probs(positional, images, tta=tta), expected / len(TTA_FLIPS[tta]), atol=1e-6)


def test_probabilities_are_the_model_s_own_float32_logits_made_sigmoid_in_place():
    """CPU. Over a model's fresh float32 logits the sigmoid is taken in place: the probabilities
    are that very tensor, equal to torch.sigmoid of the logits it held; bfloat16 logits are
    copied to float32 once and left as they were; expanded or unfolded logits (one value for many
    pixels) get a tensor of their own, a crop of the model's output (its padding cut) is taken in
    place. Would catch: a new tensor of the batch's size for the sigmoid (on a CPU its
    fresh pages cost more than the sigmoid itself), a model's bf16 output overwritten or its
    probabilities taken at bf16's precision, and an in-place sigmoid over elements that share memory
    (torch refuses it where a stride is 0, and gives wrong numbers where windows overlap)."""
    from cloudseg.predict import predict_probs

    images = torch.zeros((2, 3, 6, 8), dtype=torch.uint8)
    logits = torch.randn(2, 4, 6, 8)
    expected = torch.sigmoid(logits)
    returned = []
    probs = predict_probs(lambda x: returned.append(logits.clone()) or returned[-1], images)
    assert probs.data_ptr() == returned[0].data_ptr() and torch.equal(probs, expected)
    half = logits.bfloat16()
    probs = predict_probs(lambda x: half, images)
    assert torch.equal(half, logits.bfloat16()) and torch.equal(probs, torch.sigmoid(half.float()))
    column = torch.randn(8)
    probs = predict_probs(lambda x: column.expand(2, 4, 6, 8), images)
    assert torch.equal(probs, torch.sigmoid(column).expand(2, 4, 6, 8))
    ramp = torch.randn(2 * 4 * 6 + 7)  # windows of 8 numbers, one apart: each number in up to 8 places
    probs = predict_probs(lambda x: ramp.unfold(0, 8, 1).view(2, 4, 6, 8), images)  # in place: sigmoids of sigmoids
    torch.testing.assert_close(probs, torch.sigmoid(ramp).unfold(0, 8, 1).reshape(2, 4, 6, 8), rtol=0, atol=1e-6)
    cropped = torch.randn(2, 4, 8, 10)
    expected = torch.sigmoid(cropped[..., 1:7, :8])
    assert torch.equal(predict_probs(lambda x: cropped[..., 1:7, :8], images), expected)
    assert torch.equal(cropped[..., 1:7, :8], expected)  # a crop of the model's output (its padding): in place
