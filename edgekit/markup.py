"""Text from models and files made safe for the formats edgekit writes.

Node names, model names, input names, target names, warnings and folder paths come from
files anyone may have written (``<img src=x onerror=...>`` as an ONNX node name). Every
report writer passes such text through the escape of its format, so it shows as the
text it is and never as markup:

* ``md(text)``: Markdown prose and table cells: HTML tags and entities, the characters
  that make emphasis, links, images, code spans and table columns (``|``), and line
  breaks (a table row is one line) are neutralised; ``md_code(text)`` a code block that
  ``text`` cannot close;
* ``xml_text(text)`` / ``xml_attr(text)``: XML character data and a quoted attribute
  (JUnit), with the characters XML 1.0 cannot hold at all replaced;
* ``html`` is ``html.escape`` (the HTML reports).

>>> md("<b>conv|1</b>")
'&lt;b&gt;conv\\\\|1&lt;/b&gt;'
"""
from __future__ import annotations

import re
from html import escape as html
from xml.sax.saxutils import escape as _xml_escape
from xml.sax.saxutils import quoteattr as _xml_quoteattr

__all__ = ["html", "md", "md_code", "xml_attr", "xml_text"]

# Markdown's inline punctuation (code spans, emphasis, links and images, strikethrough, table
# columns); an underscore inside a word is no emphasis and stays as it is (``down_proj``).
_MD_SPECIAL = re.compile(r"([\\`*\[\]|~])|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
# XML 1.0 allows tab, newline, carriage return and everything from U+0020 up (but the surrogates
# and U+FFFE/U+FFFF); a JUnit file with any other character does not parse.
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def md(text: object) -> str:
    """``text`` as literal Markdown (prose or a table cell): ``&``, ``<``, ``>`` as entities,
    Markdown's inline punctuation backslash-escaped, line breaks as spaces."""
    s = " ".join(str(text).splitlines()) if text is not None else ""
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MD_SPECIAL.sub(lambda m: "\\" + m[0], s)


def md_code(text: str, lang: str = "") -> list[str]:
    """``text`` as a fenced Markdown code block (its lines): the fence is longer than any
    run of backticks inside, so nothing in ``text`` can end the block early."""
    runs = [len(r) for r in re.findall(r"`+", text)]
    fence = "`" * max(3, max(runs, default=0) + 1)
    return [fence + lang, *text.splitlines(), fence]


def xml_text(text: object) -> str:
    """``text`` as XML character data."""
    return _xml_escape(_XML_INVALID.sub("\ufffd", str(text)))


def xml_attr(text: object) -> str:
    """``text`` as a quoted XML attribute value (quotes included)."""
    return _xml_quoteattr(_XML_INVALID.sub("\ufffd", str(text)))
