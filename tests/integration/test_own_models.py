"""Models the daemon is given (docs/models.md): a swarm of a tiny Llama (`hf:` config) averages with
one digest per round and heals a wiped node from a neighbour; the docs' own `py:` factory trains in a
2-node swarm and exports; a node started from pretrained weights starts from exactly them."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import torch
from hfmodels import llama_config, pretrained_llama, transformers

from swarmnode.cli.main import main
from swarmnode.core.data import ShardLoader, load_corpus
from swarmnode.swarm.recovery.restore import read_receipts
from swarmtest import (
    NodeProcess,
    assert_ledgers_replay,
    cold_metadata,
    first_agreed_round,
    newest_snapshot,
    start_swarm,
    stop_all,
    wait_for,
)

DOCS = Path(__file__).parents[2] / "docs" / "models.md"
SWARM = (
    *("--inner-steps", "6", "--hot-every", "1000", "--cold-every", "1", "--keep-cold", "100"),
    *("--matchmaking-timeout", "10", "--allreduce-timeout", "20", "--seed", "5"),
)


def digests_by_round(nodes: list[NodeProcess]) -> dict[int, dict[str, str]]:
    rounds: dict[int, dict[str, str]] = {}
    for node in nodes:
        for outer, meta in cold_metadata(node).items():
            rounds.setdefault(outer, {})[meta["node_id"]] = meta["global_digest"]
    return rounds


def test_a_tiny_llama_swarm_averages_and_heals_a_wiped_node(tmp_path: Path, reaper) -> None:
    model = f"hf:{llama_config(tmp_path / 'llama')}"
    args = [*SWARM, "--model", model, "--run-id", "llama", "--max-outer-steps", "40", "--wait-peers", "2"]
    nodes = start_swarm(reaper, tmp_path, 3, args)
    agreed = wait_for(lambda: first_agreed_round(digests_by_round(nodes), 3, 1), 120, "3 equal digests")
    for outer, digests in digests_by_round(nodes).items():
        if len(digests) > 1:
            assert len(set(digests.values())) == 1, f"round {outer}: digests differ"
    wiped = nodes[2]
    wiped.kill()
    shutil.rmtree(wiped.data_dir / "snapshots")
    wiped.restart()
    receipt = wait_for(lambda: read_receipts(wiped.data_dir)[1:], 90, "the wiped node's receipt")[0]
    assert receipt["source"] == "peer" and receipt["outer_step"] >= agreed
    wait_for(lambda: first_agreed_round(digests_by_round(nodes), 3, receipt["outer_step"]), 90, "3 agree")
    assert main(["sample", nodes[0].grpc_address, "--tokens", "8", "--model", model]) == 0  # its newest
    stop_all(nodes)
    assert_ledgers_replay(nodes)
    assert cold_metadata(nodes[0])[1]["model"] == model


def docs_factory(directory: Path) -> Path:
    """docs/models.md's `my_models.py`, written into `directory` (returned, for PYTHONPATH)."""
    code = re.search(r"```python\n(# my_models\.py.*?)```", DOCS.read_text(), re.S)
    assert code, "docs/models.md has no my_models.py example"
    directory.mkdir()
    (directory / "my_models.py").write_text(code.group(1))
    return directory


def test_the_docs_factory_trains_in_a_two_node_swarm_and_exports(tmp_path: Path, reaper) -> None:
    env = {"PYTHONPATH": str(docs_factory(tmp_path / "code"))}
    args = [*SWARM, "--model", "py:my_models:make", "--run-id", "py", "--max-outer-steps", "3"]
    nodes = start_swarm(reaper, tmp_path, 2, [*args, "--wait-peers", "1"], env=env)
    for node in nodes:
        assert node.wait(120) == 0, node.log()[-3000:]
    rounds = digests_by_round(nodes)
    assert all(len(set(d.values())) == 1 for d in rounds.values()), rounds
    assert any(len(d) == 2 for d in rounds.values()), "no round was averaged by both"
    assert_ledgers_replay(nodes)
    out = tmp_path / "weights.safetensors"
    assert main(["export", str(newest_snapshot(nodes[0].data_dir)), "--out", str(out)]) == 0
    assert (
        main(["sample", str(newest_snapshot(nodes[0].data_dir)), "--tokens", "4"]) == 2
    )  # not importable here


def test_a_node_from_pretrained_weights_starts_from_them(tmp_path: Path, reaper) -> None:
    directory = pretrained_llama(tmp_path / "pretrained")
    args = [*SWARM, "--model", f"hf:{directory}", "--run-id", "ft", "--max-outer-steps", "1", "--shard", "0"]
    node = reaper.node(tmp_path / "node", args).start()
    assert node.wait(120) == 0, node.log()[-3000:]
    first_loss = read_receipts(node.data_dir)[0]["first_loss_after"]
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True)
    batch = ShardLoader(load_corpus(None), 0, 16, 4, 64, seed=5).next_batch()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (the node's --threads: the same reductions, the same bits)
    try:
        with torch.no_grad():
            logits = model(input_ids=batch.inputs).logits
        own = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), batch.targets.reshape(-1))
    finally:
        torch.set_num_threads(threads)
    assert first_loss == float(own), (first_loss, float(own))
