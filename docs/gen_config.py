"""Write docs/configuration.md's reference table from kvgate's config table (kvgate.config.FIELDS): every key, once.

    python docs/gen_config.py [--check]

``make docs`` runs it before the site is built; ``--check`` exits 1 when the
committed page is not what the table gives (a key added without its page).

The page has two parts: the generated head and reference table, then, from the heading ``TAIL_HEADING``
on, text written by hand (what each key means at length), which this script keeps as it finds it: edit that
part in the page itself, never the generated part.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvgate.config import FIELDS, default_text

PAGE = Path(__file__).with_name("configuration.md")
TAIL_HEADING = "## Every key, explained\n"
HEAD = """# Configuration reference

Every key of the gateway's config, generated from its config table (`kvgate.config`), so it is never out of
date. A key is set in the YAML file given to `kvgate serve --config FILE`, or as the flag beside it, which
wins over the file. Sizes take units (`16G`, `256K`: binary; `16GB`: decimal), durations `500ms`, `10s`,
`2h`. A bad value is refused at start with an error naming the key.

| key | flag | default | what it is |
| --- | --- | --- | --- |
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def page() -> str:
    rows = []
    for f in FIELDS:
        shown = default_text(f)
        default = f"`{shown}`" if shown is not None else "unset" if f.optional else "(derived)"
        what = f.help + (f"; one of {', '.join(f'`{c}`' for c in f.choices)}" if f.choices else "")
        rows.append(f"| `{f.name}` | `--{f.name.replace('_', '-')}` | {default} | {_cell(what)} |")
    return HEAD + "\n".join(rows) + "\n" + _hand_written()


def _hand_written() -> str:
    """The page's part from ``TAIL_HEADING`` on, as it stands (empty when the page or the heading is missing)."""
    text = PAGE.read_text() if PAGE.exists() else ""
    at = text.find("\n" + TAIL_HEADING)
    return text[at:] if at >= 0 else ""


def main() -> int:
    text = page()
    if "--check" in sys.argv[1:]:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is not what the config table gives: run python docs/gen_config.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
