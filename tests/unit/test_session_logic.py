"""Interactive sessions, the pure parts: a rank's command loop (over a real pipe, in this process), values by rank,
the protocol, which flags apply, rank lists, the errors a cell's answers make, the magic's help, the panel's Start
session. The real thing (three backends, a kernel, a browser): tests/integration/test_sessions*.py, tests/e2e."""

from __future__ import annotations

import os
import queue
import threading
import time
from multiprocessing import Pipe
from types import SimpleNamespace

import pytest

from dtrain_magic import channel as ch
from dtrain_magic.config import RunConfig
from dtrain_magic.errors import CellInterrupted, CellTimeout, ConfigError, RankError, SessionError
from dtrain_magic.session import options, values
from dtrain_magic.session.protocol import (
    FAILED,
    INTERRUPTED,
    OK,
    CellDone,
    InterruptCell,
    PullValue,
    PushValues,
    RunCell,
    SessionReady,
    StopSession,
)
from dtrain_magic.session.report import raise_for as _raise_for
from dtrain_magic.session.worker import RankSession
from dtrain_magic.state import kernel_state


class Rank:
    """A `RankSession` on a pipe, served on a thread of this process (or the main thread: `serve_here`)."""

    def __init__(self, rank: int = 0):
        self.ours, theirs = Pipe()
        self.sent: "queue.Queue[ch.Message]" = queue.Queue()
        ctx = SimpleNamespace(rank=rank, flush_metrics=lambda: None, begin_outputs=lambda folder: None,
                              seal_outputs=lambda why: "", abort_outputs=lambda why: None)  # a cell's ctx.write ends
        self.session = RankSession(ctx, theirs, self.sent.put)
        self.next_id = 0
        self.thread: threading.Thread | None = None

    def start(self) -> "Rank":
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        assert ch.decode(self.ours.recv()) == SessionReady(0, os.getpid(), __import__("socket").gethostname())
        return self

    def _serve(self) -> None:
        try:
            self.session.serve()
        finally:
            self.session.close()

    def command(self, make) -> int:
        self.next_id += 1
        self.ours.send(make(self.next_id).wire())
        return self.next_id

    def cell(self, source: str, label: str = "Cell In[3]") -> int:
        return self.command(lambda i: RunCell(i, source, f"<ipython-input-{i}-x>", label))

    def done(self, timeout: float = 10.0) -> CellDone:
        deadline = time.monotonic() + timeout
        while True:
            message = self.sent.get(timeout=max(0.01, deadline - time.monotonic()))
            if isinstance(message, CellDone):
                return message

    def run(self, source: str) -> object:
        self.cell(source)
        answer = self.done()
        assert answer.outcome == OK, answer.traceback
        return values.unpack(answer.pickled_value)

    def stop(self) -> None:
        self.ours.send(StopSession("done").wire())
        if self.thread is not None:
            self.thread.join(5)
            assert not self.thread.is_alive()


@pytest.fixture
def rank():
    served = Rank().start()
    yield served
    served.stop()


def test_cells_share_one_namespace_and_the_last_expression_comes_back(rank):
    assert rank.run("x = 20\nx + 1") == 21
    assert rank.run("x * 2") == 40  # state set in one cell is there in the next
    assert rank.run("_ + 1") == 41  # _ is the last value
    assert rank.run("y = x") is None  # no expression last: no value
    assert rank.run("x;") is None  # ';' keeps the value back, as IPython does
    assert rank.run("ctx.rank") == 0


def test_a_rank_says_idle_before_its_cell_is_done(rank):
    """The notebook hands messages to the monitor until the last `CellDone`: an idle after it was lost (the
    monitor kept saying "running" for a rank that had ended its cell)."""
    rank.cell("1")
    states = []
    while not isinstance(message := rank.sent.get(timeout=10), CellDone):
        if isinstance(message, ch.Status):
            states.append(message.state)
    assert states == ["running", "idle"]


