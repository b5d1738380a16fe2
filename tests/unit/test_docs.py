"""The docs stay in step with the code: every flag, metric and module is documented where a user looks,
the generated flag reference is fresh, every section that code names exists, and the README stays a
front door."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from swarmnode.node import flag_reference
from swarmnode.node.config import FLAGS, FlagGroup
from swarmnode.util.metrics import Metrics

ROOT = Path(__file__).parents[2]
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
CONFIGURATION = (DOCS / "configuration.md").read_text()
OPERATIONS = (DOCS / "operations.md").read_text()
DESIGN = (DOCS / "design.md").read_text()


def test_every_flag_and_its_environment_twin_is_documented() -> None:
    for flag in FLAGS:
        assert f"`{flag.option}`" in CONFIGURATION and f"`{flag.env}`" in CONFIGURATION, flag.option


def test_every_flag_has_a_group() -> None:
    # `run --help` and docs/configuration.md are sectioned by group; an ungrouped flag lands in "other".
    assert [flag.option for flag in FLAGS if not isinstance(flag.group, FlagGroup)] == []


def test_the_flag_reference_is_generated_from_the_flag_table() -> None:
    assert flag_reference.rewritten(CONFIGURATION) == CONFIGURATION, (
        "docs/configuration.md is stale: run python -m swarmnode.node.flag_reference"
    )


def test_the_flag_reference_check_fails_when_stale(tmp_path: Path) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(CONFIGURATION.replace("`--peers`", "`--peer`", 1))
    assert flag_reference.main(["--check", str(stale)]) == 1
    assert flag_reference.main([str(stale)]) == 0
    assert flag_reference.main(["--check", str(stale)]) == 0


def test_every_metric_is_documented() -> None:
    for family in Metrics().registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        assert f"`{name}`" in OPERATIONS, name


def documented_module_tree() -> set[str]:
    """The modules docs/design.md's tree names, as paths inside the package."""
    block = DESIGN.split("## Modules", 1)[1].split("```", 2)[1]
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
    package = ROOT / "swarmnode"
    found = {
        str(p.relative_to(package))
        for p in package.rglob("*.py")
        if "proto" not in p.parts and p.name != "__init__.py"
    }
    assert documented_module_tree() == found


# ----- the README is a front door -----


def test_the_readme_is_short() -> None:
    assert len(README.splitlines()) <= 300


def test_the_readme_test_command_is_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    command = ci.split("# The README's test command, verbatim:\n", 1)[1].strip()
    assert f"```sh\n{command}\n```" in README


def test_the_readme_names_the_fast_tier() -> None:
    assert "pytest -m unit" in README


# ----- every section that code or docs name exists -----

REFERENCE = re.compile(r'(README|docs/[\w-]+\.md)\s+(?:(?:#|//)\s*)?"([^"]+)"')
LINK = re.compile(r"\]\(((?:docs/)?[\w-]+\.md)(?:#([\w-]+))?\)")
SOURCES = ("swarmnode", "tests", "protos", "deploy", "docs")


def headings(document: str) -> set[str]:
    return {
        line.lstrip("#").strip().replace("`", "") for line in document.splitlines() if line.startswith("#")
    }


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def referring_files() -> list[Path]:
    files = [ROOT / "README.md", *(ROOT / "deploy").glob("*.md"), *(ROOT / "deploy").glob("*.yml")]
    for folder in SOURCES:
        for suffix in ("*.py", "*.proto", "*.md"):
            files += [
                p for p in (ROOT / folder).rglob(suffix) if "proto" not in p.relative_to(ROOT).parts[:2]
            ]
    return sorted(set(files) - {Path(__file__)})


def section_references() -> list[tuple[str, str, str]]:
    """(where, document, heading) for every `docs/x.md "Heading"` (or `README "Heading"`) named."""
    found = []
    for path in referring_files():
        text = " ".join(path.read_text(encoding="utf-8").split())
        for document, heading in REFERENCE.findall(text):
            found.append((str(path.relative_to(ROOT)), document, heading))
    return found


def test_references_are_found() -> None:
    # the scan itself: a regression here would make the next test pass vacuously
    assert len(section_references()) > 30


@pytest.mark.parametrize("where, document, heading", section_references())
def test_every_named_section_exists(where: str, document: str, heading: str) -> None:
    target = ROOT / ("README.md" if document == "README" else document)
    assert target.exists(), f"{where} names {document}, which does not exist"
    assert heading.replace("`", "") in headings(target.read_text()), f'{where}: no "{heading}" in {document}'


def test_no_code_names_the_readme_without_a_section() -> None:
    loose = []
    for path in referring_files():
        if path.suffix not in (".py", ".proto", ".yml") or path.name == "test_docs.py":
            continue
        text = " ".join(path.read_text(encoding="utf-8").split())
        loose += [
            f"{path.relative_to(ROOT)}: …{text[m.start() - 30 : m.end() + 30]}…"
            for m in re.finditer(r"README(?!\.md)(?!\s+\")", text)
        ]
    assert loose == []


def test_every_markdown_link_to_a_doc_resolves() -> None:
    broken = []
    for path in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for target, fragment in LINK.findall(path.read_text()):
            file = (path.parent / target) if not target.startswith("docs/") else ROOT / target
            if not file.exists():
                # docs/models.md and docs/data.md come with the model and data work
                if file.name in ("models.md", "data.md"):
                    continue
                broken.append(f"{path.name} → {target}")
            elif fragment and fragment not in {anchor(h) for h in headings(file.read_text())}:
                broken.append(f"{path.name} → {target}#{fragment}")
    assert broken == []


def test_the_readme_commands_parse() -> None:
    # every `swarmnode …` command in the README's shell blocks is one the CLI accepts
    from swarmnode.cli.main import build_parser

    blocks = re.findall(r"```sh\n(.*?)```", README, flags=re.S)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part.split("#")[0])
                if words[:1] == ["swarmnode"]:
                    commands.append(words[1:])
    assert commands
    for args in commands:
        build_parser().parse_args(args)
