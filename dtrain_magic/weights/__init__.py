"""Models bigger than one process: deferred initialisation, sharded loading, saving through rank 0.

- `deferred`: build on torch's meta device (``ctx.init_model()``, a model factory given to ``ctx.prepare``), give
  each rank storage for its part only, initialise it module by module;
- `sources`: the checkpoints ``ctx.prepare(..., weights=PATH)`` reads (safetensors, Hugging Face directories, torch
  state-dict files, the run's own sharded checkpoints);
- `loading`: names checked against the model before anything is read, then each rank reads only its regions
  (``torch.distributed.checkpoint`` plans them; ZeRO-3's flat partitions from the rows they cover);
- `saving`: the whole model streamed to rank 0 one tensor at a time (``ctx.full_state_dict(rank0_only=True)``,
  ``ctx.save_weights`` writing Hugging Face style safetensors shards);
- `adapters`: a peft model's adapters gathered from every rank and saved in peft's format
  (``ctx.save_weights(dir, adapters_only=True)``), or merged into the base weights
  (``ctx.full_state_dict(merged=True)``).

Like `dtrain_magic.parallel`, this package knows no backend and no strategy class: strategies call it.
"""
