"""The one command line: ``switchyard …``.

Each area of the product registers its commands from ``switchyard/commands/<area>.py``
(a ``register(app)`` function), so a new command never touches this file's logic.
"""

from __future__ import annotations

import importlib
import pkgutil

import typer

import switchyard.commands as commands_pkg

app = typer.Typer(
    name="switchyard",
    help="Streaming LLM query router: robust batch ILP with simulated-TTFT checks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

for _info in sorted(pkgutil.iter_modules(commands_pkg.__path__), key=lambda i: i.name):
    _module = importlib.import_module(f"switchyard.commands.{_info.name}")
    _module.register(app)


if __name__ == "__main__":
    app()
