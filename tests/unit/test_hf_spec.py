"""`--model hf:PATH` (core/hf_spec.py): the run digest holds the config and the starting weights' hash,
a bad or missing model is one line naming --model, and weights start where `save_pretrained` left them."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
import torch
from hfmodels import llama_config, pretrained_llama, transformers

from swarmnode.cli.main import main
from swarmnode.core.data import ShardLoader, default_corpus
from swarmnode.core.diloco import DilocoConfig
from swarmnode.core.model_spec import load_model_spec
from swarmnode.core.training import RunIdentity, TrainingRun, run_digest
from swarmnode.util.errors import ConfigError
from swarmnode.util.metrics import Metrics


def digest(model: str) -> str:
    return run_digest(load_model_spec(model, 256), 64, 16, 0, DilocoConfig(), "c" * 64)


def test_the_digest_holds_the_config_and_the_weights_not_where_they_are(tmp_path: Path) -> None:
    first, moved = llama_config(tmp_path / "a"), llama_config(tmp_path / "b")
    assert digest(f"hf:{first}") == digest(f"hf:{moved}") == digest(f"hf:{first / 'config.json'}")
    wider = llama_config(tmp_path / "c", hidden_size=128)
    pretrained = pretrained_llama(tmp_path / "d")
    assert len({digest(f"hf:{first}"), digest(f"hf:{wider}"), digest(f"hf:{pretrained}")}) == 3
    other_weights = pretrained_llama(tmp_path / "e", seed=12)
    assert digest(f"hf:{pretrained}") != digest(f"hf:{other_weights}")


def test_a_run_from_pretrained_weights_takes_its_first_step_from_them(tmp_path: Path) -> None:
    directory = pretrained_llama(tmp_path / "pretrained")
    corpus = default_corpus()
    spec = load_model_spec(f"hf:{directory}", corpus.vocab_size)
    loader = ShardLoader(corpus, 0, 16, 2, 32, seed=0)
    identity = RunIdentity("t", "ab" * 20, "0" * 64, corpus.digest, spec.label)
    run = TrainingRun(spec, DilocoConfig(), loader, corpus, identity, 0, torch.device("cpu"), Metrics())
    batch = ShardLoader(corpus, 0, 16, 2, 32, seed=0).next_batch()
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    with torch.no_grad():
        want = float(spec.loss(reference, batch.inputs, batch.targets))
    run.inner_phase(1, None, threading.Event(), lambda: None)
    assert run.progress.last_loss == want


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model_type": "no-such-architecture"}, "not a model type transformers knows"),
        ({"model_type": "vit"}, "'vit' is not a causal LM"),
    ],
)
def test_an_unsupported_architecture_is_one_line_naming_the_flag(
    tmp_path: Path, config: dict, message: str
) -> None:
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"^--model: ") as caught:
        load_model_spec(f"hf:{tmp_path}", 256)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_without_the_extra_the_line_names_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # (import fails as if not installed)
    with pytest.raises(ConfigError, match=r"pip install 'swarmnode\[hf\]'"):
        load_model_spec(f"hf:{llama_config(tmp_path)}", 256)


def test_a_vocabulary_smaller_than_the_data_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="vocabulary of 128 is smaller than the data's 256"):
        load_model_spec(f"hf:{llama_config(tmp_path, vocab_size=128)}", 256)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--seq-len", "129"], "--seq-len"),  # the config's max_position_embeddings is 128
        (["--model", "hf:/nonexistent/llama"], "--model"),
        (["--model", "py:nonexistent_module_x:make"], "--model"),
    ],
)
def test_a_start_checks_the_model_before_anything_listens(
    argv: list[str], flag: str, tmp_path: Path, capsys
) -> None:
    model = ["--model", f"hf:{llama_config(tmp_path / 'llama')}"]
    code = main(["run", "--dry-run", "--data-dir", str(tmp_path / "d"), *model, *argv])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and flag in err[0], err
    assert not (tmp_path / "d").exists()
