"""Real Kafka producers nobody here wrote, for tests: the Kafka console producer (the
broker's own jars, ``kafka.tools.ConsoleProducer``) and Debian's ``kcat`` (librdkafka).

Each takes (key, value) pairs, one record per line (keys and values must not contain a
tab or a newline), and a compression codec (``none``, ``gzip``, ``lz4``, ``snappy``,
``zstd``). librdkafka sends a batch uncompressed when compression does not make it
smaller, so give kcat values that compress (repeated words do).
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from switchyard.services import KAFKA_DIR, ensure_kcat, kafka_libs

CODECS = ("gzip", "lz4", "snappy", "zstd")


def _lines(records: Sequence[tuple[bytes, bytes]]) -> bytes:
    for key, value in records:
        if b"\t" in key + value or b"\n" in key + value:
            raise ValueError(f"record {key!r}: a tab or newline cannot go through a line producer")
    return b"".join(key + b"\t" + value + b"\n" for key, value in records)


def console_produce(
    bootstrap: str, topic: str, records: Sequence[tuple[bytes, bytes]], codec: str
) -> None:
    """``kafka.tools.ConsoleProducer --compression-codec CODEC`` (acks=all), one batch per flush."""
    libs = kafka_libs()
    cmd = [
        "java", "-Xmx256m", f"-Dlog4j.configuration=file:{KAFKA_DIR / 'log4j.properties'}",
        "-cp", f"{libs}/*", "kafka.tools.ConsoleProducer",
        "--bootstrap-server", bootstrap, "--topic", topic, "--compression-codec", codec,
        "--request-required-acks", "all",
        "--property", "parse.key=true", "--property", "key.separator=\t",
    ]  # fmt: skip
    proc = subprocess.run(cmd, input=_lines(records), capture_output=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"console producer ({codec}) failed: {proc.stderr.decode()[-2000:]}")


def kcat_produce(
    bootstrap: str, topic: str, records: Sequence[tuple[bytes, bytes]], codec: str
) -> None:
    """``kcat -P -z CODEC -K '\\t'`` (acks=all), installed from Debian when missing."""
    cmd = [
        ensure_kcat(), "-P", "-b", bootstrap, "-t", topic, "-z", codec, "-K", "\t",
        "-X", "acks=all", "-X", "linger.ms=50",
    ]  # fmt: skip
    proc = subprocess.run(cmd, input=_lines(records), capture_output=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"kcat ({codec}) failed: {proc.stderr.decode()[-2000:]}")
