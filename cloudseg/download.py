"""`cloudseg download` (`make data`): the competition's files from Kaggle into a folder, through
the kaggle library (the `kaggle` extra, which `make data` installs). Every way it fails is one
line that names what to check, where the library left to itself prints a page of help, a long
nested message or a traceback.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import tempfile
import zipfile
import zlib
from pathlib import Path

from cloudseg.task import COMPETITION, TRAIN_CSV

RULES_URL = f"https://www.kaggle.com/competitions/{COMPETITION}/rules"
CREDENTIALS = ("check KAGGLE_API_TOKEN or ~/.kaggle/access_token (a new token: kaggle.com > Settings > API), "
               "`kaggle auth login`'s ~/.kaggle/credentials.json, or the older KAGGLE_USERNAME and KAGGLE_KEY "
               "or ~/.kaggle/kaggle.json")
REFUSALS = {
    401: f"Kaggle refused the credentials (HTTP 401): {CREDENTIALS}",
    403: f"Kaggle refused the download (HTTP 403): accept the competition's rules at {RULES_URL} "
         "with the account of your API token",
}
NETWORK = "check the network connection and any proxy setting (HTTPS_PROXY, HTTP_PROXY)"


def download(out: Path) -> None:
    """Download the competition's zip into a hidden folder beside `out` (the kaggle library
    resumes a partial one there), then unpack it into `out`. `out` appears only with the data in
    it: `make train` takes an existing data/kaggle for the real data."""
    api, out = kaggle_api(), out.resolve()
    staging = out.parent / f".{out.name}-download"
    try:
        api.competition_download_files(COMPETITION, path=str(staging), quiet=False)
    except Exception as error:  # the library raises requests' exceptions, which are OSErrors
        raise RuntimeError(failure_line(error, staging)) from error
    unpack(staging / f"{COMPETITION}.zip", out)
    shutil.rmtree(staging)


def kaggle_api():
    """The kaggle library's API, authenticated. Its import authenticates too, and prints a page of
    help when that fails: kept from the user, who gets one line."""
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            from kaggle.api.kaggle_api_extended import KaggleApi
        except Exception as error:  # ModuleNotFoundError (kaggle 2.2.5 without six), or any import-time failure
            raise RuntimeError(f"the kaggle library does not import ({type(error).__name__}: {error}): "
                               "install it with `make data` (the `kaggle` extra of pyproject.toml)") from error
        api = KaggleApi()
        try:
            api.authenticate()
        except SystemExit as error:
            raise RuntimeError(f"no usable Kaggle API credentials: {CREDENTIALS}") from error
        except Exception as error:  # an API token is checked with Kaggle: requests' exceptions
            raise RuntimeError(failure_line(error, Path.home() / ".kaggle")) from error
    return api


def failure_line(error: Exception, out: Path) -> str:
    """What went wrong in a download, and what to check. Duck-typed on requests' exceptions
    (`response`, `request`), which come with the kaggle library."""
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    if status in REFUSALS:
        return REFUSALS[status]
    if status is not None:
        return f"Kaggle answered HTTP {status} ({error}): check {RULES_URL} and your API token"
    if hasattr(error, "request"):  # a requests error without a response: Kaggle was never reached
        return f"could not reach Kaggle ({type(error).__name__}: {short_reason(error)}): {NETWORK}"
    if isinstance(error, OSError):
        return f"could not write the download into {out}: {error.strerror or error}"
    return f"the download failed ({type(error).__name__}: {error}): {NETWORK}"


def short_reason(error: Exception) -> str:
    """The operating system's words ("[Errno 111] Connection refused") from requests' nested
    message, or the whole message when it has none."""
    found = re.search(r"\[Errno -?\d+\] [^'\")]+", str(error))
    return found.group(0) if found else str(error)


def unpack(archive: Path, out: Path) -> None:
    """Unzip `archive` into a hidden folder beside `out`, then move each entry into `out`, train.csv
    last (a folder with one is finished data; an older one goes first): an interrupted unpacking
    leaves the archive for the next run, not half the images under a train.csv."""
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-unpacking-") as unpacked:
            with zipfile.ZipFile(archive) as bundle:
                bundle.extractall(unpacked)
            out.mkdir(exist_ok=True)
            (out / TRAIN_CSV).unlink(missing_ok=True)
            for entry in sorted(Path(unpacked).iterdir(), key=lambda entry: entry.name == TRAIN_CSV):
                target = out / entry.name
                if target.is_dir():
                    shutil.rmtree(target)
                os.replace(entry, target)
    except (zipfile.BadZipFile, zlib.error, EOFError) as error:  # cut short, or its compressed data damaged
        raise RuntimeError(f"{archive} is not a whole zip ({error}): delete it and download again") from error
