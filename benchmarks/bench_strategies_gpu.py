"""The same benchmark as bench_strategies.py on GPUs (``--gpu``, NCCL), when CUDA is available.

Memory is ``torch.cuda.max_memory_allocated`` per process (above what was allocated before the model
was built); one process per GPU, so ``-n`` defaults to the number of visible GPUs. fp16 is allowed here.

    .venv/bin/python benchmarks/bench_strategies_gpu.py                      # all visible GPUs, bf16
    .venv/bin/python benchmarks/bench_strategies_gpu.py -n 2 --precision fp32 --width 4096
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench_strategies_gpu: CUDA is not available on this machine; run benchmarks/bench_strategies.py for CPU")
        return 0
    argv = list(sys.argv[1:] if argv is None else argv)
    if not any(a in ("-n", "--num-processes") for a in argv):
        argv += ["-n", str(torch.cuda.device_count())]
    if "--precision" not in argv:
        argv += ["--precision", "bf16"]
    if "--width" not in argv:
        argv += ["--width", "4096", "--layers", "8", "--micro", "16", "--steps", "30", "--warmup", "5"]
    import bench_strategies

    os.environ["DS_ACCELERATOR"] = "cuda"
    bench_strategies.run(argv, gpu=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
