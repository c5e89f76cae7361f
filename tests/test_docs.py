"""The docs stand alone: every relative link in README.md and docs/ resolves inside the repository."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").rglob("*.md"))
KERNEL_PAGES = ("flash_topk", "sparse_attention", "grouped_matmul", "indexer_loss", "causal_attention",
                "gated_delta_rule")

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # https:, mailto:, ...


def links(text: str) -> list[str]:
  """The link targets of a markdown text, outside code blocks and code spans."""
  text = _CODE_SPAN.sub("", _FENCE.sub("", text))
  return _INLINE.findall(text) + _REFERENCE.findall(text)


def broken_links(page: pathlib.Path) -> list[str]:
  """Relative links of `page` that leave the repository or name nothing in it (anchors ignored)."""
  broken = []
  for target in links(page.read_text(encoding="utf-8")):
    if _EXTERNAL.match(target) or target.startswith("#"):
      continue
    path = target.split("#", 1)[0].split("?", 1)[0]
    resolved = (ROOT / path.lstrip("/")) if path.startswith("/") else (page.parent / path)
    resolved = resolved.resolve()
    if not resolved.is_relative_to(ROOT):
      broken.append(f"{target} (outside the repository)")
    elif not resolved.exists():
      broken.append(f"{target} (no such file or folder)")
  return broken


def paths_named_outside(page: pathlib.Path) -> list[str]:
  """Relative paths written in code spans of `page` (`../x/y.md`) that lead outside the repository."""
  outside = []
  for span in re.findall(r"`([^`\s]+)`", _FENCE.sub("", page.read_text(encoding="utf-8"))):
    if span.startswith("../") and not (page.parent / span).resolve().is_relative_to(ROOT):
      outside.append(span)
  return outside


def test_link_parser_finds_inline_reference_and_image_links_but_not_code():
  text = ("[a](x.md) ![b](img/p.png \"title\") [c](https://e.org) [d](#anchor)\n"
          "[ref]: ../outside.md\n`[e](in_span.md)`\n```\n[f](in_fence.md)\n```\n")
  assert links(text) == ["x.md", "img/p.png", "https://e.org", "#anchor", "../outside.md"]


def test_docs_hold_the_design_the_results_and_a_page_per_kernel():
  names = {p.relative_to(ROOT / "docs").as_posix() for p in DOCS}
  assert {"design.md", "results.md", *(f"kernels/{k}.md" for k in KERNEL_PAGES)} <= names


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_links_resolve_inside_the_repository(page):
  assert broken_links(page) == []


def test_readme_links_resolve_inside_the_repository():
  assert broken_links(ROOT / "README.md") == []


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_name_no_path_outside_the_repository(page):
  assert paths_named_outside(page) == []


def test_readme_names_no_path_outside_the_repository():
  assert paths_named_outside(ROOT / "README.md") == []
