"""Print the fault suite's measured figures as Markdown (for docs/reliability.md).

    python tests/faults/faults_report.py [FIGURES.json]

FIGURES.json defaults to ``$SWITCHYARD_FAULTS_FIGURES``, else
``$SWITCHYARD_HOME/faults-figures.json`` (``make test`` writes
``.switchyard/test/faults-figures.json``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_harness import figures_path  # noqa: E402

TITLES = {
    "1_router_kill9": "1. kill -9 the router mid 10,000-query replay",
    "2_worker_kill9": "2. kill -9 a worker mid-stream",
    "3_redis_outage": "3. Redis stopped for 30 s",
    "4_kafka_restart": "4. Kafka broker killed and restarted mid-stream",
    "5_heartbeat_stop": "5. An instance stops heart-beating (worker SIGSTOP)",
    "6_hostile_input": "6. 100,000 hostile messages interleaved with valid traffic",
    "7_adversarial_budget": "7. Adversarial budget bursts",
    "8_security": "8. Security from configuration",
    "9_router_group": "9. Three routers in one group: kill -9 one, SIGSTOP another for 30 s",
    "10_redis_failover": "10. Redis primary kill -9, replica promoted",
    "11_engine_faults": "11. Engines killed, frozen and failing under the vllm backend",
}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, dict)):
        return "`" + json.dumps(value)[:300] + "`"
    return str(value)


def render(data: dict[str, Any]) -> str:
    out: list[str] = []
    for key in sorted(data):
        figures = dict(data[key])
        command = figures.pop("command", "")
        recorded = figures.pop("recorded_at", "")
        out.append(f"### {TITLES.get(key, key)}\n")
        out.append("| figure | value |\n| --- | --- |")
        out += [f"| {name} | {_fmt(value)} |" for name, value in figures.items()]
        out.append(f"\nReproduce: `{command}` (recorded {recorded})\n")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else figures_path()
    print(render(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
