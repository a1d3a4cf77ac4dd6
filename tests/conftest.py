import pytest

from cloudseg.synth import synthesize

TINY_SHAPE = (64, 96)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A small synthetic dataset in the Kaggle layout (shared; tests must not modify it)."""
    return synthesize(tmp_path_factory.mktemp("tiny"), n_train=24, n_test=6, height=TINY_SHAPE[0], width=TINY_SHAPE[1], seed=3)
