"""`--nproc-per-node` without processes: how a node's ranks split its data stream, what a snapshot records
of them, and the combinations a node refuses (exit 2, one line) before anything starts."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch

from swarmnode.cli import main as cli
from swarmnode.core.data import Corpus, ShardLoader
from swarmnode.node.config import NodeConfig
from swarmnode.node.startup import check_gpu_count
from swarmnode.snapshot.format import SnapshotError
from swarmnode.snapshot.metadata import SnapshotMetadata
from swarmnode.snapshot.read import OPTIONAL_TENSOR
from swarmnode.util.errors import ConfigError


def small_loader() -> ShardLoader:
    """A shard of 30 windows read 4 at a time: an epoch is 7 batches (the last 2 windows wait)."""
    tokens = np.arange(267, dtype=np.uint16) % 251  # 241 to train on after the held-out tenth
    corpus = Corpus(tokens, 256, hashlib.sha256(tokens.tobytes()).hexdigest(), "test")
    return ShardLoader(corpus, 0, 1, 4, 8, seed=1)


def ranks_stream(counts: list[int], steps: int) -> list[tuple[int, int]]:
    """(epoch, position) of every batch a node trains over `steps` steps for each rank count in
    `counts` (the count changing between them, as across a restart), in the stream's order."""
    loaders = {0: small_loader()}
    taken: list[tuple[int, int]] = []
    for world in counts:
        cursor = loaders[0].state_dict()
        ranks = [small_loader() for _ in range(world)]
        for loader in ranks:
            loader.load_state_dict(cursor)
        for _ in range(steps):
            batches = [loader.next_batch_of(rank, world) for rank, loader in enumerate(ranks)]
            taken += [(b.epoch, b.position) for b in batches]
            assert len({str(loader.state_dict()) for loader in ranks}) == 1  # every rank at the node's cursor
        loaders[0] = ranks[0]
    return taken


def test_ranks_read_the_nodes_one_stream_so_another_rank_count_neither_skips_nor_repeats() -> None:
    single = small_loader()
    stream = [(b.epoch, b.position) for b in (single.next_batch() for _ in range(2 * 5 + 3 * 5 + 5))]
    assert ranks_stream([2, 3, 1], 5) == stream  # across two epoch ends
    assert len({s for s in stream if s[0] == 0}) == 7


def test_a_rank_reads_its_own_batch_of_each_step() -> None:
    a, b = small_loader(), small_loader()
    first, second = a.next_batch_of(0, 2), b.next_batch_of(1, 2)
    assert (first.position, second.position) == (0, 4)
    assert not torch.equal(first.inputs, second.inputs)


def test_the_ranks_field_is_optional_and_checked() -> None:
    from test_precision import precision_run

    from swarmnode.core.precision import Precision

    metadata = {**precision_run(Precision.FP32).state_metadata(), "kind": "hot", "layout": "planes"}
    cursor = metadata["cursor"]
    assert SnapshotMetadata.parse(metadata).ranks == (cursor,)
    assert SnapshotMetadata.parse({k: v for k, v in metadata.items() if k != "ranks"}).ranks is None
    for bad in ([], [cursor] * 65, [{"shard": 0}], "two"):
        with pytest.raises(SnapshotError, match="ranks"):
            SnapshotMetadata.parse({**metadata, "ranks": bad})


def test_the_ranks_rng_states_are_optional_tensors() -> None:
    assert OPTIONAL_TENSOR.match("rng/rank/1/torch") and OPTIONAL_TENSOR.match("rng/rank/7/cuda")
    assert not OPTIONAL_TENSOR.match("rng/rank/1/model") and not OPTIONAL_TENSOR.match(
        "model/rng/rank/1/torch"
    )


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"nproc_per_node": 2}, "^--nproc-per-node: at most --max-ranks \\(1\\)"),
        (
            {"nproc_per_node": 2, "max_ranks": 2, "device": "cuda:1"},
            "^--nproc-per-node: rank k trains on GPU k",
        ),
        ({"max_ranks": 65}, "^--max-ranks: at most 64"),
        ({"nproc_per_node": 0}, "^--nproc-per-node"),
        ({"shard_model": "on"}, "^--shard-model: shards θ across the node's ranks; give --nproc-per-node 2"),
        (
            {"shard_model": "on", "nproc_per_node": 2, "max_ranks": 2, "precision": "fp16", "device": "cuda"},
            "^--shard-model: fp16's grad scaler",
        ),
    ],
)
def test_combinations_a_node_of_several_ranks_refuses(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        NodeConfig(**settings)


@pytest.mark.parametrize("settings", [{"overlap": "on"}, {"fragments": 2}, {"wire_dtype": "topk"}])
def test_a_node_of_several_ranks_takes_every_outer_step_mode(settings: dict) -> None:
    assert NodeConfig(nproc_per_node=2, max_ranks=2, **settings).nproc_per_node == 2


def test_more_ranks_than_gpus_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_gpu_count(2, torch.device("cuda"))
    check_gpu_count(4, torch.device("cpu"))  # gloo ranks on the CPU need no GPU
    with pytest.raises(
        ConfigError, match="^--nproc-per-node: one GPU per rank, and this machine has 2, got 4$"
    ):
        check_gpu_count(4, torch.device("cuda"))


def test_the_weight_cap_counts_max_ranks() -> None:
    one, two = NodeConfig(), NodeConfig(nproc_per_node=2, max_ranks=2)
    assert two.round_tokens == 2 * one.round_tokens == 2 * 8 * 128 * 500


def test_shard_model_alone_means_on(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import json

    base = ["run", "--dry-run", "--data-dir", str(tmp_path / "d"), "--nproc-per-node", "2"]
    base += ["--max-ranks", "2"]
    for argv, want in ((["--shard-model"], "on"), (["--shard-model", "off"], "off"), ([], "off")):
        assert cli.main([*base, *argv, "--device", "cpu"]) == 0
        assert json.loads(capsys.readouterr().out)["shard_model"] == want, argv


def test_bad_rank_counts_exit_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["--nproc-per-node", "2"],
        ["--nproc-per-node", "0"],
        ["--precision", "fp16", "--device", "cpu"],
        ["--shard-model"],
        ["--shard-model", "yes", "--nproc-per-node", "2", "--max-ranks", "2"],
    ):
        code = cli.main(["run", "--dry-run", "--data-dir", str(tmp_path / "d"), *argv])
        err = capsys.readouterr().err.splitlines()
        assert code == 2 and len(err) == 1 and "error:" in err[0], (argv, err)


def test_each_rank_trains_on_its_own_gpu() -> None:
    from dataclasses import replace

    from swarmnode.node.rank import RankSpec

    spec = RankSpec(
        rank=0, world=4, store_port=1, parent_pid=1, node_id="n", model="tiny", data=None, device="cuda",
        precision="bf16", threads=None, batch_size=4, seq_len=8, num_shards=1, seed=0, weight_decay=0.1,
        betas=(0.9, 0.95), grad_clip=1.0,
    )  # fmt: skip
    assert [replace(spec, rank=k).rank_device for k in range(4)] == [
        torch.device("cuda", k) for k in range(4)
    ]
    assert replace(spec, rank=3, device="cpu").rank_device == torch.device("cpu")  # (gloo ranks share it)
