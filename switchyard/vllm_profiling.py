"""Run the step-by-step vLLM profile (``switchyard profile-vllm``): the I/O half.

Starts ``services/vllm/profile_steps.py`` with the engine venv's Python
(``switchyard.vllm_env``), in its own process group, with the batch compositions of
``offline.vllm_profile.sweep_plan``; it writes the steps file this module hands to
``offline.vllm_profile`` for the fit.

The engine runs with ``OMP_NUM_THREADS`` = ``threads`` (1 by default: what a ``vllm serve``
worker uses on this machine kind, and the setting least disturbed by other processes) and, by
default (``executor="mp"``), with the model in a worker process of its own that vLLM pins to a
core, as ``vllm serve`` runs it: each step then pays the engine core's round trip to its
worker, as a served step does (on the 2-core CPU machine: c0 +1.4 ms, c1 +6% over the model in
the engine core's own process).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from offline.vllm_profile import sweep_plan
from switchyard import vllm_env
from wiring.paths import REPO_ROOT, state_dir

DRIVER = REPO_ROOT / "services" / "vllm" / "profile_steps.py"


class ProfileError(RuntimeError):
    """The driver failed; the message carries its log's tail."""


@dataclass(frozen=True)
class ProfileSettings:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    kv_cache_gib: int = 1
    threads: int = 1
    quick: bool = False
    reps: int = 3
    decode_steps: int = 6
    seed: int = 0
    executor: str = "mp"  # "mp": the model in a pinned worker process, as `vllm serve` runs it

    def __post_init__(self) -> None:
        for k in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_gib",
                  "threads", "reps", "decode_steps"):  # fmt: skip
            if getattr(self, k) < 1:
                raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(self, k)}")
        if self.executor not in ("mp", "uni"):
            raise ValueError(f"--executor must be mp or uni, got {self.executor!r}")


def run_driver(
    model_dir: Path,
    name: str,
    steps_out: Path,
    settings: ProfileSettings,
    *,
    command: str = "",
    timeout_s: float = 3600.0,
    log: Path | None = None,
) -> dict[str, float]:
    """Profile ``model_dir`` into ``steps_out``; return the driver's summary (steps, seconds)."""
    if not (model_dir / "config.json").is_file():
        raise ProfileError(f"--model {model_dir}: no config.json there (a model directory?)")
    env = vllm_env.install()
    plan = sweep_plan(
        settings.max_num_seqs,
        settings.max_num_batched_tokens,
        settings.max_model_len,
        quick=settings.quick,
        reps=settings.reps,
        decode_steps=settings.decode_steps,
    )
    run = state_dir() / "profile-vllm"
    run.mkdir(parents=True, exist_ok=True)
    log = log or run / "driver.log"
    steps_out.parent.mkdir(parents=True, exist_ok=True)
    child_env = vllm_env.engine_env()
    child_env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE=str(settings.kv_cache_gib),
        VLLM_CACHE_ROOT=str(run / "cache"),
        OMP_NUM_THREADS=str(settings.threads),
    )
    with tempfile.NamedTemporaryFile("w", suffix=".json", dir=run, delete=False) as fh:
        json.dump(plan, fh)
        plan_file = Path(fh.name)
    raw = steps_out.with_suffix("") if steps_out.suffix == ".gz" else steps_out
    cmd = [
        str(env.python), str(DRIVER),
        "--model", str(model_dir), "--name", name, "--plan", str(plan_file), "--out", str(raw),
        "--max-num-seqs", str(settings.max_num_seqs),
        "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
        "--max-model-len", str(settings.max_model_len),
        "--seed", str(settings.seed), "--command", command, "--executor", settings.executor,
    ]  # fmt: skip
    t0 = time.monotonic()
    try:
        with open(log, "wb") as out:
            child = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env, start_new_session=True
            )
            vllm_env.prioritise_session(child.pid)
            try:
                rc = child.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                raise ProfileError(
                    f"the profile driver ran past {timeout_s:.0f} s; log: {log}"
                ) from None
            except BaseException:
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
                raise
    finally:
        plan_file.unlink(missing_ok=True)
    text = log.read_text(errors="replace")
    if rc != 0:
        raise ProfileError(f"the profile driver failed ({rc}); log {log}:\n{text[-3000:]}")
    summary: dict[str, float] = {}
    for line in reversed(text.splitlines()):
        if line.startswith("{") and '"steps"' in line:
            summary = json.loads(line)
            break
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    if raw != steps_out:
        import gzip

        steps_out.write_bytes(gzip.compress(raw.read_bytes(), mtime=0))
        raw.unlink()
    return summary


def command_line(argv: list[str] | None = None) -> str:
    """The user's command as typed, with every absolute path cut to its last part (a profile
    names no directory of the machine it was measured on)."""
    args = list(sys.argv if argv is None else argv)
    out = []
    for a in args:
        key, eq, val = a.partition("=") if a.startswith("--") else ("", "", a)
        if val.startswith("/"):
            val = Path(val).name
        out.append(f"{key}{eq}{val}")
    return shlex.join(out)