def test_a_failing_cell_names_the_cell_line_and_the_next_cell_works(rank):
    rank.cell("a = 1\n\ndef f():\n    return 1 / 0\nf()", label="Cell In[7]")
    answer = rank.done()
    assert answer.outcome == FAILED and answer.summary == "ZeroDivisionError: division by zero"
    assert "Cell In[7], line 5, in <module>" in answer.traceback and "Cell In[7], line 4, in f" in answer.traceback
    assert "dtrain_magic" not in answer.traceback  # the harness's own frames are left out
    assert rank.run("a") == 1
    rank.cell("exit()")  # SystemExit is the cell's failure, not the rank's end
    assert rank.done().outcome == FAILED and rank.run("a + 1") == 2


def test_an_interrupt_stops_a_python_loop_on_a_thread_and_keeps_the_state(rank):
    cell = rank.cell("import time\nn = 0\nwhile True:\n    n += 1\n    time.sleep(0.001)")
    time.sleep(0.3)
    rank.ours.send(InterruptCell(cell).wire())
    answer = rank.done(timeout=5)
    assert answer.outcome == INTERRUPTED and answer.summary.startswith("interrupted at Cell In[3], line ")
    assert rank.run("n") > 10  # it ran, and what it did is kept
    rank.ours.send(InterruptCell(cell).wire())  # a late interrupt of an ended cell is dropped
    assert rank.run("n > 0") is True


def test_an_interrupt_of_a_command_still_waiting_stops_it_as_it_starts(rank):
    first = rank.cell("import time\ntime.sleep(0.5)")
    second = rank.cell("never = 1")
    rank.ours.send(InterruptCell(second).wire())
    assert rank.done().cell_id == first
    answer = rank.done()
    assert (answer.cell_id, answer.outcome) == (second, INTERRUPTED)
    assert rank.run("'never' in dir()") is False


def test_an_interrupt_on_the_main_thread_is_a_sigint_and_wakes_a_sleep():
    served = Rank()

    def drive():
        assert isinstance(ch.decode(served.ours.recv()), SessionReady)
        cell = served.cell("import time\ntime.sleep(30)")
        time.sleep(0.5)
        served.ours.send(InterruptCell(cell).wire())
        served.answer = served.done(timeout=5)
        served.ours.send(StopSession("done").wire())

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    started = time.monotonic()
    served.session.serve()  # on the main thread: the interrupt is a SIGINT to it
    served.session.close()
    driver.join(5)
    assert served.answer.outcome == INTERRUPTED and time.monotonic() - started < 10
    assert served.answer.summary == "interrupted at Cell In[3], line 2"


def test_push_binds_values_and_pull_is_strict(rank):
    rank.command(lambda i: PushValues(i, ("a", "b"), values.pack({"a": [1, 2], "b": "x"}, strict=True)))
    assert rank.done().outcome == OK
    rank.command(lambda i: PullValue(i, "a + [len(b)]"))
    assert values.unpack(rank.done().pickled_value) == [1, 2, 1]
    rank.run("import threading\nlock = threading.Lock()")
    rank.command(lambda i: PullValue(i, "lock"))
    answer = rank.done()
    assert answer.outcome == FAILED and "cannot be pickled" in answer.summary
    rank.command(lambda i: PullValue(i, "missing"))
    assert rank.done().summary == "NameError: name 'missing' is not defined"
    shown = rank.run("lock")  # a cell's value that does not pickle comes back as its repr
    assert isinstance(shown, values.Unsent) and "lock" in repr(shown) and "cannot be pickled" in shown.reason


def test_the_notebook_going_away_ends_the_loop():
    served = Rank().start()
    served.ours.close()
    served.thread.join(5)
    assert not served.thread.is_alive()


def test_values_by_rank_and_what_does_not_travel():
    import torch

    shown = values.PerRank({1: "b\nc", 0: torch.zeros(2)})
    assert repr(shown) == "[rank 0] tensor([0., 0.])\n[rank 1] 'b\\nc'"
    point = __import__("collections").namedtuple("Point", "x y")(torch.ones(1), [torch.ones(1)])
    assert values.to_cpu(point).x.device.type == "cpu" and isinstance(values.to_cpu(point), type(point))
    assert values.pack(None) is None and values.unpack(None) is None
    big = values.unpack(values.pack(b"x" * 200, limit=100))
    assert isinstance(big, values.Unsent) and "pull it" in big.reason
    assert values.unpack(values.pack(b"x" * 200, strict=True, limit=100)) == b"x" * 200  # a pull has no limit


