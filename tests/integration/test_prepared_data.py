"""A real node trains on a directory made by `swarmnode data prepare` (tokens by memmap, the tokenizer's
vocabulary), and its run digest is the one any other copy of that directory gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from swarmnode.cli.main import main
from swarmnode.core.tokens import load_prepared

tokenizers = pytest.importorskip("tokenizers")


def test_a_node_trains_on_a_prepared_directory(tmp_path: Path, reaper) -> None:
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    docs = [
        f"Line {i}: the quality of mercy is not strained, it droppeth as the gentle rain."
        for i in range(6000)
    ]
    tokenizer.train_from_iterator(docs, trainer)
    tokenizer.save(str(tmp_path / "tok.json"))
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepared = tmp_path / "prepared"
    assert (
        main(
            [
                "data",
                "prepare",
                str(tmp_path / "docs.jsonl"),
                "--tokenizer",
                str(tmp_path / "tok.json"),
                "--out",
                str(prepared),
            ]
        )
        == 0
    )
    shutil.copytree(prepared, tmp_path / "copy")
    args = ["--inner-steps", "5", "--max-outer-steps", "1", "--num-shards", "2"]
    nodes = [
        reaper.node(tmp_path / name, [*args, "--data", str(data)]).start()
        for name, data in (("a", prepared), ("b", tmp_path / "copy"))
    ]
    for node in nodes:
        assert node.wait(180) == 0, node.log_tail()
    digests = {json.loads((n.data_dir / "node.json").read_text()).get("run_digest") for n in nodes}
    assert len(digests) == 1
    log = nodes[0].log()
    assert f"sha256 {load_prepared(prepared).digest[:12]}" in log and "prepared:" in log
