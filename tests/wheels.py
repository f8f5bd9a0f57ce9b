"""Tiny wheels the tests make themselves, offline: a package of one module, as pip or uv would
install it from a find-links directory."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def make_wheel(
    directory: Path, name: str, version: str, source: str, requires: tuple[str, ...] = (), extra_files: dict[str, str] | None = None
) -> Path:
    """`<name>-<version>-py3-none-any.whl` in `directory`, holding `<name>/__init__.py` with `source`
    (and `extra_files`, by their path in site-packages)."""
    directory.mkdir(parents=True, exist_ok=True)
    dist_info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": source,
        **(extra_files or {}),
        f"{dist_info}/METADATA": "Metadata-Version: 2.1\n" f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: trainyard-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{path},sha256={_digest(text)},{len(text.encode())}" for path, text in files.items()] + [f"{dist_info}/RECORD,,"]
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
        archive.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return wheel


def _digest(text: str) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