def test_session_messages_round_trip_and_kinds_stay_unique():
    for message in (SessionReady(1, 2, "h"), RunCell(1, "x", "f", "Cell In[1]"), PushValues(1, ("a",), b"p"),
                    PullValue(1, "a"), InterruptCell(1), StopSession("why"), CellDone(0, 1, OK, b"v", "", "")):
        assert ch.decode(message.wire()) == message
    with pytest.raises(ValueError, match="taken"):
        ch.extend_protocol(type("Clash", (CellDone,), {"KIND": "metric", "__slots__": ()}))


def test_which_flags_a_session_takes():
    config, idle = options.config_from_options({"backend": "local", "num_workers": 3, "gpu": False,
                                                "idle_timeout": 60})
    assert (config.backend, config.num_processes, config.use_gpu, idle) == ("local", 3, False, 60.0)
    with pytest.raises(ConfigError, match="max_restarts=.*a restart would lose"):
        options.config_from_options({"backend": "ray", "max_restarts": 1})
    with pytest.raises(ConfigError, match="--keep-warm: does not apply to a session"):
        options.check_session_config(RunConfig(backend="spark", keep_warm=10))
    with pytest.raises(ConfigError, match="did you mean num_processes="):
        options.config_from_options({"num_proceses": 2})
    assert {row.field for row in options.ROWS}.isdisjoint(options.NOT_FOR_SESSIONS)
    assert not {"--sweep", "--trials", "--metric"} & {name for row in options.ROWS for name in row.options}  # one run
    assert options.idle_timeout_s(None, {}) == options.DEFAULT_IDLE_TIMEOUT_S
    assert options.idle_timeout_s(None, {options.IDLE_ENV: "0"}) == 0.0
    with pytest.raises(ConfigError, match=r"\$DTRAIN_MAGIC_SESSION_IDLE: got 'soon'"):
        options.idle_timeout_s(None, {options.IDLE_ENV: "soon"})
    with pytest.raises(ConfigError, match="--idle-timeout: got -1"):
        options.idle_timeout_s(-1)


def test_the_start_line_starts_the_same_session():
    from dtrain_magic.notebook import flags
    from dtrain_magic.notebook.session_magic import _session_parser

    config, _ = options.config_from_options({"backend": "ray", "num_processes": 3, "use_gpu": False, "seed": 4,
                                             "experiment": "my exp", "ui": False, "timeout": 60})
    line = options.start_line(config, 120.0)
    assert line.startswith("%distribute_session start --backend ray") and line.endswith("--idle-timeout 120")
    args = flags.parse_line(line.split(" ", 2)[2], holder=_session_parser, rows=options.ROWS)
    assert flags.config_from_args(args) == config and args.idle_timeout == 120.0


def test_the_session_magic_help_and_flags_come_from_the_flag_table():
    from IPython.core.error import UsageError

    from dtrain_magic.notebook import flags
    from dtrain_magic.notebook.session_magic import SessionMagics, _session_parser

    help_text = SessionMagics.distribute_session.__doc__
    for flag in ("--backend", "--strategy", "-n", "--precision", "--seed", "--timeout", "--idle-timeout", "status"):
        assert flag in help_text, flag
    for flag in ("--fn", "--result", "--keep-warm", "--max-restarts"):
        assert flag not in help_text, flag
    with pytest.raises(UsageError, match=r"did you mean --backend\?\); see %distribute_session\?"):
        flags.parse_line("--backnd ray", holder=_session_parser, rows=options.ROWS, help_name="%distribute_session?")
    with pytest.raises(UsageError, match="unrecognized arguments: --max-restarts"):
        flags.parse_line("--max-restarts 2", holder=_session_parser, rows=options.ROWS)


