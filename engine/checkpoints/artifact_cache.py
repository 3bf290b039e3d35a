"""Directories radixserve builds once and reuses (the demo model, converted GGUF checkpoints).

``build_once(final, write, required)`` returns ``final`` when it already holds every required
file, else has ``write`` fill a private temporary directory next to it and renames that into
place in one step. Concurrent builders on one machine (parallel test processes, two servers or
replicas started at once) take turns on a lock file beside it, so the later ones find the
first one's result instead of building it again; where the lock is not to be had they each
build privately, the first rename wins, and nobody ever sees a half-written directory. A
damaged directory (files deleted by hand) is moved aside and rebuilt; a builder that died
mid-write leaves a temporary directory, swept an hour later.

Cache location: ``$RADIXSERVE_CACHE``, else ``$XDG_CACHE_HOME/radixserve``, else
``~/.cache/radixserve``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

STALE_TEMP_SECONDS = 3600


def default_cache_dir() -> Path:
    """Where radixserve caches built artefacts for this user."""
    if os.environ.get("RADIXSERVE_CACHE"):
        return Path(os.environ["RADIXSERVE_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "radixserve"
    return Path.home() / ".cache" / "radixserve"


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def update_json(path: Path, change: Callable[[dict], None]) -> None:
    """Apply ``change`` to the JSON object in ``path`` (empty if missing or unreadable) and write
    it back in one rename, one process at a time (a lock file beside it): small records several
    processes add to, such as the linear forms timed for each CPU beside a converted checkpoint.
    """
    with _turn(path.with_name(f".{path.name}.lock")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
        if not isinstance(data, dict):
            data = {}
        change(data)
        fd, staging = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
        os.close(fd)
        try:
            write_json(Path(staging), data)
            os.chmod(staging, 0o644)
            os.rename(staging, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging)


def is_complete(directory: Path, required: Sequence[str]) -> bool:
    return all((directory / name).is_file() for name in required)


def _sweep_stale_temps(cache_dir: Path) -> None:
    cutoff = time.time() - STALE_TEMP_SECONDS
    for path in cache_dir.glob(".*.tmp*"):
        try:
            if path.stat().st_mtime < cutoff:
                shutil.rmtree(path, ignore_errors=True)
        except FileNotFoundError:
            continue  # another builder swept it first


def build_once(final: Path, write: Callable[[Path], None], required: Sequence[str]) -> Path:
    """``final``, built by ``write(staging_dir)`` unless it already holds ``required``."""
    if is_complete(final, required):
        return final
    cache_dir = final.parent
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _turn(cache_dir / f".{final.name}.lock"):
        return _build(final, write, required)


@contextlib.contextmanager
def _turn(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``lock_path`` (released with the process, should it die);
    without one (a filesystem that refuses locks) go on unlocked."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


def _build(final: Path, write: Callable[[Path], None], required: Sequence[str]) -> Path:
    if is_complete(final, required):
        return final  # built by the builder whose turn came first
    cache_dir = final.parent
    _sweep_stale_temps(cache_dir)
    if final.exists() and not is_complete(final, required):
        # Move it aside in one step, then rebuild. The second completeness check keeps us from
        # moving a copy another builder just renamed in.
        trash = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-trash-", dir=cache_dir))
        try:
            os.rename(final, trash / final.name)
        except FileNotFoundError:
            pass  # another builder moved it already
        shutil.rmtree(trash, ignore_errors=True)

    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_dir))
    try:
        write(staging)
        staging.chmod(0o755)  # mkdtemp makes it private; the result is ordinary cached data
        os.rename(staging, final)
    except OSError:
        # Lost the race: another builder renamed its identical copy into place first.
        if not is_complete(final, required):
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final
