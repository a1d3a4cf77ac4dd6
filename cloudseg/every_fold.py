"""One fold, or every fold in one run: what `cloudseg train` trains (`train.every_fold`).

Data path: train.csv → Dataset → loader → model → accumulated step → **the run: one fold, or every
fold (train.py for each) and one rule tuned on all their out-of-fold images (and on the folds'
ensemble predicting every training image)** → checkpoint → probabilities at 350×525 →
post-process → submission.

Where the data is small, one fold's out-of-fold images are too few to tune the rule on (13 of 64
training images, 32 of 160), and the rule is where the score is lost: on noisy labels a rule tuned
on the test images themselves took about 20 points more of the margin from the same probabilities
(BENCHMARKS.md). Training every fold gives every training image's out-of-fold probabilities to one
rule, and the folds' ensemble to predict with, for k trainings of a small dataset. So
`train.every_fold: auto` trains every fold up to SMALL_DATASET training images, one fold above
(Kaggle's 5,546 images: one fold, as before).

The pooled rule fits the folds' ensemble, which predict applies it to, better when it is also tuned
on that ensemble's probabilities of the training images themselves (RUN/insample.npz,
train.in_sample_rule): on noisy datasets of 160 images it captured 79% of the margin where the
out-of-fold images alone captured 64% on the five draws it was chosen on, 61% against 59% on five
fresh ones (docs/cross-validation.md, 2026-12-05). In-sample probabilities alone are too sure of
themselves (each image was trained on by all folds but one); beside the out-of-fold ones they
tell the rule how the ensemble's probabilities run.

An every-fold run RUN holds the folds as ordinary runs, RUN/fold0 ... RUN/fold{k-1} (each with its
best.pt, last.pt, config.yaml, metrics.csv, oof.npz and its own rule), and beside them RUN/config.yaml
(train.every_fold: true), RUN/insample.npz, the pooled rule RUN/postprocess.json (make cv's layout)
and RUN/best.pt, which names the folds' best.pt (checkpoint.FOLDS) so that `cloudseg predict
--checkpoint RUN/best.pt` predicts with every fold and the pooled rule. A fold with its oof.npz is
done; a resume goes on with the fold that has a last.pt and no oof.npz, then trains the rest (and
makes insample.npz again).
"""

from __future__ import annotations

import logging
from pathlib import Path

from cloudseg import distributed
from cloudseg.checkpoint import FOLDS, fold_checkpoints, load_checkpoint, save_checkpoint
from cloudseg.config import Config, dump, load_config, resumed_config
from cloudseg.data import read_train_csv
from cloudseg.files import atomic_path
from cloudseg.hardware import resolve_device
from cloudseg.oof import IN_SAMPLE_FILE, OOF_FILE, predict_in_sample, write_oof
from cloudseg.postprocess import RULE_FILE
from cloudseg.stopping import Interrupted
from cloudseg.train import best_epoch, train
from cloudseg.tune import table, tune

log = logging.getLogger("cloudseg")

# train.every_fold: auto trains every fold up to this many training images (all folds together).
# Measured on unseen noisy datasets (docs/cross-validation.md, 2026-12-04): every fold captured 75% of
# the margin to a ceiling against one fold's 64% at 160 images, 65% against 59% at 64; at 800 images
# one fold's 160 out-of-fold images came close to it (the measurement). At 400 the k=5
# trainings cost one fold's on 2,000 images, half a Kaggle-size run's one fold.
SMALL_DATASET = 400
LOUD = "#" * 100


def every_fold(config: Config) -> tuple[bool, str]:
    """Whether this run trains every fold (train.every_fold, auto by the number of training
    images), and why, in words."""
    folds = config.data.n_folds
    if config.train.every_fold != "auto":
        return bool(config.train.every_fold), f"train.every_fold={str(config.train.every_fold).lower()}"
    images = training_images(config)
    if images <= SMALL_DATASET:
        return True, (f"{images} training images, at most {SMALL_DATASET}: one fold's {images // folds} out-of-fold "
                      f"images are too few to tune the rule on, and {folds} trainings of so few images are "
                      "affordable (train.every_fold=false trains one fold)")
    return False, (f"{images} training images, more than {SMALL_DATASET}: one fold's {images // folds} out-of-fold "
                   f"images tune the rule well enough (train.every_fold=true trains all {folds} folds)")


def in_sample_rule(config: Config) -> bool:
    """Whether an every-fold run tunes its rule on its ensemble's in-sample probabilities too
    (train.in_sample_rule; auto: up to SMALL_DATASET training images, where it was measured)."""
    if config.train.in_sample_rule != "auto":
        return config.train.in_sample_rule
    return training_images(config) <= SMALL_DATASET


def training_images(config: Config) -> int:
    """The number of training images (train.csv's, less those skipped with data.on_bad_sample=skip)."""
    return len(read_train_csv(config.data.dir, [] if config.data.on_bad_sample == "skip" else None))


def is_every_fold_run(run_dir: str | Path) -> bool:
    """Whether `run_dir` is an every-fold run: its config.yaml says train.every_fold: true."""
    path = Path(run_dir) / "config.yaml"
    return path.is_file() and load_config(path).train.every_fold is True


def train_run(config: Config, run_dir: str | Path, resume: bool = False, overrides: list[str] = ()) -> str:
    """`cloudseg train`: one fold (train.train) or every fold (`train_every_fold`), as
    `every_fold` decides, said loudly; returns the line that sums the run up."""
    run_dir = Path(run_dir)
    try:
        return trained(config, run_dir, resume, overrides)
    finally:  # every run of the command done: under torchrun, the process group they shared ends
        distributed.stop()


