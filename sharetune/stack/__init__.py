"""The operator stack: the whole topology as local processes on one host (local.py: Stack) and the
supervisor process `sharetune up` leaves behind (supervisor.py).

`from sharetune.stack import Stack` is the documented way to run a stack from Python; it is resolved on
first use so that the CLI, which imports the supervisor module for every command, does not pay for
importing the node agent."""
from __future__ import annotations

__all__ = ["Stack"]


def __getattr__(name: str):
    if name == "Stack":
        from sharetune.stack.local import Stack

        return Stack
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
