"""A notebook process for test_sessions.py: ``python session_notebook.py BACKEND RESULTS.json``, run in the notebook's
own directory (and process group, as a Jupyter kernel is). It starts one interactive session on BACKEND, runs the
checks of `session_checks.plan` on it in order, writes each one's outcome to RESULTS.json as it goes, prints a
verdict line, and exits with the session open (what happens at a kernel's exit: nothing may outlive it)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import session_checks as checks  # noqa: E402 (after the path)


def main(backend: str, results_path: str) -> None:
    results: dict[str, dict] = {}
    notebook = checks.Notebook.open(Path.cwd(), backend)
    for name, check in checks.plan(backend):
        started = time.monotonic()
        try:
            note = check(notebook)
            results[name] = {"ok": True, "s": round(time.monotonic() - started, 2), "note": note or ""}
        except BaseException:  # a check's failure (or a KeyboardInterrupt that escaped a cell) is its result
            results[name] = {"ok": False, "s": round(time.monotonic() - started, 2), "error": traceback.format_exc()}
        Path(results_path).write_text(json.dumps(results, indent=1))
        print(f"CHECK {name}: {'ok' if results[name]['ok'] else 'FAILED'} ({results[name]['s']} s) "
              f"{results[name].get('note', '')}", flush=True)
        if name == "start" and not results[name]["ok"]:
            break
    print("VERDICT", "ok" if all(result["ok"] for result in results.values()) else "failed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