def trained(config: Config, run_dir: Path, resume: bool, overrides: list[str]) -> str:
    """The run `train_run` trains, and its summary line."""
    if resume and is_every_fold_run(run_dir):
        return train_every_fold(config, run_dir, resume=True, overrides=overrides)
    chosen, why = (False, "a resumed run of one fold") if resume else every_fold(config)
    if chosen:
        log.info("%s\n# every fold: %s\n# training folds 0-%d into %s/fold*, one rule tuned on all their out-of-fold "
                 "images; %s/best.pt predicts with the %d folds' ensemble\n%s", LOUD, why, config.data.n_folds - 1,
                 run_dir, run_dir, config.data.n_folds, LOUD)
        config = config.model_copy(deep=True)
        config.train.every_fold = True
        return train_every_fold(config, run_dir)
    if not resume:
        log.info("%s\n# one fold (data.fold=%d): %s\n%s", LOUD, config.data.fold, why, LOUD)
    config = config.model_copy(deep=True)
    config.train.every_fold = False
    history = train(config, run_dir, resume=resume)
    best = history.iloc[best_epoch(history.to_dict("records"))]
    return (f"run {run_dir}: best validation Dice {best['dice_tuned']:.4f} under its tuned rule "
            f"({best['dice']:.4f} under the config's) at epoch {int(best['epoch'])}; "
            f"predict applies {run_dir / RULE_FILE}")


def train_every_fold(config: Config, run_dir: Path, resume: bool = False, overrides: list[str] = ()) -> str:
    """Every fold of `config` into run_dir/foldK (done folds skipped, a stopped one resumed with
    `overrides`), then one rule tuned on all their out-of-fold images and best.pt naming the folds."""
    if distributed.is_main():  # a resume's too: its overrides train the folds still to come
        run_dir.mkdir(parents=True, exist_ok=True)
        with atomic_path(run_dir / "config.yaml") as tmp:
            tmp.write_text(dump(config))
    folds = [run_dir / f"fold{k}" for k in range(config.data.n_folds)]
    for k, fold in enumerate(folds):
        if (fold / OOF_FILE).is_file():
            log.info("fold %d of %d: done (%s)", k, len(folds), fold)
            continue
        if distributed.is_main():  # the folds' ensemble changes: its in-sample probabilities are made again
            (run_dir / IN_SAMPLE_FILE).unlink(missing_ok=True)
        try:
            train_fold(config, fold, k, overrides)
        except Interrupted as stopped:  # the whole run goes on from here, not the fold alone
            raise Interrupted(f"fold {k}: {str(stopped).replace(f'--resume {fold}', f'--resume {run_dir}')}") from None
    if not distributed.is_main():
        return ""
    save_checkpoint(run_dir / "best.pt", {FOLDS: [f"{fold.name}/best.pt" for fold in folds],
                                          "config": config.model_dump(mode="json")})
    write_in_sample(config, run_dir)
    result = tune([run_dir], run_dir / RULE_FILE)
    log.info("the pooled rule, tuned on %s:\n%s", tuned_on(result), table(result))
    return (f"run {run_dir}: {len(folds)} folds; CV Dice {result['cv_dice']['after']['mean']:.4f} on their "
            f"{result['images'] - result['in_sample_images']} out-of-fold images under the rule tuned on "
            f"{tuned_on(result)} ({run_dir / RULE_FILE}); predict with {run_dir / 'best.pt'} uses the {len(folds)} "
            "folds' ensemble")


def write_in_sample(config: Config, run_dir: Path) -> None:
    """RUN/insample.npz, the folds' ensemble on every training image, where the rule is tuned on it
    (`in_sample_rule`) and it is not written yet; else none (a file of an earlier setting goes)."""
    path = run_dir / IN_SAMPLE_FILE
    if not in_sample_rule(config):
        path.unlink(missing_ok=True)
        return
    if path.is_file():
        log.info("the folds' in-sample probabilities: done (%s)", path)
        return
    log.info("the %d folds' ensemble predicting every training image (%s), to tune the rule on beside the "
             "out-of-fold images: it is the ensemble predict applies the rule to", config.data.n_folds, path)
    device = resolve_device(config.train.device)
    write_oof(path, *predict_in_sample(fold_checkpoints(run_dir / "best.pt"), device))


def tuned_on(result: dict) -> str:
    """The images a pooled rule was tuned on, in words."""
    in_sample = result["in_sample_images"]
    return (f"{result['images'] - in_sample} out-of-fold images" if not in_sample else
            f"{result['images'] - in_sample} out-of-fold and {in_sample} in-sample images")


def train_fold(config: Config, fold: Path, k: int, overrides: list[str]) -> None:
    """Fold `k` of an every-fold run into `fold`: resumed from its last.pt (with the resume's
    `overrides`) where it has one, else from the start."""
    if (fold / "last.pt").is_file():
        log.info("fold %d of %d: resuming %s", k, config.data.n_folds, fold)
        saved = load_checkpoint(fold / "last.pt")["config"]
        train(resumed_config(saved, list(overrides), f"{fold}/last.pt"), fold, resume=True)
        return
    log.info("fold %d of %d: training into %s", k, config.data.n_folds, fold)
    fold_config = config.model_copy(deep=True)
    fold_config.data.fold, fold_config.train.every_fold = k, False
    train(fold_config, fold)
