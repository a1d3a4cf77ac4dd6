"""Writing files so that a reader never sees half of one: every file the data path writes
(folds.csv, the run directory, oof.npz, postprocess.json, the submission) goes through here."""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import re
import secrets
from pathlib import Path

# Errors of a filesystem that cannot fsync a directory (some FUSE and network mounts).
NO_DIRECTORY_SYNC = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}


def cache_folder() -> Path:
    """cloudseg's per-user cache folder, which outlives a reboot and a job's private /tmp:
    $XDG_CACHE_HOME/cloudseg, else ~/.cache/cloudseg (inductor's compiled graphs, remembered memory
    probes). Path.home() raises RuntimeError where there is no home folder."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cloudseg"


@contextlib.contextmanager
def atomic_path(path: str | Path):
    """Yield a temporary path beside `path` for the caller to write; on success rename it over
    `path`, else delete it.

    The rename is atomic on POSIX, so an interrupted writer leaves the old file (or none),
    never a partial one. The file is fsynced before the rename and its directory after it, so
    a power loss cannot leave an empty file under the new name either. The file gets the mode
    a plain open() would give it (0666 less the umask).
    """
    path = Path(path)
    if path.is_dir():  # else the rename's error names the temporary file
        raise IsADirectoryError(f"{path}: is a folder; a file cannot be written over it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_hidden_file(path)
    try:
        yield tmp
        fsync(tmp)  # the caller has written and closed it: its data reach the disk before its name
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


@contextlib.contextmanager
def published_together():
    """A list for the caller to add each file it publishes to (renamed into place) in the block;
    on an error they are removed again: files that stand only together, such as a scene's maps
    and the NAME.json that marks it done."""
    published: list[Path] = []
    try:
        yield published
    except BaseException:
        for path in published:
            Path(path).unlink(missing_ok=True)
        raise


def remove(path: Path) -> None:
    """Delete `path` where it exists, durably: before the files it describes are replaced, so that
    an interruption leaves neither it beside the new files nor it back after a power loss."""
    try:
        Path(path).unlink()
    except FileNotFoundError:
        return
    fsync_directory(Path(path).parent)


def new_hidden_file(path: Path) -> Path:
    """An empty file `.NAME.RANDOM.tmp` beside `path`, created as open() creates files.

    Created with mode 0666, the kernel applies the umask (and a directory's default ACL) itself,
    exactly as for open(): reading the umask would mean os.umask(), which sets it for every
    thread at once. O_EXCL never reuses an existing file; with 64 random bits a clash is not
    expected, and would be an error rather than an overwrite.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    return tmp


HIDDEN_FILE = re.compile(r"\.(?P<name>.+)\.[0-9a-f]{16}\.tmp")  # new_hidden_file's names


def published_name(path: Path) -> Path:
    """The path a `new_hidden_file` temporary is written for (itself for any other path): what an
    error about the temporary names."""
    match = HIDDEN_FILE.fullmatch(path.name)
    return path.with_name(match["name"]) if match else path


def left_behind(paths: list[Path]) -> list[Path]:
    """The temporaries `new_hidden_file` made beside any of `paths` that are still there: a killed
    process's (nothing else removes them), or one writing that path now. Each folder listed once."""
    wanted = collections.defaultdict(set)
    for path in paths:
        wanted[Path(path).parent].add(Path(path).name)
    return [entry for folder, names in wanted.items() if folder.is_dir() for entry in folder.iterdir()
            if (match := HIDDEN_FILE.fullmatch(entry.name)) and match["name"] in names]


def fsync(path: Path, flags: int = os.O_RDONLY) -> None:
    descriptor = os.open(path, flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable, where the filesystem can."""
    try:
        fsync(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as error:
        if error.errno not in NO_DIRECTORY_SYNC:
            raise
