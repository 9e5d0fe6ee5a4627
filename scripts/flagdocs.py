"""The docs written from the flag table: ``docs/flags.md`` and README's short table.

``python scripts/flagdocs.py --write-docs`` regenerates them; ``--check`` says whether they are current
(``tests/unit/test_flagtable.py`` fails when they are not). A tool of the repository, not of the package: nothing
in dtrain_magic imports it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from dtrain_magic.flagtable import ALWAYS, APPEND, FLAGS, NEVER, SWITCH, VALUE, Flag

DOCS_COMMAND = "python scripts/flagdocs.py --write-docs"
DOCS_PAGE = Path("docs") / "flags.md"
README = Path("README.md")
README_BEGIN = "<!-- BEGIN generated: flags -->"
README_END = "<!-- END generated: flags -->"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def doc_flag(row: Flag) -> str:
    """How the docs write a flag (markdown): ```--zero {0,1,2,3}```, ```-n, --num-processes, --num-workers N```,
    ```--gpu` / `--cpu```."""
    if row.kind == SWITCH:
        return " / ".join(f"`{', '.join(opts)}`" for opts in (row.options, row.off_options))
    text = ", ".join(row.options)
    if row.kind in (VALUE, APPEND):
        if row.choices is not None:
            text += " {" + ",".join(str(c) for c in row.choices) + "}"
        else:
            text += " " + (row.placeholder or (row.field or row.name.lstrip("-")).upper())
    return f"`{text}`"


def doc_default(row: Flag) -> str:
    """The default as the docs say it (markdown)."""
    if row.default_doc is not None:
        return row.default_doc
    if row.default is None:
        return "none"
    if isinstance(row.default, bool):
        return "on" if row.default else "off"
    if isinstance(row.default, str):
        return f"`{row.default}`"
    return str(row.default)


def markdown_table(rows: tuple[Flag, ...] = FLAGS, details: bool = False) -> str:
    """The flags as a markdown table: flag, default, meaning (and with ``details``, the RunConfig field and
    the panel control)."""
    head = ["flag", "default", "meaning"] + (["`RunConfig` field", "panel"] if details else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [doc_flag(row), doc_default(row), row.doc or row.help]
        if details:
            cells.append(f"`{row.field}`" if row.field else "none: the magic acts on it")
            cells.append(row.panel.label if row.panel else "")
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def groups() -> list[tuple[str, tuple[Flag, ...]]]:
    """(group, rows) in table order."""
    found: dict[str, list[Flag]] = {}
    for row in FLAGS:
        found.setdefault(row.group, []).append(row)
    return [(group, tuple(rows)) for group, rows in found.items()]


def docs_page() -> str:
    """The text of docs/flags.md."""
    def names(line: str) -> str:
        return ", ".join(f"`{' / '.join(row.options[:1] + row.off_options[:1])}`" for row in FLAGS if row.line == line)

    parts = [
        "# `%%distribute` flags",
        "",
        f"<!-- Generated from dtrain_magic/flagtable.py by `{DOCS_COMMAND}`: edit the table there. -->",
        "",
        "Every flag of the `%%distribute` cell magic, by help group; `%%distribute?` prints the same list in a "
        "notebook. Each flag sets one field of the validated `RunConfig` (`dtrain_magic/config.py`); the panel "
        "column names the control of the `--configure` panel that sets it.",
        "",
        "The *equivalent line* (in the `--dry-run` plan and the panel, and what the panel's \"Write cell\" "
        f"writes) always has {names(ALWAYS)}, so that it pins what the machine-dependent defaults resolved "
        f"to; any other flag only when its value is not the default; never {names(NEVER)}. Values with spaces "
        "or quotes, or starting with `-`, are quoted.",
        "",
        "`dtrain_magic.run(fn, ...)` and `dtrain_magic.Session(...)` take each flag by any of its long names as a "
        "keyword, dashes as underscores (`num_workers=4`, `hang_timeout=30`), an on/off pair's off name with "
        "`True` (`cpu=True` is `--cpu`, `cluster=True`, `no_ui=True`); `stall_timeout=None` (or `0`) is "
        "`--stall-timeout off`. A keyword that is neither an option nor a parameter of the function is an error "
        "naming it and the closest option.",
    ]
    for group, rows in groups():
        parts += ["", f"## {group}", "", markdown_table(rows, details=True)]
    return "\n".join(parts) + "\n"


def readme_block() -> str:
    """README's short flag table (the rows marked ``cheatsheet``), markers included."""
    rows = tuple(row for row in FLAGS if row.cheatsheet)
    more = (f"The other {len(FLAGS) - len(rows)} flags (model parallelism, data, tracking, Spark, Ray, DeepSpeed, "
            "the cell): "
            "[docs/flags.md](docs/flags.md).")
    return "\n".join([README_BEGIN, f"<!-- {DOCS_COMMAND} writes this table from dtrain_magic/flagtable.py -->",
                      markdown_table(rows), "", more, README_END])


def _with_readme_block(text: str) -> str:
    pattern = re.compile(re.escape(README_BEGIN) + r".*?" + re.escape(README_END), re.S)
    if not pattern.search(text):
        raise ValueError(f"README.md has no {README_BEGIN} ... {README_END} block for the flag table")
    return pattern.sub(lambda _: readme_block(), text, count=1)


def expected_docs(root: Path) -> dict[Path, str]:
    """Each generated file under ``root`` (the repository) and the text it should have."""
    readme = (root / README).read_text(encoding="utf-8")
    return {root / DOCS_PAGE: docs_page(), root / README: _with_readme_block(readme)}


def stale_docs(root: Path) -> list[Path]:
    """The generated files under ``root`` that are not current."""
    return [path for path, text in expected_docs(root).items()
            if not path.exists() or path.read_text(encoding="utf-8") != text]


def write_docs(root: Path) -> list[Path]:
    """Regenerate docs/flags.md and README's flag table under ``root``; the files that changed."""
    changed = stale_docs(root)
    for path, text in expected_docs(root).items():
        if path in changed:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    return changed


def main(argv: list[str] | None = None) -> int:
    """``python scripts/flagdocs.py --write-docs | --check [--root REPO]``; the exit status."""
    parser = argparse.ArgumentParser(prog="python scripts/flagdocs.py",
                                     description="Write or check the docs generated from dtrain_magic/flagtable.py.")
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write-docs", action="store_true", help="regenerate docs/flags.md and README's flag table")
    action.add_argument("--check", action="store_true", help="exit 1 when either is not current")
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the repository (default: the one this script is in)")
    args = parser.parse_args(argv)
    if not (args.root / README).exists():
        parser.error(f"{args.root} has no README.md: give the repository with --root")
    if args.check:
        stale = stale_docs(args.root)
        for path in stale:
            print(f"not current: {path}; run `{DOCS_COMMAND}`")
        return 1 if stale else 0
    for path in write_docs(args.root):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
