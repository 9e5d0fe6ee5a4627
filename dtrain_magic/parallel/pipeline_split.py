"""Splitting a model into pipeline stages (``--pp``).

A pipeline stage runs a contiguous part of the model, so the model must be a *chain*: each part's output is the
next part's input. Two shapes qualify:

- an ``nn.Sequential``: its children are the chain;
- a model whose ``forward`` calls its children in the order they were registered, each on the previous one's
  output, where a ``ModuleList`` (or ``ModuleDict``) child stands for its layers run in order (an embedding, a
  list of blocks, a head). Whether ``forward`` really does that cannot be read from the class, so it is checked on
  the first micro-batch (`ChainCheck`): a model that does anything between its children (a residual to the input,
  a scale) is refused there, with the name of the part where the chain breaks.

Stages are balanced by parameter count (`balance`) or start at the user's ``pp_split`` names. A stage is the model
itself with the other stages' parts removed (`cut_stage`): entries are deleted from the ``Sequential`` /
``ModuleList`` without renumbering, so every parameter keeps its name from the whole model (checkpoints and
``full_state_dict`` merge stages by name), and other top-level children become ``nn.Identity`` (they pass the
activation through, which the chain check makes sure is right).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from torch import nn

_LAYER_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


@dataclass(frozen=True)
class Link:
    """One part of the chain: its name in the model, the container it sits in ("" for the model itself) and its
    key there, and its parameter count."""

    name: str
    container: str
    key: str
    num_params: int


def chain_of(model: nn.Module) -> list[Link]:
    """The model's parts in forward order (see the module docstring)."""
    links: list[Link] = []
    if isinstance(model, nn.Sequential):
        for key, child in model.named_children():
            links.append(Link(key, "", key, _count(child)))
    else:
        for key, child in model.named_children():
            if isinstance(child, _LAYER_CONTAINERS):
                for inner, layer in child.named_children():
                    links.append(Link(f"{key}.{inner}", key, inner, _count(layer)))
            else:
                links.append(Link(key, "", key, _count(child)))
    if len(links) < 2:
        raise ValueError(
            f"--pp: {type(model).__name__} has {len(links)} part(s) to split; pipeline stages need an nn.Sequential "
            "or a model whose layers are an nn.ModuleList, with at least as many parts as stages"
        )
    return links


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def balance(weights: Sequence[int], stages: int) -> list[int]:
    """Start index of each stage, contiguous, minimising the heaviest stage (then the spread).

    Parts without parameters (activations) stay with the part before them, so a stage never starts with one
    (except the first). Every stage gets at least one part with parameters.
    """
    heavy = [i for i, w in enumerate(weights) if w > 0]
    if len(heavy) < stages:
        raise ValueError(
            f"--pp {stages}: the model has {len(heavy)} part(s) with parameters, fewer than the {stages} stages; "
            "use fewer stages"
        )
    # groups: each part with parameters plus the parameterless parts after it (leading ones join the first group)
    starts = [0] + heavy[1:]
    sums = []
    for index, start in enumerate(starts):
        end = starts[index + 1] if index + 1 < len(starts) else len(weights)
        sums.append(sum(weights[start:end]))
    groups = len(sums)
    prefix = [0]
    for value in sums:
        prefix.append(prefix[-1] + value)

    # best[s][g]: (heaviest stage, sum of squares) splitting the first g groups into s stages; cut[s][g]: last start
    inf = (float("inf"), float("inf"))
    best = [[inf] * (groups + 1) for _ in range(stages + 1)]
    cut = [[0] * (groups + 1) for _ in range(stages + 1)]
    best[0][0] = (0, 0)
    for s in range(1, stages + 1):
        for g in range(s, groups - (stages - s) + 1):
            for first in range(s - 1, g):  # the s-th stage holds groups first..g-1
                previous = best[s - 1][first]
                if previous == inf:
                    continue
                stage = prefix[g] - prefix[first]
                candidate = (max(previous[0], stage), previous[1] + stage * stage)
                if candidate < best[s][g]:
                    best[s][g], cut[s][g] = candidate, first
    bounds, g = [], groups
    for s in range(stages, 0, -1):
        first = cut[s][g]
        bounds.append(starts[first])
        g = first
    return sorted(bounds)


def split_starts(links: Sequence[Link], stages: int, pp_split: Sequence[str | int] | None = None) -> list[int]:
    """Start index (into ``links``) of every stage: balanced, or where the user's ``pp_split`` says."""
    if pp_split is None:
        return balance([link.num_params for link in links], stages)
    names = [link.name for link in links]
    if isinstance(pp_split, (str, int)) or len(pp_split) != stages - 1:
        raise ValueError(
            f"ctx.prepare(pp_split={pp_split!r}): give the {stages - 1} part(s) where stages 2..{stages} begin "
            f"(--pp {stages}), as names or indices of: {_shown(names)}"
        )
    starts = [0]
    for point in pp_split:
        if isinstance(point, int) and not isinstance(point, bool):
            index = point
        elif isinstance(point, str) and point in names:
            index = names.index(point)
        else:
            raise ValueError(f"ctx.prepare(pp_split=...): {point!r} is not a part of the model; parts: {_shown(names)}")
        if not 0 < index < len(names) or index <= starts[-1]:
            raise ValueError(
                f"ctx.prepare(pp_split={list(pp_split)!r}): split points must be parts after the first, in forward "
                f"order, each after the last; parts: {_shown(names)}"
            )
        starts.append(index)
    return starts


