"""Before a trial launches: does its configuration fit the device? The cell's model (`memory.CellModel`, counted
without training by `strategies.model_of_cell`) under the trial's run options (strategy, ``--zero``, precision,
processes, ``--tp``/``--pp``) gives the per-process estimate of `strategies.memory` (parameters, gradients, optimizer
states and the strategy's buffers; activations aside); a trial whose estimate exceeds the memory one process of it
may use is SKIPPED with the reason, not launched to fail.

Only where the ranks run on this machine (the local backend), whose device the notebook can see: a Spark or Ray
worker's device is not the notebook's. Without a model known before training (built from ``ctx.params``, or not
found in the cell) nothing is skipped.
"""

from __future__ import annotations

from typing import Any

from ..config import RunConfig


def skip_reason(model: Any, config: RunConfig, on_this_machine: bool) -> str | None:
    """Why a trial of ``config`` is not launched (its estimate exceeds the device's memory), else None."""
    if model is None or not getattr(model, "found", False) or not on_this_machine:
        return None
    from ..registry import STRATEGIES
    from ..strategies import memory

    facts = getattr(model, "facts", None)
    settings = STRATEGIES.facts(config.strategy).memory_settings(config, facts) if facts is not None else None
    est = memory.estimate(model.num_params, config.strategy, config.zero, config.precision, config.num_processes,
                          tp=config.tp, pp=config.pp, facts=facts, settings=settings,
                          activations=getattr(model, "activations", None), ac=config.ac)
    # a GPU per process; on the CPU the processes share the host's memory
    available = memory.device_memory_bytes("cuda" if config.use_gpu else None,
                                           1 if config.use_gpu else config.num_processes)
    if available is None or est.total <= available:
        return None
    where = "the GPU's memory" if config.use_gpu else f"this machine's memory over {config.num_processes} process(es)"
    return (f"not launched: its memory estimate ({est.label}, {config.precision}, {config.num_processes} processes, "
            f"{model.num_params:,} parameters) is {memory.format_bytes(est.total)} per process, more than {where} "
            f"({memory.format_bytes(available)})")

