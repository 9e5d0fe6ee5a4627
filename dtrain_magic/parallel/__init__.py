"""Model parallelism for the DDP and FSDP strategies (``--tp``, ``--pp``; see docs/model-parallel.md).

One idea per module: `mesh` (the (pp, dp, tp) layout), `tensor_parallel` (plans: automatic, Hugging Face, the
user's), `hf_gpt2` (GPT-2's Conv1D and fused q/k/v), `pipeline_split` (cutting a model into stages), `pipeline`
(running a stage under a schedule), `state` (same start, optimizer, gradients and full state across the mesh),
`model_parallel` (`ModelParallel`: what a strategy calls). Nothing here knows a backend; strategies use it.
"""
