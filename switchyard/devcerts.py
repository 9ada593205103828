"""Throwaway TLS material for local services and tests: a CA and a server cert for 127.0.0.1.

Made with the ``openssl`` command (on every Debian machine); the server key is PKCS#8 PEM,
which both redis-server and Kafka's PEM keystore accept.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TlsFiles:
    ca: str  # CA certificate (clients trust this)
    cert: str  # server certificate, signed by the CA, SAN IP 127.0.0.1 and DNS localhost
    key: str  # server private key, unencrypted PKCS#8 PEM
    keystore: str  # key + cert in one PEM file (Kafka's ssl.keystore.type=PEM)


def make_dev_certs(out_dir: Path, days: int = 2) -> TlsFiles:
    if shutil.which("openssl") is None:
        raise RuntimeError("openssl is not installed: apt-get install openssl")
    out_dir.mkdir(parents=True, exist_ok=True)
    ca_key, ca = out_dir / "ca.key", out_dir / "ca.pem"
    key, csr, cert = out_dir / "server.key", out_dir / "server.csr", out_dir / "server.pem"
    ext = out_dir / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n")

    def run(*args: str) -> None:
        proc = subprocess.run(["openssl", *args], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"openssl {args[0]} failed: {proc.stderr.strip()[-500:]}")

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca),
        "-days", str(days), "-subj", "/CN=switchyard-dev-ca")  # fmt: skip
    run("genpkey", "-algorithm", "RSA", "-pkeyopt", "rsa_keygen_bits:2048", "-out", str(key))
    run("req", "-new", "-key", str(key), "-out", str(csr), "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
        "-out", str(cert), "-days", str(days), "-extfile", str(ext))  # fmt: skip
    keystore = out_dir / "keystore.pem"
    keystore.write_text(key.read_text() + cert.read_text())
    for p in (ca_key, key, keystore):
        p.chmod(0o600)
    return TlsFiles(ca=str(ca), cert=str(cert), key=str(key), keystore=str(keystore))
