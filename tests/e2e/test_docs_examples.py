"""Every notebook-cell example in README.md and docs/ runs as written, through a real Jupyter kernel, and what the
docs show it printing is what it prints (issue #34).

Each ```python block of a page is a cell, run in order in one fresh kernel per page (as a user pastes a page's
examples into a new notebook), after the page's prelude: what this machine lacks and a user's notebook has (a
Databricks ``spark`` session and its tables, a data path). Every change an example needs to run here is declared in
`SUBSTITUTIONS` and `PRELUDES` below, and nowhere else. A block the suite cannot run says so in the page, in an HTML
comment on the line above it: ``<!-- docs-test: skip: the reason -->`` (a fragment with ``...``, GPUs, a real
cluster, a side-by-side comparison that is not a cell).

Every page's kernel loads the extension first (`LOAD_EXTENSION`, the README's first cell). A plain ``` block right
under a cell (or under a ``<!-- docs-test: output -->`` comment) is what that cell printed:
each of its lines must appear among the cell's output lines, in order, with what varies between runs masked (numbers
other than ranks, run ids, ``In[N]``). Progress lines (``step N (...)``) depend on timing and are not checked. A cell
whose shown output starts with an error (``RankError: ...``) must raise it; any other error fails the page.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from kernels import Kernel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]

# What this machine forces, per page: (as written, as run). {tmp} is the page's working directory.
SUBSTITUTIONS: dict[str, list[tuple[str, str]]] = {
    "docs/data.md": [("-n 4", "-n 2"),  # 2 cores
                     ("/dbfs/data/val", "{tmp}/val")],  # a Databricks path: a Parquet directory made by the prelude
    "docs/big-models.md": [("-n 4", "-n 2"),
                           ("/models/my-llama", "{tmp}/my-llama")],  # a small Llama the prelude saves (no download)
}
# Run first in the page's kernel, unseen by the examples' checks.
SPARK = ("from pyspark.sql import SparkSession\n"
         "spark = SparkSession.builder.master('local[2]').config('spark.ui.enabled', 'false').getOrCreate()\n")
PRELUDES: dict[str, str] = {
    "docs/big-models.md": (
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,"
        " num_key_value_heads=4, vocab_size=128)).save_pretrained('my-llama')\n"),
    # Databricks gives the notebook `spark` and the workspace's tables: a local session and an `events` table.
    "docs/data.md": SPARK + (
        "import numpy as np, pandas as pd\n"
        "rng = np.random.default_rng(0)\n"
        "features = rng.normal(size=(512, 16)).astype('float32')\n"
        "events = pd.DataFrame({'features': list(features), 'label': features @ np.arange(16, dtype='float32')})\n"
        "spark.createDataFrame(events).createOrReplaceTempView('events')\n"
        "import os\nos.makedirs('val')\nevents.iloc[:128].to_parquet('val/part-0.parquet')\n"),
}

# Every page's kernel first loads the extension, as the README's first cell does (the pages take it as done).
LOAD_EXTENSION = "%load_ext dtrain_magic\n"

SKIP = re.compile(r"^<!-- docs-test: skip: (?P<why>.+) -->$")
OUTPUT = "<!-- docs-test: output -->"


@dataclass
class Example:
    """One ```python block of a page: its first line's number, its code, why it is not run, what it shows."""

    page: str
    line: int
    code: str
    skip: str | None = None
    shown: str | None = None  # the output the page shows for it


def examples(page: str) -> list[Example]:
    """The page's ```python blocks, with their skip marks and shown outputs."""
    lines = (ROOT / page).read_text().splitlines()
    found: list[Example] = []
    i, last_end = 0, -10
    while i < len(lines):
        if not lines[i].startswith("```"):
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        language, body = lines[i][3:].strip(), "\n".join(lines[i + 1:end])
        above = lines[i - 1].strip() if i else ""
        if language == "python":
            mark = SKIP.match(above)
            found.append(Example(page, i + 1, body, skip=mark.group("why") if mark else None))
        elif language == "" and found and found[-1].shown is None and (i == last_end + 1 or above == OUTPUT):
            found[-1].shown = body
        last_end = end
        i = end + 1
    return found


_NUMBER = re.compile(r"(?<!rank )(?<![\w.])-?\d+(?:[.,]\d+)*(?:e[-+]?\d+)?")


def masked(line: str) -> str:
    """A line with what varies between runs masked: ANSI colours, run ids, numbers (but rank numbers)."""
    line = re.sub(r"\x1b\[[0-9;]*m", "", line)
    line = re.sub(r"\b[0-9a-f]{32}\b", "<id>", line)
    return _NUMBER.sub("N", line).rstrip()


def output_lines(stream: str, result: str | None, error: tuple[str, str] | None) -> list[str]:
    """What a cell showed, as the docs write it: its printed lines, then ``Out[N]: value``, or ``Error: message``."""
    lines = stream.splitlines()
    if result is not None:
        lines += [f"Out[N]: {result}"] if "\n" not in result else ["Out[N]:", *result.splitlines()]
    if error is not None:
        lines += f"{error[0]}: {error[1]}".splitlines()
    return lines


_RANK_LINE = re.compile(r"^\[rank (\d+)\] ")


def missing_lines(shown: str, actual: list[str]) -> list[str]:
    """The shown lines not found, in order, among the actual ones (masked; progress lines left out). Consecutive
    lines of several ranks (``[rank 0] ...``, ``[rank 1] ...``) are printed live by separate processes, so they may
    interleave either way: each rank's lines must come in order, the block after what came before it."""
    wanted = [masked(line) for line in shown.splitlines() if line.strip() and not line.startswith("step ")]
    have = [masked(line) for line in actual]
    missing, at = [], 0
    for block in _rank_blocks(wanted):
        used, after = set(), {}  # rank (or None) -> the index its last line was found at
        for line in block:
            rank = _RANK_LINE.match(line)
            key = rank.group(1) if rank else None
            start = max(at, after.get(key, at - 1) + 1)
            found = next((k for k in range(start, len(have)) if k not in used and have[k] == line), None)
            if found is None:
                missing.append(line)
            else:
                used.add(found)
                after[key] = found
        at = max(used, default=at - 1) + 1
    return missing


