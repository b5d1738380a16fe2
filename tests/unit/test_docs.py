"""The README's contract tables stay in step with the code."""

from __future__ import annotations

from pathlib import Path

from swarmnode.node.config import FLAGS
from swarmnode.util.metrics import Metrics

README = (Path(__file__).parents[2] / "README.md").read_text()


def test_every_flag_and_its_environment_twin_is_documented() -> None:
    for flag in FLAGS:
        assert f"`{flag.option}`" in README and f"`{flag.env}`" in README, flag.option


def test_every_metric_is_documented() -> None:
    for family in Metrics().registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        assert f"`{name}`" in README, name


def readme_module_tree() -> set[str]:
    """The modules the README's tree names, as paths inside the package."""
    block = README.split("## Modules", 1)[1].split("```", 2)[1]
    paths, folders = set(), []
    for line in block.splitlines()[2:]:  # below "swarmnode/"
        name, depth = line.strip().split(" ")[0], (len(line) - len(line.lstrip())) // 2 - 1
        if not name:
            continue
        folders = folders[:depth]
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
        else:
            paths.add("/".join([*folders, name]))
    return paths


def test_the_module_tree_matches_the_package() -> None:
    package = Path(__file__).parents[2] / "swarmnode"
    found = {
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if "proto" not in p.parts and p.name != "__init__.py"
    }
    assert readme_module_tree() == found
