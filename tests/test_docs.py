"""The docs list what the code declares: the patch table in docs/design.md
is the registry's (``python -m vllm_lookahead.patches --write docs/design.md``
rewrites it), and the docs stay within their sizes (issue 68)."""

import os

from vllm_lookahead.patches import table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def test_design_lists_every_patch_as_the_registry_does():
    text = read("docs/design.md")
    begin, end = "<!-- patches:begin -->\n", "<!-- patches:end -->"
    assert begin in text and end in text
    block = text.split(begin, 1)[1].split(end, 1)[0]
    assert block.strip() == table().strip(), (
        "docs/design.md's patch table differs from the registry: run "
        "`python -m vllm_lookahead.patches --write docs/design.md`")


def test_docs_stay_short():
    for path, most in (("README.md", 250), ("docs/design.md", 300), ("CHANGELOG.md", 150)):
        assert len(read(path).splitlines()) <= most, path
