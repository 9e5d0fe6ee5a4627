import io

from dtrain_magic.config import RunConfig
from dtrain_magic.observer import TextObserver, prefix_lines, progress_line


def test_prefix_lines_keeps_partial_lines_pending():
    out, pending = prefix_lines(1, "a\nb")
    assert out == "[rank 1] a\n" and pending == "b"
    out, pending = prefix_lines(1, "c\n", pending)
    assert out == "[rank 1] bc\n" and pending == ""


def test_interleaved_ranks_never_share_a_line():
    stdout = io.StringIO()
    obs = TextObserver(out=stdout, err=stdout)
    obs.started(RunConfig(), "rid", "link", "plan")
    obs.output(0, "stdout", "hel")
    obs.output(1, "stdout", "wor")
    obs.output(0, "stdout", "lo\n")
    obs.output(1, "stdout", "ld\n")
    lines = stdout.getvalue().splitlines()[1:]
    assert lines == ["[rank 0] hello", "[rank 1] world"]


def test_progress_line_with_total_has_eta():
    line = progress_line(50, 100, 10.0, {"loss": 0.5})
    assert line == "step 50/100 (5.0 steps/s, ETA 10.0 s) loss=0.5"
