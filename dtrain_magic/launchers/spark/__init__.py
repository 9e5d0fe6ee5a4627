"""``--backend spark``: pyspark's TorchDistributor. `driver` (the notebook's side: session, launch, cancel),
`worker` (what each torchrun process runs), `diagnostics` (pure checks and failure summaries)."""

from __future__ import annotations

from .diagnostics import (
    MIN_JAVA,
    check_java,
    gpu_setting_error,
    is_loopback_master,
    java_command,
    one_line_reason,
    parse_java_version,
    torchrun_root_cause,
)
from .driver import SparkJob, SparkLauncher

__all__ = [
    "MIN_JAVA", "SparkJob", "SparkLauncher", "check_java", "gpu_setting_error", "is_loopback_master", "java_command",
    "one_line_reason", "parse_java_version", "torchrun_root_cause",
]
