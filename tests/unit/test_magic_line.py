"""A ``#`` on a magic's line starts a comment, as people write them and as the docs show (issue #34)."""

import re
from pathlib import Path

import pytest
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic_arguments import parse_argstring

from dtrain_magic.magic_line import strip_comment
from dtrain_magic.notebook import flags, session_magic

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("line", "kept"), [
    ("-n 4 --strategy fsdp          # or --zero 3, --tp 2", "-n 4 --strategy fsdp"),
    ("lr   # pickled once, bound on every rank", "lr"),
    ("# only a comment", ""),
    ("--experiment 'run #2' -n 2  # quoted # stays", "--experiment 'run #2' -n 2"),
    ('--experiment "a # b"', '--experiment "a # b"'),
    ("--experiment run#2 -n 2", "--experiment run#2 -n 2"),  # a # inside a word is not a comment (as in a shell)
    ("--backend ray\t# tab before it", "--backend ray"),
    ("", ""),
])
def test_a_comment_starts_at_a_hash_that_begins_a_word_outside_quotes(line, kept):
    assert strip_comment(line) == kept


def test_the_docs_comment_lines_parse_as_their_flags():
    args = flags.parse_line("-n 4 --strategy fsdp          # or --zero 3, --tp 2, --pp 2, --strategy fsdp --tp 2")
    assert (args.num_processes, args.strategy, args.zero, args.tp) == (4, "fsdp", None, 1)
    args = flags.parse_line("--experiment 'run #2' --backend spark -n 2   # local mode")
    assert (args.experiment, args.backend, args.num_processes) == ("run #2", "spark", 2)


# every magic line in a fenced block of README.md and docs/, with the parser its magic reads it with
PARSERS = {
    "%%distribute": lambda rest: flags.parse_line(rest),
    "%distribute_session": lambda rest: (flags.parse_line(rest.partition(" ")[2], holder=session_magic._session_parser,
                                                          rows=session_magic.ROWS)
                                         if rest.startswith("start") else rest.split()),
    "%%ranks": lambda rest: parse_argstring(session_magic._ranks_parser, rest),
    "%distribute_pull": lambda rest: parse_argstring(session_magic._pull_parser, rest),
    "%distribute_push": lambda rest: parse_argstring(session_magic._push_parser, rest),
}


def _magic_lines():
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        in_block = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.startswith("```"):
                in_block = not in_block
            elif in_block and re.match(r"%%?\w", line):
                name, _, rest = line.partition(" ")
                if name in PARSERS:
                    yield pytest.param(name, rest, id=f"{path.name}:{number}")


@pytest.mark.parametrize(("name", "rest"), list(_magic_lines()))
def test_every_magic_line_in_the_docs_parses(name, rest):
    """The docs annotate flags with comments (docs/big-models.md, docs/sessions.md, ...): each line parses."""
    parsed = PARSERS[name](strip_comment(rest))
    if name == "%distribute_push":
        assert all(n.isidentifier() for n in parsed.names), parsed.names


def test_every_magic_strips_its_comment_before_reading_its_line():
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext dtrain_magic", store_history=False)
    result = shell.run_cell("%distribute_release   # give the waiting workers back", store_history=False)
    assert result.error_in_exec is None  # a comment is no argument: "takes no arguments" is not raised
    with pytest.raises(UsageError, match="takes no arguments"):
        shell.run_line_magic("distribute_release", "now")
    assert shell.run_cell("%distribute_session status   # is one open?", store_history=False).error_in_exec is None
    result = shell.run_cell("%%distribute --dry-run --cpu -n 2 --backend local   # two processes\n"
                            "def train(ctx):\n    return 1\n", store_history=False)
    assert result.error_in_exec is None, result.error_in_exec
    for kind, names in shell.magics_manager.magics.items():
        for name, bound in names.items():
            if name.startswith("distribute") or name == "ranks":
                assert getattr(bound, "__wrapped__", None) is not None, f"{kind} magic {name} reads its line raw"
