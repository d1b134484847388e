"""A model's tokenizer, loaded for validation's token count: AutoTokenizer's choice of class is kept in the model
cache, so that later processes load that class without importing torch (AutoTokenizer's own module does)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from batch_dagster.engine import models
from batch_dagster.engine.prepare import minilm_dir

FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A local model folder of its own (the embedding model's tokenizer and config)."""
    out = tmp_path / "model"
    out.mkdir()
    for name in FILES:
        shutil.copy(minilm_dir() / name, out / name)
    return out


@pytest.fixture
def auto_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """AutoTokenizer's loads, counted (in the module's dict: reading its lazy attribute would import torch here)."""
    import transformers  # here, not at collection: 0.7 s of each pytest worker's, most of which run none of these

    calls: list[str] = []

    class Auto:
        @staticmethod
        def from_pretrained(path: str) -> object:
            calls.append(path)
            return transformers.BertTokenizer.from_pretrained(path)

    monkeypatch.setitem(transformers.__dict__, "AutoTokenizer", Auto)
    models._tokenizer.cache_clear()
    yield calls
    models._tokenizer.cache_clear()


def test_the_class_autotokenizer_chose_loads_the_folder_next_time(folder: Path, tmp_path: Path, auto_calls):
    cache = tmp_path / "cache"
    first = models._tokenizer(str(folder), str(cache))
    assert auto_calls == [str(folder)]
    record = json.loads((cache / models.TOKENIZER_CLASSES).read_text())
    assert record[str(folder)][0] == "BertTokenizer"

    models._tokenizer.cache_clear()  # another process
    again = models._tokenizer(str(folder), str(cache))
    assert auto_calls == [str(folder)] and type(again) is type(first)
    assert again.encode("The quick brown fox.") == first.encode("The quick brown fox.")

    # A folder whose tokenizer config changed is AutoTokenizer's to decide again.
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 256}))
    models._tokenizer.cache_clear()
    assert models._tokenizer(str(folder), str(cache)).model_max_length == 256
    assert auto_calls == [str(folder)] * 2


def test_a_recorded_class_loads_without_torch(folder: Path, tmp_path: Path, auto_calls):
    cache = tmp_path / "cache"
    expected = models._tokenizer(str(folder), str(cache)).encode("Tokens, counted.")
    script = ("import sys; from batch_dagster.engine.models import _tokenizer; "
              f"t = _tokenizer({str(folder)!r}, {str(cache)!r}); "
              "print(type(t).__name__, t.encode('Tokens, counted.'), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.split()[0] == "BertTokenizer" and out.strip().endswith("False")
    assert str(expected).replace(" ", "") in out.replace(" ", "")


def test_an_unwritable_cache_asks_autotokenizer_each_time(folder: Path, tmp_path: Path, auto_calls):
    blocked = tmp_path / "file"
    blocked.write_text("")  # a cache folder that cannot be made
    for _ in range(2):
        models._tokenizer.cache_clear()
        assert models._tokenizer(str(folder), str(blocked / "cache")).encode("x")
    assert len(auto_calls) == 2


def test_a_model_s_own_tokenizer_code_is_not_recorded(folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import transformers

    class Own(transformers.BertTokenizer):  # a model's remote code: no class of transformers' by that name
        pass

    monkeypatch.setitem(transformers.__dict__, "AutoTokenizer", Own)
    models._tokenizer.cache_clear()
    assert type(models._tokenizer(str(folder), str(tmp_path / "cache"))) is Own
    assert not (tmp_path / "cache" / models.TOKENIZER_CLASSES).exists()
    models._tokenizer.cache_clear()
