"""The README and docs/ point at what exists: every relative link at a file (and heading), every ``lowmem-hf``
option they name at an option of that command's parser."""

from __future__ import annotations

import argparse
import glob
import os
import re

import pytest

from lowmem_hf import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md", *sorted(glob.glob("docs/*.md", root_dir=REPO)), "benchmarks/README.md"]
COMMAND_PAGES = ["README.md", *sorted(glob.glob("docs/*.md", root_dir=REPO))]

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_COMMAND = re.compile(r"lowmem-hf\s+([a-z]+)((?:\s+[^\s#`]+)*)")


def _anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: str) -> set[str]:
    with open(path) as f:
        text = _FENCE.sub("", f.read())
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+\s+(.+)$", text, re.M)}


def broken_links(root: str, pages: list[str]) -> list[str]:
    """Each relative link of ``pages`` (paths under ``root``) whose file, or heading after ``#``, does not exist."""
    broken = []
    for page in pages:
        with open(os.path.join(root, page)) as f:
            text = _FENCE.sub("", f.read())
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(root, os.path.dirname(page), path)) if path else os.path.join(root, page)
            if not os.path.exists(file):
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and (not file.endswith(".md") or anchor not in _anchors(file)):
                broken.append(f"{page}: {target} (no such heading)")
    return broken


def _code(text: str) -> list[str]:
    """The lines of fenced blocks (their comments dropped) and the inline code spans of ``text``."""
    blocks = [line.split(" # ")[0] for block in _FENCE.findall(text) for line in block.splitlines()[1:-1]]
    return blocks + re.findall(r"`([^`\n]+)`", _FENCE.sub("", text))


def _parsers() -> dict[str, argparse.ArgumentParser]:
    parsers = {}
    for name, (_, build, _) in cli.COMMANDS.items():
        parsers[name] = argparse.ArgumentParser(prog=f"lowmem-hf {name}")
        build(parsers[name])
    return parsers


def unknown_options(root: str, pages: list[str]) -> list[str]:
    """Each ``lowmem-hf <command> ... --option`` in the code of ``pages`` that the command's parser does not have.
    For ``run``, what follows SCRIPT is the script's own."""
    parsers = _parsers()
    unknown = []
    for page in pages:
        with open(os.path.join(root, page)) as f:
            text = f.read()
        for code in _code(text):
            for command, rest in _COMMAND.findall(code):
                if command not in parsers:
                    unknown.append(f"{page}: lowmem-hf {command} (no such command)")
                    continue
                words = rest.split()
                if command == "run":
                    words = words[:next((i for i, w in enumerate(words) if not w.startswith("-")), len(words))]
                known = set(re.findall(r"--[a-z][a-z0-9-]*", parsers[command].format_help()))
                for option in re.findall(r"--[a-z][a-z0-9-]*", " ".join(words)):
                    if option not in known:
                        unknown.append(f"{page}: lowmem-hf {command} {option}")
    return unknown


def test_every_relative_link_points_at_a_file_and_heading_that_exist():
    assert broken_links(REPO, PAGES) == []


def test_every_lowmem_hf_option_the_docs_name_exists():
    assert unknown_options(REPO, COMMAND_PAGES) == []


def test_the_docs_name_each_command_and_option_of_the_cli():
    text = "\n".join(open(os.path.join(REPO, p)).read() for p in COMMAND_PAGES)
    mentioned = {(c, o) for code in _code(text) for c, rest in _COMMAND.findall(code) for o in re.findall(r"--[a-z][a-z0-9-]*", rest)}
    assert {c for c, _ in mentioned} | set(re.findall(r"`lowmem-hf ([a-z]+)", text)) >= set(cli.COMMANDS)
    assert ("load", "--plot") in mentioned and ("load", "--compare-transformers") in mentioned


@pytest.mark.parametrize("link, found", [
    ("[ok](docs/a.md)", []),
    ("[ok](docs/a.md#the-heading)", []),
    ("[ok](#top-heading)", []),
    ("[gone](docs/missing.md)", ["README.md: docs/missing.md (no such file)"]),
    ("[no heading](docs/a.md#elsewhere)", ["README.md: docs/a.md#elsewhere (no such heading)"]),
    ("![picture](docs/missing.png)", ["README.md: docs/missing.png (no such file)"]),
    ("[web](https://example.com/nothing)", []),
    ("```\n[in code](docs/missing.md)\n```", []),
])
def test_a_broken_link_is_found(tmp_path, link, found):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## The heading\n")
    (tmp_path / "README.md").write_text(f"# Top heading\n\n{link}\n")
    assert broken_links(str(tmp_path), ["README.md"]) == found


@pytest.mark.parametrize("text, found", [
    ("`lowmem-hf load MODEL --compare-transformers --plot x.png`", []),
    ("`lowmem-hf load MODEL --no-such-option`", ["README.md: lowmem-hf load --no-such-option"]),
    ("```bash\nlowmem-hf plan MODEL --tp-size 2   # --not-an-option in a comment\n```", []),
    ("```bash\nlowmem-hf plan MODEL --compare-transformers\n```", ["README.md: lowmem-hf plan --compare-transformers"]),
    ("`lowmem-hf run train.py --model ./my-llama`", []),
    ("`lowmem-hf frobnicate`", ["README.md: lowmem-hf frobnicate (no such command)"]),
])
def test_an_option_the_cli_lacks_is_found(tmp_path, text, found):
    (tmp_path / "README.md").write_text(text + "\n")
    assert unknown_options(str(tmp_path), ["README.md"]) == found
