"""A griffe extension for the documentation build: dpvr's docstrings cross-reference with Sphinx roles.

The docstrings are written for reading in the source and in ``help()``: reST roles such as
``:func:`~dpvr.tuning.tune``` and ``:class:`PrivacyConfig``` name other objects. MkDocs renders docstrings as
Markdown, where a role would show as literal text, so this extension rewrites each role, before rendering,
into an *optional* autorefs cross-reference: a link where the target is documented on the site, plain code
where it is not (a private helper, a module not on the site), and never a warning. ``mkdocs build --strict``
therefore keeps failing on every real problem (a broken page link, a missing object in a ``:::``
directive, a docstring section griffe cannot parse) without failing on a reference to an undocumented name.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(
    r":(?:py:)?(?:func|class|mod|meth|attr|data|obj|exc|const):`(~?)([^`<>]+?)(?:\s*<([^>`]+)>)?`"
)


def _rewrite(text: str, scope: str) -> str:
    def replace(match: re.Match[str]) -> str:
        tilde, title, explicit = match.group(1), match.group(2).strip(), match.group(3)
        target = (explicit or title).strip().rstrip("()")
        if explicit is None and tilde:
            title = target.rsplit(".", 1)[-1]
        if not target.startswith("dpvr.") and scope:
            target = f"{scope}.{target}"  # a name relative to the docstring's module, as Sphinx reads it
        return f'<autoref identifier="{target}" optional><code>{title}</code></autoref>'

    return _ROLE.sub(replace, text)


_SHARED = re.compile(r"^(\s+)(\w+(?:, \w+)+): (.*)$")


def _split_shared(text: str) -> str:
    """``x0, y0: what both are`` in an ``Args:`` section (one entry for two parameters, which the Google
    style has no syntax for) becomes one entry per parameter, each with the whole description."""
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        match = _SHARED.match(lines[i])
        if match is None:
            out.append(lines[i])
            i += 1
            continue
        indent, names, first = match.groups()
        j = i + 1
        while j < len(lines) and lines[j].strip() and len(lines[j]) - len(lines[j].lstrip()) > len(indent):
            j += 1
        for name in names.split(", "):
            out.extend([f"{indent}{name}: {first}", *lines[i + 1 : j]])
        i = j
    return "\n".join(out)


class SphinxRoles(griffe.Extension):
    """Rewrites reST cross-reference roles in every docstring into optional autorefs, and splits Google-style
    entries that document several parameters at once."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            module = obj if obj.is_module else obj.module
            obj.docstring.value = _split_shared(_rewrite(obj.docstring.value, module.path))
