"""Fixtures the serving tests share: the tiny random Llama, its in-process Classifier and a Scorer on
it (module-scoped: each test module builds its own), and a model whose weights never finish reading."""
import os
import shutil

import pytest

from prefixscore import Classifier
from prefixscore.scorer import Scorer
from tests.serve.helpers import SCORE_TEMPLATE


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def clf(model):
    return Classifier(model, device="cpu")


@pytest.fixture(scope="module")
def scorer(clf):
    return Scorer(clf.loaded, SCORE_TEMPLATE, ["yes", "no"], chat=False)


@pytest.fixture(scope="module")
def unreadable_model(tiny_model, tmp_path_factory):
    """The tiny model's config and tokenizer, with a FIFO for weights: reading them hangs."""
    folder = tmp_path_factory.mktemp("fifo") / "model"
    shutil.copytree(tiny_model("llama"), folder)
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")
    return str(folder)
