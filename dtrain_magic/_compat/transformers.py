"""transformers' private parts, written against transformers 5.24 (constraints.txt: 5.24.0; a test extra, never
imported by the magic unless the user's code does).

- `per_module_init`: ``PreTrainedModel._init_weights(module)``, the model's initialisation of one module (normal
  with ``initializer_range``, ones for norms), which transformers itself applies to every module. A deferred build
  (``ctx.init_model()``, ``weights.deferred.initialise``) initialises one module at a time and calls it for each
  module after ``reset_parameters``. **Fallback** when missing: ``reset_parameters`` alone (torch's default init of
  each layer), and modules without one are refused by name.
"""

from __future__ import annotations

from typing import Any, Callable

from . import Library

TRANSFORMERS = Library(key="transformers", title="transformers", module="transformers", known=("5.24",),
                       tested="5.24.0", requirement="transformers==5.24.0")


def per_module_init(model: Any) -> Callable[[Any], None] | None:
    """``model``'s own per-module initialisation when it is a Hugging Face ``PreTrainedModel``; else None."""
    init = getattr(model, "_init_weights", None)
    config = getattr(model, "config", None)
    if not callable(init) or config is None or not hasattr(config, "initializer_range"):
        return None
    return init
