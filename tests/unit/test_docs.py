"""The README's contract tables stay in step with the code."""

from __future__ import annotations

from pathlib import Path

from swarmnode.config import FLAGS
from swarmnode.metrics import Metrics

README = (Path(__file__).parents[2] / "README.md").read_text()


def test_every_flag_and_its_environment_twin_is_documented() -> None:
    for flag in FLAGS:
        assert f"`{flag.option}`" in README and f"`{flag.env}`" in README, flag.option


def test_every_metric_is_documented() -> None:
    for family in Metrics().registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        assert f"`{name}`" in README, name


def test_every_module_is_in_the_module_map() -> None:
    package = Path(__file__).parents[2] / "swarmnode"
    for path in package.glob("*.py"):
        if path.name in ("__init__.py",) or path.name.startswith("bench"):
            continue
        assert f"`{path.name}`" in README, path.name
