"""Python modules run as child processes, a few at a time: the share matrix's TVM work (a kept tuning compiled
again, a tuning's task kernels built) in processes of their own, so one that crashes loses only its own result."""
from __future__ import annotations

import subprocess
import sys


def run_modules(commands: dict[str, list[str]], width: int) -> dict[str, tuple[int, str]]:
    """Each command (name -> `python -m` arguments) in a child, at most `width` at once: name -> (its exit
    code, the last line it printed)."""
    names, out = list(commands), {}
    for i in range(0, len(names), max(1, width)):
        running = [(name, subprocess.Popen([sys.executable, "-m", *commands[name]], stdout=subprocess.PIPE,
                                           stderr=subprocess.STDOUT, text=True)) for name in names[i:i + max(1, width)]]
        for name, proc in running:
            output, _ = proc.communicate()
            out[name] = (proc.returncode, (output.strip().splitlines() or ["?"])[-1])
    return out
