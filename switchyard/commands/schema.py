"""``switchyard schema export DIR``: JSON Schema for every topic body."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    schema_app = typer.Typer(help="Wire schemas of every topic body.", no_args_is_help=True)
    app.add_typer(schema_app, name="schema")

    @schema_app.command("export")
    def export(
        out_dir: Path = typer.Argument(..., help="Folder to write <topic>.schema.json into"),
    ) -> None:
        """Write one JSON Schema file per topic body."""
        from schemas import TOPIC_BODIES

        out_dir.mkdir(parents=True, exist_ok=True)
        for topic, model in TOPIC_BODIES.items():
            name = topic.replace("<", "").replace(">", "")
            path = out_dir / f"{name}.schema.json"
            path.write_text(
                json.dumps(model.model_json_schema(), indent=2) + "\n", encoding="utf-8"
            )
            typer.echo(f"{topic:20s} -> {path}")