def _shown(names: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def stage_ranges(starts: Sequence[int], total: int) -> list[range]:
    return [range(start, starts[i + 1] if i + 1 < len(starts) else total) for i, start in enumerate(starts)]


def check_no_ties_across_stages(model: nn.Module, links: Sequence[Link], starts: Sequence[int]) -> None:
    """A parameter shared by parts in two stages (tied embeddings) would become two diverging copies: refuse it."""
    stage_of: dict[int, tuple[int, str]] = {}
    modules = dict(model.named_modules())
    for stage, span in enumerate(stage_ranges(starts, len(links))):
        for index in span:
            link = links[index]
            for pname, param in modules[link.name].named_parameters(remove_duplicate=False):
                seen = stage_of.setdefault(id(param), (stage, f"{link.name}.{pname}"))
                if seen[0] != stage:
                    raise ValueError(
                        f"--pp: parameter {seen[1]} (stage {seen[0]}) is shared with {link.name}.{pname} "
                        f"(stage {stage}); "
                        "tied parameters across pipeline stages are not supported: untie them, or choose pp_split so "
                        "both parts are in one stage"
                    )


def cut_stage(model: nn.Module, links: Sequence[Link], keep: range) -> list[str]:
    """Remove every part outside ``keep`` from ``model`` (in place; names of the kept parameters do not change).

    Returns the names of the parts the stage's forward will call, in order (kept parts, and the ``Identity``
    stand-ins of removed top-level children), for `ChainCheck`.
    """
    sequential = isinstance(model, nn.Sequential)
    called = []
    for index, link in enumerate(links):
        container = model if not link.container else model.get_submodule(link.container)
        if index in keep:
            called.append(link.name)
        elif link.container or sequential:
            del container._modules[link.key]  # not `del seq[i]`: that renumbers the rest
        else:
            container._modules[link.key] = nn.Identity()
            called.append(link.name)
    return called


class ChainCheck:
    """Checks, on the stage's first forward, that the model's forward is the chain `cut_stage` assumed: the stage
    input goes into the first part, each part's output into the next, the last part's output is the stage's output.
    Raises ``ValueError`` naming the break. Not needed for a plain ``nn.Sequential`` (its forward is that chain)."""

    def __init__(self, model: nn.Module, called: Sequence[str]):
        self.model, self.expected = model, list(called)
        self.calls: list[tuple[str, Any, Any]] = []
        self.stage_input: Any = None
        self.handles: list[Any] = [
            model.register_forward_pre_hook(self._root_pre), model.register_forward_hook(self._root_post),
        ]
        for name in self.expected:
            module = model.get_submodule(name)
            self.handles.append(module.register_forward_pre_hook(self._pre(name)))
            self.handles.append(module.register_forward_hook(self._post(name)))

    @staticmethod
    def needed(model: nn.Module) -> bool:
        return type(model) is not nn.Sequential

    def _root_pre(self, module: nn.Module, args: tuple) -> None:
        self.calls.clear()
        self.stage_input = args[0] if args else None

    def _pre(self, name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            self.calls.append((name, args[0] if args else None, None))
        return hook

    def _post(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            for i in range(len(self.calls) - 1, -1, -1):
                if self.calls[i][0] == name and self.calls[i][2] is None:
                    self.calls[i] = (name, self.calls[i][1], output)
                    break
        return hook

    def _root_post(self, module: nn.Module, args: tuple, output: Any) -> None:
        try:
            self.verify(output)
        finally:
            self.remove()

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def verify(self, output: Any) -> None:
        kind = type(self.model).__name__
        advice = ("pipeline stages need a forward that passes each part's output straight to the next part, in the "
                  "order the parts are registered (put extra computation in a module of its own, or use nn.Sequential)")
        names = [name for name, _, _ in self.calls]
        if names != self.expected:
            raise ValueError(f"--pp: {kind}.forward called its parts as {names}, expected {self.expected}: {advice}")
        previous, previous_name = self.stage_input, "the stage's input"
        for name, received, produced in self.calls:
            if received is not previous:
                raise ValueError(f"--pp: in {kind}.forward, {name} does not receive {previous_name}: {advice}")
            previous, previous_name = produced, f"the output of {name}"
        if output is not previous:
            raise ValueError(f"--pp: {kind}.forward does not return {previous_name}: {advice}")


def describe_split(links: Sequence[Link], starts: Sequence[int]) -> str:
    """``stage 0: 0..2 (1,234 parameters); stage 1: ...`` for the run's output."""
    parts = []
    for stage, span in enumerate(stage_ranges(starts, len(links))):
        first, last = links[span[0]].name, links[span[-1]].name
        count = sum(links[i].num_params for i in span)
        parts.append(f"stage {stage}: {first}" + (f"..{last}" if last != first else "") + f" ({count:,} parameters)")
    return "; ".join(parts)


__all__ = [
    "ChainCheck", "Link", "balance", "chain_of", "check_no_ties_across_stages", "cut_stage", "describe_split",
    "split_starts", "stage_ranges",
]
