"""The two registries, the only lists of their names: ``--backend`` → a `Launcher`, ``--strategy`` → a `Strategy`.

A backend or strategy is one class in one module that owns its facts (its name, the flags that apply only to
it, its rules, and for a strategy its memory model, process-group backend and panel options); it is found
here by one line. Adding one is one new module and one line below (docs/contributing.md), or, from your own
code, one call: ``STRATEGIES.register("mine", "my_pkg.strategies:MyStrategy")`` (a class object works too).

Entries are imported lazily ("package.module:Class" strings), so ``import dtrain_magic`` never pays for pyspark,
ray or DeepSpeed. A registry is also the flag's ``choices`` (it supports ``in`` and iteration), so the parser,
`RunConfig`, the panel and the docs all read the names from here.
"""

from __future__ import annotations

import importlib
from typing import Any, Iterator

from .errors import ConfigError


class Registry:
    """Names → classes for one flag, in registration order; ``extra`` choices (``auto``) resolve elsewhere."""

    def __init__(self, flag: str, entries: dict[str, str], extra: tuple[str, ...] = ()):
        self.flag = flag
        self.extra = extra
        self._entries: dict[str, str | type] = dict(entries)

    def register(self, name: str, target: str | type) -> None:
        """Add (or replace) ``name``: a ``"package.module:Class"`` string, imported when first used, or a class."""
        if not name.isidentifier() or name in self.extra:
            raise ValueError(f"{self.flag}: {name!r} cannot be registered (a Python identifier, not {self.extra})")
        self._entries[name] = target

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order (without the ``extra`` choices)."""
        return tuple(self._entries)

    def __iter__(self) -> Iterator[str]:  # argparse's ``choices``: the flag's every allowed value
        return iter((*self.extra, *self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self.extra or name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.flag}: {', '.join(self)})"

    def load(self, name: str) -> Any:
        """The class registered as ``name``; unknown names and missing modules are `ConfigError`s naming the flag."""
        if name not in self._entries:
            raise ConfigError(self.flag, f"got {name!r}; allowed: {', '.join(self)}")
        target = self._entries[name]
        if not isinstance(target, str):
            return target
        module_name, _, class_name = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                raise ConfigError(self.flag, f"{name} is not yet supported in this version of dtrain_magic") from None
            raise
        return getattr(module, class_name)

    def classes(self) -> dict[str, Any]:
        """Every registered class by name (imports them all: for rules that look across entries)."""
        return {name: self.load(name) for name in self._entries}

    def owner_of(self, field: str) -> str | None:
        """The entry whose class declares ``field`` (a `RunConfig` field) as its own (``own_fields``), if any."""
        return next((name for name, cls in self.classes().items() if field in getattr(cls, "own_fields", ())), None)


BACKENDS = Registry("--backend", {
    "local": "dtrain_magic.launchers.local:LocalLauncher",
    "spark": "dtrain_magic.launchers.spark:SparkLauncher",
    "ray": "dtrain_magic.launchers.ray:RayLauncher",
}, extra=("auto",))

STRATEGIES = Registry("--strategy", {
    "ddp": "dtrain_magic.strategies.ddp:DDPStrategy",
    "fsdp": "dtrain_magic.strategies.fsdp:FSDPStrategy",
    "deepspeed": "dtrain_magic.strategies.deepspeed:DeepSpeedStrategy",
})
