"""Self-contained HTML pages with matplotlib plots: the one skeleton of `h5feed report` and `h5feed bench --html`.

Why: a page someone can copy, attach to an issue or open offline must carry its plots, so each
PNG is embedded as base64 and nothing is fetched.  Both pages are built here from a title and
sections, so they escape text the same way (control characters taken out too), look the same, and
tell a headless browser (the tests) whether their images decoded.  matplotlib is an optional extra
(`h5feed[report]`): it is imported here only, and its absence is one clear error.
"""

from __future__ import annotations

import base64
import html
import io
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

from h5feed.errors import H5feedError
from h5feed.text import printable

if TYPE_CHECKING:  # matplotlib is optional (h5feed[report])
    from matplotlib.figure import Figure

DPI = 90  # the plots' pixels per inch: an 11-inch wide figure is 990 px, the page's width


@dataclass(frozen=True)
class Section:
    """A part of the page: an optional heading over HTML built with the helpers below.  `level` 3 and 4 head
    the parts of a part (a page of several runs, each of several attempts); `anchor` is the heading's id, for
    a `links` list to point at."""

    heading: str | None
    body: str
    level: int = 2
    anchor: str | None = None


def _escape(text: str) -> str:
    """Text as the page shows it: printable (no control characters: a page's text may be copied into a
    terminal; line breaks kept, a page shows them as spaces) and HTML-escaped."""
    return html.escape(printable(text, lines=True))


def pyplot(what: str) -> ModuleType:
    """matplotlib's pyplot, drawing off-screen (Agg: no display needed on a training node).

    Raises H5feedError naming `what` (the command that draws) and the extra to install when matplotlib
    is missing; a command that draws only after long work calls this first, so it fails before it starts.
    """
    try:
        import matplotlib
    except ImportError:
        raise H5feedError(f"{what} draws its plots with matplotlib: pip install 'h5feed[report]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure_png(fig: Figure) -> bytes:
    """A matplotlib figure as PNG bytes at the pages' DPI; the figure is closed (pyplot keeps open ones alive)."""
    import matplotlib.pyplot as plt

    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=DPI)
    plt.close(fig)
    return out.getvalue()


def image(png: bytes, element_id: str, alt: str) -> str:
    """An `<img>` carrying `png` inline (a data: URL), so the page is one file."""
    return (f'<img id="{_escape(element_id)}" alt="{_escape(alt)}"\n'
            f'     src="data:image/png;base64,{base64.b64encode(png).decode()}">')


def bullets(lines: Iterable[str], element_id: str) -> str:
    """A `<ul>` of plain-text lines, escaped."""
    items = "".join(f"<li>{_escape(line)}</li>" for line in lines)
    return f'<ul id="{_escape(element_id)}">{items}</ul>'


def links(items: Iterable[tuple[str, str]], element_id: str) -> str:
    """A `<ul>` of (text, anchor) links to sections of the same page (a page of several parts starts with it)."""
    entries = "".join(f'<li><a href="#{_escape(anchor)}">{_escape(text)}</a></li>' for text, anchor in items)
    return f'<ul id="{_escape(element_id)}">{entries}</ul>'


def preformatted(text: str, element_id: str) -> str:
    """Plain text whose line breaks and spacing matter (code to copy), escaped."""
    return f'<pre id="{_escape(element_id)}">{_escape(text)}</pre>'


def table(rows: Sequence[Sequence[str]], element_id: str, text_columns: Iterable[int] = ()) -> str:
    """A `<table>` of plain-text cells, the first row the header.  Cells align right (figures), but those
    of `text_columns` (names, verdicts) align left."""
    left = set(text_columns)

    def row(cells: Sequence[str], tag: str) -> str:
        opened = [f'<{tag} class="text">' if i in left else f"<{tag}>" for i in range(len(cells))]
        return "<tr>" + "".join(f"{o}{_escape(c)}</{tag}>" for o, c in zip(opened, cells)) + "</tr>"

    header, *body = rows
    return f'<table id="{_escape(element_id)}">{row(header, "th")}{"".join(row(r, "td") for r in body)}</table>'


def page_html(title: str, sections: Sequence[Section]) -> str:
    """The whole page: `title` as its title and `<h1>`, then each section.

    Once loaded, the body's `data-plot-width` holds each image's decoded width in pixels, space-separated
    (0 for one that did not decode), which a headless browser can read back without looking at pixels.
    """
    body = "\n".join(_heading(s) + s.body for s in sections)
    title = _escape(title)
    return textwrap.dedent("""\
        <!doctype html>
        <html><head><meta charset="utf-8"><title>{title}</title>
        <style>body{{font-family:sans-serif;margin:2em;max-width:1100px}}td,th{{padding:2px 10px;text-align:right}}
        td{{white-space:nowrap}}.text{{text-align:left;white-space:normal}}pre{{white-space:pre-wrap}}
        h2[id]{{border-top:3px solid #888;padding-top:0.6em;margin-top:2em}}
        </style></head>
        <body>
        <h1>{title}</h1>
        {body}
        <script>
        window.addEventListener("load", () => {{
          const widths = Array.from(document.images, (img) => img.naturalWidth);  // 0 if it did not decode
          document.body.dataset.plotWidth = widths.join(" ");
        }});
        </script>
        </body></html>
        """).format(title=title, body=body)


def _heading(section: Section) -> str:
    if section.heading is None:
        return ""
    anchor = f' id="{_escape(section.anchor)}"' if section.anchor is not None else ""
    return f"<h{section.level}{anchor}>{_escape(section.heading)}</h{section.level}>\n"
