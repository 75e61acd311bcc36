"""MkDocs hooks (`mkdocs.yml`): pages whose text lives elsewhere, put in at build time so nothing is written twice.

- `index.md` is README.md, the front door of the checkout, with its `docs/` links made site-relative;
- `benchmarks.md` is BENCHMARKS.md (kept at the root, where the tools that measure say to record), likewise;
- `tools.md` holds each `tools/FOLDER/README.md` where `<!-- tools/FOLDER/README.md -->` stands, its title a
  level-3 heading;
- `configuration.md`'s reference is generated from the typed schema (`jaxllm.schema.reference_markdown`), its
  `see "Pipeline parallelism"` made links to the page whose heading begins so.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def site_relative(markdown: str) -> str:
    """Links written from the checkout's root (`docs/x.md`, `BENCHMARKS.md`) or from a folder under it
    (`../../docs/x.md`) as links from inside docs/."""
    markdown = re.sub(r"\]\((?:\.\./)*docs/", "](", markdown)
    return re.sub(r"\]\((?:\.\./)?(README|BENCHMARKS)\.md", lambda m: f"]({'index' if m.group(1) == 'README' else 'benchmarks'}.md", markdown)


def included(name: str) -> str:
    return site_relative((ROOT / name).read_text())


def headings() -> dict[str, str]:
    """Each user page's headings (outside code blocks) -> the page (the design notes are not where a key is explained)."""
    found = {}
    for page in sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "design-notes.md"):
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
        found.update({h: page.name for h in re.findall(r"^#{1,3} (.+)$", text, flags=re.M)})
    return found


def linked(markdown: str) -> str:
    """`see "Title"` as a link to the page with a heading that begins with Title (left as it is if none does)."""
    pages = headings()

    def link(m):
        page = next((p for h, p in pages.items() if h.startswith(m.group(1))), None)
        return f"see [{m.group(1)}]({page})" if page else m.group(0)

    return re.sub(r'see "([^"]+)"', link, markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:
    from jaxllm.schema import reference_markdown

    inserts = {"<!-- README.md -->": lambda: included("README.md"),
               "<!-- BENCHMARKS.md -->": lambda: included("BENCHMARKS.md"),
               "<!-- config-reference -->": lambda: linked(reference_markdown())}
    for marker, text in inserts.items():
        if marker in markdown:
            markdown = markdown.replace(marker, text())
    return re.sub(r"<!-- (tools/\w+/README\.md) -->", lambda m: re.sub(r"^# ", "### ", included(m.group(1))), markdown)
