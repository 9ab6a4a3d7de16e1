"""Text that came from outside (a run's log, a lock file, a store's attributes) made safe to show.

Why: whoever can write to a shared run folder or a bucket chooses the strings h5feed prints.  A terminal
obeys the control sequences in them (retitle the window, clear the screen, write the clipboard with OSC 52,
hide or rewrite lines), so each string is shown with its escape sequences and control characters taken
out and everything printable, any script, kept.  HTML escaping alone does not do this: a page's text
copied into a terminal carries the same bytes.
"""

from __future__ import annotations

import re

# An escape sequence, 7-bit (ESC ...) or 8-bit (C1), with what follows its introducer up to where a
# terminal ends it: CSI parameters and final byte; OSC, DCS, SOS, PM and APC strings up to BEL or ST
# (or the end of the text, unterminated); any other ESC and its next character.
_ESCAPE = re.compile(
    r"(?:\x1b\[|\x9b)[\x30-\x3f]*[\x20-\x2f]*[\x40-\x7e]?"
    r"|(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
    r"|\x1b[\x20-\x2f]*[\x30-\x7e]?"
)
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # what is left: C0 (newlines too), DEL, C1
_SURROGATE = re.compile(r"[\ud800-\udfff]")  # half of a UTF-16 pair, which no output encoding can write


def printable(text: str, *, lines: bool = False) -> str:
    """`text` without escape sequences or control characters, a lone surrogate shown as U+FFFD;
    `lines`: keep its line breaks (a multi-line message), else they go too (one field)."""
    if text.isprintable():  # the common case, in one C-speed pass
        return text
    if lines:
        return "\n".join(printable(line) for line in text.split("\n"))
    return _CONTROL.sub("", _ESCAPE.sub("", _SURROGATE.sub("\ufffd", text)))
