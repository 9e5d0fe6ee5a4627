"""The two registries, the only lists of their names: ``--backend`` → a `Launcher`, ``--strategy`` → a `Strategy`.

A backend or strategy is one class that owns its facts (its name, the flags that apply only to it, its rules,
what it can do; for a strategy also its memory model, process-group backend and panel options); it is found here
by one line. Adding one is one new module and one line below (docs/contributing.md), or, from your own code, one
call: ``STRATEGIES.register("mine", "my_pkg.strategies:MyStrategy")`` (a class object works too).

Validation, planning and the workers read facts (`Registry.facts`), which must not cost torch, pyspark or ray,
nor import the modules that build on `dtrain_magic.config` (the config reads the facts: that would be a circle).
A strategy class is its own facts (its module imports torch only inside its methods); a launcher is built on the
channel, the worker and the config, so a backend's facts are a class of their own in `dtrain_magic.backends`,
which the launcher class inherits: each fact is still written once. Entries are imported lazily
("package.module:Class" strings), so ``import dtrain_magic`` pays for none of them. A registry is also the flag's
``choices`` (it supports ``in`` and iteration), so the parser, `RunConfig`, the panel and the docs all read the
names from here; the first entry is the default (`Registry.default`).
"""

from __future__ import annotations

import importlib
from typing import Any, Iterator

from .errors import ConfigError


class Registry:
    """Names → classes for one flag, in registration order; ``extra`` choices (``auto``) resolve elsewhere."""

    def __init__(self, flag: str, entries: dict[str, Any], extra: tuple[str, ...] = ()):
        """``entries``: name → the class's target, or (the class's target, its facts class's target)."""
        self.flag = flag
        self.extra = extra
        self._entries: dict[str, str | type] = {}
        self._facts: dict[str, str | type] = {}
        for name, target in entries.items():
            self.register(name, *(target if isinstance(target, tuple) else (target,)))

    def register(self, name: str, target: str | type, facts: str | type | None = None) -> None:
        """Add (or replace) ``name``: a ``"package.module:Class"`` string, imported when first used, or a class;
        ``facts``: a class with the same facts that loads without the class's imports (default: the class)."""
        if not name.isidentifier() or name in self.extra:
            raise ValueError(f"{self.flag}: {name!r} cannot be registered (a Python identifier, not {self.extra})")
        self._entries[name] = target
        self._facts[name] = target if facts is None else facts

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)
        self._facts.pop(name, None)

    def names(self) -> tuple[str, ...]:
        """The registered names, in registration order (without the ``extra`` choices)."""
        return tuple(self._entries)

    @property
    def default(self) -> str:
        """The name chosen when the flag is not given and nothing else decides: the first registered."""
        return next(iter(self._entries))

    def __iter__(self) -> Iterator[str]:  # argparse's ``choices``: the flag's every allowed value
        return iter((*self.extra, *self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self.extra or name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.flag}: {', '.join(self)})"

    def load(self, name: str) -> Any:
        """The class registered as ``name`` (what runs: it may import torch or a backend's library); unknown names
        and missing modules are `ConfigError`s naming the flag."""
        return self._resolve(name, self._entries)

    def facts(self, name: str) -> Any:
        """The facts of ``name`` (a class with its name, own fields, rules and capabilities), loaded without torch,
        pyspark or ray; same errors as `load`."""
        return self._resolve(name, self._facts)

    def all_facts(self) -> dict[str, Any]:
        """Every registered entry's facts by name (for rules that look across entries)."""
        return {name: self.facts(name) for name in self._entries}

    def owner_of(self, field: str) -> str | None:
        """The entry whose class declares ``field`` (a `RunConfig` field) as its own (``own_fields``), if any."""
        return next((name for name, cls in self.all_facts().items() if field in getattr(cls, "own_fields", ())), None)

    def _resolve(self, name: str, table: dict[str, str | type]) -> Any:
        if name not in table:
            raise ConfigError(self.flag, f"got {name!r}; allowed: {', '.join(self)}")
        target = table[name]
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


BACKENDS = Registry("--backend", {
    "local": ("dtrain_magic.launchers.local:LocalLauncher", "dtrain_magic.backends:Local"),
    "spark": ("dtrain_magic.launchers.spark:SparkLauncher", "dtrain_magic.backends:Spark"),
    "ray": ("dtrain_magic.launchers.ray:RayLauncher", "dtrain_magic.backends:Ray"),
}, extra=("auto",))

STRATEGIES = Registry("--strategy", {
    "ddp": "dtrain_magic.strategies.ddp:DDPStrategy",
    "fsdp": "dtrain_magic.strategies.fsdp:FSDPStrategy",
    "deepspeed": "dtrain_magic.strategies.deepspeed:DeepSpeedStrategy",
})