def _rank_blocks(lines: list[str]) -> list[list[str]]:
    """``lines`` in blocks: each run of consecutive rank lines one block, every other line a block of its own."""
    blocks: list[list[str]] = []
    for line in lines:
        if _RANK_LINE.match(line) and blocks and _RANK_LINE.match(blocks[-1][-1]):
            blocks[-1].append(line)
        else:
            blocks.append([line])
    return blocks


def usage_error(text: str) -> tuple[str, str] | None:
    """A magic's usage error: IPython prints it as text (no error message), yet the cell did not run."""
    found = re.search(r"^UsageError: (.*)$", text, re.MULTILINE)
    return ("UsageError", found.group(1)) if found else None


def shows_an_error(shown: str | None) -> bool:
    return bool(shown) and re.match(r"^\w+(Error|Exception|Interrupted|Hung|Timeout)\b", shown) is not None


def substituted(page: str, code: str, tmp: Path) -> str:
    for written, run in SUBSTITUTIONS.get(page, []):
        code = code.replace(written, run.format(tmp=tmp))
    return code


def test_the_marks_and_substitutions_are_where_they_say():
    """Each substitution changes an example of its page; each skip gives a reason; each page's example count is
    what runs (a block that is neither run nor marked cannot hide)."""
    for page, pairs in SUBSTITUTIONS.items():
        text = "\n".join(e.code for e in examples(page) if e.skip is None)
        for written, _ in pairs:
            assert written in text, f"{page}: the substitution of {written!r} matches no example any more"
    for page in PAGES:
        for example in examples(page):
            assert example.skip is None or len(example.skip) > 10, f"{page}:{example.line}: say why it is skipped"
    assert missing_lines("[rank 0] loss 0.0029\nstep 1 (0.4 steps/s)\nOut[3]: 2", ["[rank 0] loss 0.0031", "x",
                                                                                  "Out[N]: 7"]) == []
    assert missing_lines("[rank 1] loss 0.0029", ["[rank 0] loss 0.0029"]) == ["[rank 1] loss N"]
    # ranks print live: their lines may interleave either way, each rank's own in order, the block in its place
    assert missing_lines("[rank 0] a 1\n[rank 1] a 1\nOut[3]: 2", ["[rank 1] a 1", "[rank 0] a 1", "Out[N]: 2"]) == []
    assert missing_lines("[rank 0] a\n[rank 0] b", ["[rank 0] b", "[rank 0] a"]) == ["[rank 0] b"]
    assert missing_lines("Out[3]: 2\n[rank 0] a", ["[rank 0] a", "Out[N]: 2"]) == ["[rank 0] a"]


RUNNABLE = [page for page in PAGES if any(e.skip is None for e in examples(page))]


@pytest.mark.parametrize("page", RUNNABLE)
def test_a_pages_examples_run_as_written_and_print_what_it_shows(page, tmp_path):
    from leftovers import kill_tagged, new_tag, wait_until_none_left

    tag = new_tag()
    kernel = Kernel(tag, str(tmp_path), MLFLOW_TRACKING_URI=f"sqlite:///{tmp_path / 'mlflow.db'}")
    problems: list[str] = []
    try:
        prelude = kernel.run(LOAD_EXTENSION + PRELUDES.get(page, ""), timeout=300)
        assert prelude.error is None, f"{page}: the prelude failed: {prelude.error}\n{prelude.traceback}"
        for example in examples(page):
            if example.skip is not None:
                continue
            cell = kernel.run(substituted(page, example.code, tmp_path), timeout=600)
            where = f"{page}:{example.line}"
            error = cell.error or usage_error(cell.text)
            actual = output_lines(cell.text, cell.result, cell.error)
            if error is not None and not shows_an_error(example.shown):
                problems.append(f"{where} raised {error[0]}: {error[1]}\n{cell.text[-2000:]}")
            elif shows_an_error(example.shown) and error is None:
                problems.append(f"{where}: the page shows an error, the cell raised none")
            if example.shown is not None:
                missing = missing_lines(example.shown, actual)
                if missing:
                    problems.append(f"{where}: shown but not printed (masked):\n  " + "\n  ".join(missing)
                                    + "\nprinted:\n  " + "\n  ".join(actual[-40:]))
    finally:
        kernel.shutdown()
    left = wait_until_none_left(tag, 30)
    if left:
        kill_tagged(tag)
    assert not problems, "\n\n".join(problems)
    assert left == [], f"processes outlived the page's kernel: {left}"
