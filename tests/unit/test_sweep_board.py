"""A sweep's panel model from fake trial data (dtrain_magic/sweep/board.py): the overlaid curves, the trials' table
with the best highlighted, the parameters' parallel coordinates; the figures are valid plotly figures, and the
panel (dtrain_magic/ui/sweep_panel.py) draws them into its outputs."""

from __future__ import annotations

import json
import math

import plotly.graph_objects as go
import pytest

from dtrain_magic.sweep.board import SweepBoard


def fed_board(minimize: bool = True) -> SweepBoard:
    board = SweepBoard("val_loss", minimize=minimize, total=4)
    board.trial_started(0, {"lr": 0.1, "opt": "adam"})
    board.trial_started(1, {"lr": 0.001, "opt": "sgd"})
    board.trial_started(2, {"lr": 1.5, "opt": "adam"})
    board.trial_started(3, {"lr": 0.01, "opt": "sgd"})
    for step in range(5):
        board.trial_value(0, step, 1.0 / (step + 1))
        board.trial_value(1, step, 2.0 - 0.1 * step)
    board.trial_value(2, 0, 3.0)
    board.trial_value(2, 1, math.inf)  # a diverging trial: no JSON infinity reaches the front-end
    board.trial_value(3, 0, 0.9)
    board.trial_ended(0, "FINISHED", 0.2, 3.3)
    board.trial_ended(1, "FINISHED", 1.6, 3.5)
    board.trial_ended(2, "PRUNED", None, 0.75, "at step 1")
    return board


def test_the_table_has_every_trial_with_its_status_best_value_steps_and_time_and_marks_the_best():
    rows = fed_board().rows()
    assert [(r["trial"], r["status"], r["params"], r["steps"]) for r in rows] == [
        (1, "FINISHED", "lr=0.1 opt=adam", 5), (2, "FINISHED", "lr=0.001 opt=sgd", 5),
        (3, "PRUNED (at step 1)", "lr=1.5 opt=adam", 2), (4, "RUNNING", "lr=0.01 opt=sgd", 1)]
    assert [r["best"] for r in rows] == [0.2, pytest.approx(1.6), 3.0, 0.9]
    assert [r["is_best"] for r in rows] == [True, False, False, False]  # the best FINISHED, not the running 0.9
    assert [r["seconds"] for r in rows[:3]] == [3.3, 3.5, 0.8]
    table = fed_board().table_html()
    assert table.count("<tr") == 5 and table.count('class="dtm-best"') == 1
    assert '<tr class="dtm-best"' in table.split("lr=0.1 opt=adam")[0]  # on the first trial's row


def test_with_mode_max_the_highest_finished_value_is_the_best():
    board = fed_board(minimize=False)
    assert board.best_number() == 1
    assert SweepBoard("loss").best_number() is None  # none finished yet


def test_the_curves_are_one_trace_per_trial_named_by_its_params_the_best_one_thicker():
    figure = fed_board().curves_figure()
    go.Figure(figure)  # plotly accepts it as it is
    json.dumps(figure, allow_nan=False)
    traces = figure["data"]
    assert [t["name"] for t in traces] == ["trial 1: lr=0.1 opt=adam", "trial 2: lr=0.001 opt=sgd",
                                           "trial 3: lr=1.5 opt=adam", "trial 4: lr=0.01 opt=sgd"]
    assert traces[0]["x"] == [0, 1, 2, 3, 4] and traces[0]["y"][-1] == pytest.approx(0.2)
    assert traces[2]["y"] == [3.0, None]  # the infinite value is a gap
    assert [t["line"]["width"] for t in traces] == [4, 1.5, 1.5, 1.5]
    assert "lr=1.5 opt=adam" in traces[2]["hovertemplate"] and "PRUNED" in traces[2]["hovertemplate"]
    assert len({t["line"]["color"] for t in traces}) == 4
    assert figure["layout"]["yaxis"]["type"] == "linear"
    steep = SweepBoard("loss")
    steep.trial_started(0, {"lr": 1})
    for step, value in enumerate((1.0, 1e-2, 1e-4)):
        steep.trial_value(0, step, value)
    assert steep.curves_figure()["layout"]["yaxis"]["type"] == "log"  # three decades: log y


def test_the_parameters_figure_is_parallel_coordinates_of_the_finished_trials():
    assert SweepBoard("loss").params_figure() is None
    figure = fed_board().params_figure()
    go.Figure(figure)
    (trace,) = figure["data"]
    assert trace["type"] == "parcoords"
    lr, opt, metric = trace["dimensions"]
    assert lr == {"label": "lr", "values": [0.1, 0.001]}
    assert opt == {"label": "opt", "values": [0, 1], "tickvals": [0, 1], "ticktext": ["adam", "sgd"]}
    assert metric == {"label": "val_loss", "values": [0.2, 1.6]} and trace["line"]["color"] == [0.2, 1.6]


def test_the_panel_draws_the_board_and_its_stop_stops_the_sweep():
    from dtrain_magic.sweep.board import SweepBoard as Board
    from dtrain_magic.ui.charts import PLOTLY_MIME
    from dtrain_magic.ui.sweep_panel import SweepPanel

    board = Board("loss", total=2)
    stopped, trials_stopped = [], []
    panel = SweepPanel(board, on_stop=lambda: stopped.append(True), display=False, redraw_s=60,
                       on_stop_trial=trials_stopped.append)
    try:
        board.trial_started(0, {"lr": 0.5})
        board.trial_started(1, {"lr": 0.1})
        board.trial_ended(1, "PRUNED", None, 0.5, "at step 3")
        board.trial_value(0, 0, 1.0)
        panel.draw()
        (shown,) = panel.curves.outputs
        assert [t["name"] for t in shown["data"][PLOTLY_MIME]["data"]] == ["trial 1: lr=0.5", "trial 2: lr=0.1"]
        assert "lr=0.5" in panel.table.value
        assert list(panel.trial_choice.options) == [("1: lr=0.5", 0)]  # only the running trials can be stopped
        panel.stop_trial_button.click()  # the first running trial is chosen by default
        assert trials_stopped == [0] and not stopped
        panel.stop_button.click()
        assert stopped == [True] and panel.stop_button.disabled
        board.trial_ended(0, "FINISHED", 1.0, 1.0)
    finally:
        panel.close()
    (params,) = panel.params.outputs
    assert params["data"][PLOTLY_MIME]["data"][0]["type"] == "parcoords"