@pytest.mark.parametrize(("line", "says"), [
    ("start --backend local --max-restarts 2", "--max-restarts: does not apply to a session: .*a restart would lose"),
    ("start --keep-warm=30   # held after?", "--keep-warm: does not apply to a session: nothing waits after"),
    ("start --fn train", "--fn: does not apply to a session: a session runs cells"),
])
def test_the_session_magic_says_why_a_run_only_flag_is_refused(line, says):
    """docs/sessions.md calls these flags refused and says why: the magic says the same, not argparse's words."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext dtrain_magic", store_history=False)
    with pytest.raises(ConfigError, match=says):
        shell.run_line_magic("distribute_session", line)
    assert not kernel_state().sessions()


def test_rank_lists():
    from dtrain_magic.notebook.session_magic import parse_ranks

    assert parse_ranks([], 4) is None and parse_ranks(["all"], 4) is None
    assert parse_ranks(["0"], 4) == (0,) and parse_ranks(["2,0"], 4) == (0, 2)
    assert parse_ranks(["1-3"], 4) == (1, 2, 3) and parse_ranks(["0,", "2"], 4) == (0, 2)
    with pytest.raises(SessionError, match="ranks '4': this session has ranks 0 to 3"):
        parse_ranks(["4"], 4)
    with pytest.raises(SessionError, match="write them as 0, 0,1, 1-3 or all"):
        parse_ranks(["first"], 4)


def done(rank, outcome=OK, summary="", where=""):
    return CellDone(rank, 1, outcome, None, summary, where)


def test_what_a_cells_answers_raise():
    _raise_for("Cell In[2]", (0, 1), {0: done(0), 1: done(1)}, (), None, None)  # every rank answered: no error
    trace = "Traceback (most recent call last):\n  Cell In[2], line 3, in <module>\nValueError: bad\n"
    with pytest.raises(RankError) as failed:
        _raise_for("Cell In[2]", (0, 1, 2), {0: done(0, FAILED, "ValueError: bad", trace),
                                            1: done(1, FAILED, "ValueError: bad", trace),
                                            2: done(2, INTERRUPTED, "interrupted at Cell In[2], line 5")},
                   (), "failed", None)
    text = str(failed.value)
    assert text.startswith("ranks 0, 1 failed: ValueError: bad") and text.count("Traceback") == 1  # said once
    assert "rank 2 interrupted at Cell In[2], line 5" in text and "The session goes on" in text
    assert set(failed.value.failures) == {0, 1}
    with pytest.raises(CellInterrupted) as interrupted:
        _raise_for("Cell In[4]", (0, 1), {1: done(1)}, (0,), "interrupt", None)
    text = str(interrupted.value)
    assert text.startswith("Cell In[4] was interrupted on rank 0 (rank 1 had finished it)")
    assert "rank 0 did not stop within 5 s" in text and "%distribute_session restart" in text
    assert interrupted.value.stuck == (0,) and "state are kept" not in text
    with pytest.raises(CellTimeout, match=r"^--timeout 30: Cell In\[5\] was interrupted on ranks 0, 1"):
        _raise_for("Cell In[5]", (0, 1), {0: done(0, INTERRUPTED, "interrupted at Cell In[5], line 2"),
                                         1: done(1, INTERRUPTED, "interrupted at Cell In[5], line 2")},
                   (), "timeout", 30.0)


def test_a_run_must_fit_beside_the_session():
    from dtrain_magic.session.driver import Session

    pools = {"spark": ("task slots of local-cluster[2,1,1024]", 4)}
    launcher = SimpleNamespace(capacity=lambda config: pools.get("spark") if not config.local_mode else None)
    session = object.__new__(Session)  # the check alone: no ranks are started
    session.state, session.world_size, session.launcher = "open", 2, launcher
    session.config = RunConfig(backend="spark", local_mode=False, num_processes=2)
    session.check_beside(RunConfig(backend="spark", local_mode=False, num_processes=2))  # 4 of 4
    session.check_beside(RunConfig(backend="spark", local_mode=True, num_processes=8))  # another pool
    session.check_beside(RunConfig(backend="local", num_processes=8))
    with pytest.raises(ConfigError, match=r"^--num-processes: -n 3 beside the open session's 2 ranks needs 5 of the 4 "
                                          r"task slots of local-cluster\[2,1,1024\]; use -n 2 or fewer"):
        session.check_beside(RunConfig(backend="spark", local_mode=False, num_processes=3))


def test_the_current_cell_number_is_the_running_cells():
    from IPython.core.interactiveshell import InteractiveShell

    from dtrain_magic.notebook.capture import cell_number

    shell = InteractiveShell.instance()
    seen = []
    shell.register_magic_function(lambda line, cell: seen.append(cell_number(shell)), "cell", "number_of_this")
    first = shell.run_cell("%%number_of_this\nx", store_history=True)
    second = shell.run_cell("%%number_of_this\nx", store_history=True)
    assert seen == [first.execution_count, second.execution_count]


def test_the_panel_starts_a_session_with_the_chosen_settings():
    pytest.importorskip("ipywidgets")
    from dtrain_magic.ui.panel import ConfigurePanel

    started = []
    config = RunConfig(backend="local", num_processes=2)
    panel = ConfigurePanel(config, "", shell=None, checker=lambda c: None,
                           start_session=lambda chosen, monitor: started.append((chosen, monitor)) or "session")
    assert panel.session_button.layout.display == "" and not panel.session_button.disabled
    assert panel.run_button.layout.display == "none"  # no cell to run
    panel.state.set(num_processes=3, strategy="fsdp")
    panel.start(wait=True)
    (chosen, monitor), = started
    assert (chosen.num_processes, chosen.strategy, chosen.ui) == (3, "fsdp", True)
    assert panel.session == "session" and panel.monitor_box.children == (monitor.container,)
    hidden = ConfigurePanel(config, "def f(ctx): pass", shell=None, checker=lambda c: None)
    assert hidden.session_button.layout.display == "none" and hidden.session_button.disabled


def test_the_session_listener_takes_each_rank_once_and_sends_one_pickled_message_to_all():
    from multiprocessing.connection import Client

    from dtrain_magic.session.links import RankLinks

    links = RankLinks("127.0.0.1", 2)
    host, port, authkey = links.address
    ranks = [Client((host, port), authkey=authkey) for _ in range(2)]
    for rank, conn in enumerate(ranks):
        conn.send(SessionReady(rank, 1, "h").wire())
    assert links.all_ready.wait(5) and set(links.ready) == {0, 1}
    ranks.append(Client((host, port), authkey=authkey))
    ranks[2].send(SessionReady(1, 2, "h").wire())  # rank 1 again: refused
    links.send([0, 1], PushValues(1, ("a",), b"x" * 10))
    assert [ch.decode(conn.recv()) for conn in ranks[:2]] == [PushValues(1, ("a",), b"x" * 10)] * 2
    with pytest.raises(EOFError):
        ranks[2].recv()
    ranks[0].close()
    deadline = time.monotonic() + 5
    while links.gone != {0} and time.monotonic() < deadline:
        time.sleep(0.02)
    assert links.gone == {0}
    links.close()
    with pytest.raises(EOFError):
        ranks[1].recv()  # the listener's close hangs up on every rank


def test_the_magics_without_a_session(shell, capsys):
    """Nothing is started: a dry run says what would start; the other magics say there is no session and how to
    start one; a session's flags are checked as a run's are."""
    assert shell.run("%distribute_session start --backend local -n 3 --cpu --no-ui --dry-run").error_in_exec is None
    out = capsys.readouterr().out
    assert "dtrain_magic dry run: nothing started." in out and "3 local process(es)" in out
    assert "equivalent: %distribute_session start --backend local --strategy ddp --precision fp32 -n 3 --cpu" in out
    for cell in ("%%ranks\n1", "%distribute_pull x", "x = 1\n%distribute_push x", "%distribute_session stop"):
        error = shell.run(cell).error_in_exec
        assert isinstance(error, SessionError) and "no session is open in this kernel" in str(error), cell
    assert shell.run("%distribute_session status").error_in_exec is None
    assert "no session is open" in capsys.readouterr().out
    error = shell.run("%distribute_session start --backend local --precision fp16 --cpu").error_in_exec
    assert isinstance(error, ConfigError) and str(error).startswith("--precision: fp16 needs a GPU")
    assert shell.run("%distribute_session start --backend local --idle-timeout -5").error_in_exec is not None
    assert shell.run("%distribute_session begin").error_in_exec is not None  # a UsageError naming the actions
    assert "%distribute_session start [flags] | status | stop | restart" in capsys.readouterr().err
