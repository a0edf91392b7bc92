"""Griffe extension: read gpufeed's ``Example:`` docstring sections as Google ``Examples:`` sections.

Griffe's Google parser knows only the plural title; under the singular one the doctest lines would be
rendered as Markdown prose (``[6, 22]`` read as a link). The source keeps its house style, and the docs
render every example as code.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_SINGULAR = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExamplesSection(griffe.Extension):
    """Rename ``Example:`` section titles to ``Examples:`` in every loaded docstring."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and "Example:" in obj.docstring.value:
            obj.docstring.value = _SINGULAR.sub(r"\1Examples:", obj.docstring.value)
