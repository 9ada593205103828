from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from switchyard.cli import app


def test_schema_export_writes_one_file_per_topic(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["schema", "export", str(tmp_path)])
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "queries.schema.json" in names and "dead-letters.schema.json" in names
    query = json.loads((tmp_path / "queries.schema.json").read_text())
    assert "ttft_slo_ms" in query["properties"]
