"""MkDocs hook: the site's landing page is README.md, so the two cannot disagree.

docs/index.md holds only a marker; at build time this hook replaces the page's Markdown with the README's,
its links rewritten from the repository's root to the docs directory (``docs/guide.md`` -> ``guide.md``,
``docs/figures/x.png`` -> ``figures/x.png``). tests/project/test_docs_reference.py checks the same rewrite.
"""

from __future__ import annotations

import pathlib
import re

MARKER = "<!-- the landing page is README.md -->"
_LINK = re.compile(r"\]\(docs/")


def landing_page(readme: str) -> str:
    """The README's Markdown with its links made relative to docs/."""
    return _LINK.sub("](", readme)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ANN001 (MkDocs' signature)
    if MARKER not in markdown:
        return markdown
    root = pathlib.Path(config["config_file_path"]).parent
    return landing_page((root / "README.md").read_text())
