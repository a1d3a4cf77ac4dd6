"""`make data` with fake credentials, as far as a machine without Kaggle access goes: the kaggle
extra installs and its CLI starts, and what stops the download reaches the user as one line.

CPU only. No address outside this machine is contacted: Kaggle's traffic goes through an HTTPS
proxy on a loopback port that refuses every connection, and uv runs offline once the extra is in
(installing it needs the package registry, as make install does).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import zipfile
from pathlib import Path

import pytest

from cloudseg.download import CREDENTIALS, RULES_URL, unpack

ROOT = Path(__file__).resolve().parents[1]
KAGGLE_VERSION = re.search(r'"kaggle==([^"]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
UV = shutil.which("uv") or str(ROOT / ".tools" / "bin" / "uv")

needs_make_and_uv = pytest.mark.skipif(shutil.which("make") is None or not Path(UV).exists(),
                                       reason="needs GNU make and uv (make install brings uv)")


@pytest.fixture
def refusing_proxy():
    """A loopback address whose port is bound but not listening: every connection to it is
    refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


# What uv says when the package registry does not answer (or uv is offline and its cache lacks a package).
REGISTRY_UNREACHABLE = re.compile(r"Failed to fetch|error sending request|dns error|tcp connect error|"
                                  r"network was disabled")


def install_kaggle_extra(venv: Path, env: dict | None = None) -> None:
    """The Makefile's own rules: make install, then the kaggle extra. uv links the files to its
    cache (symlinks: seconds, and no copy of torch on any filesystem); the PyTorch backend of the
    shared .venv is reused, so that uv's cache has the build; no bytecode compiled (BYTECODE=: 35 s of
    2 cores for a venv nothing imports torch from). Where the package registry cannot be
    reached (an offline GPU cluster), the test skips, saying so, instead of erring."""
    backend = ROOT / ".venv" / ".torch-backend"
    backend = backend.read_text().strip() if backend.exists() else ""
    result = subprocess.run(["make", "--no-print-directory", f"{venv}/.kaggle-installed", f"VENV={venv}",
                             f"TORCH_BACKEND={backend}", "BYTECODE="], cwd=ROOT, env={**(env or os.environ), "UV_LINK_MODE": "symlink"},
                            capture_output=True, text=True, timeout=600)
    said = result.stdout + result.stderr
    unreachable = REGISTRY_UNREACHABLE.search(said)
    if result.returncode and unreachable:
        line = next(line for line in said.splitlines() if unreachable.group() in line).strip()
        pytest.skip(f"installing the kaggle extra needs the package registry, which uv cannot reach here ({line})")
    assert result.returncode == 0, said[-3000:]


@pytest.fixture(scope="module")
def kaggle_venv(tmp_path_factory):
    """A throwaway .venv with the kaggle extra; the shared .venv is left alone."""
    venv = tmp_path_factory.mktemp("kaggle") / "venv"
    install_kaggle_extra(venv)
    return venv


def fake_user_env(home: Path, proxy: str) -> dict:
    """Fake credentials, HOME in a temporary folder, every HTTP(S) request through `proxy` (no
    NO_PROXY to bypass it), uv offline and on the real user's cache."""
    uv_cache = subprocess.run([UV, "cache", "dir"], capture_output=True, text=True, check=True).stdout.strip()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KAGGLE_") and k.lower() not in ("no_proxy", "all_proxy")}
    env.update({name: proxy for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")})
    home.mkdir(exist_ok=True)
    return {**env, "HOME": str(home), "KAGGLE_USERNAME": "nobody", "KAGGLE_KEY": "0" * 32,
            "UV_CACHE_DIR": uv_cache, "UV_OFFLINE": "1"}


def make_data(venv: Path, tmp_path: Path, proxy: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "data", f"VENV={venv}", f"DATA={tmp_path / 'kaggle'}"],
                          cwd=ROOT, env=fake_user_env(tmp_path / "home", proxy), capture_output=True, text=True,
                          timeout=300)


@needs_make_and_uv
def test_make_data_starts_the_cli_and_reports_an_unreachable_kaggle_in_one_line(kaggle_venv, tmp_path, refusing_proxy):
    """Would catch: the kaggle extra missing a dependency (kaggle 2.2.5 without six: a traceback
    before any network call, today's main), make data not installing the pinned CLI, and a
    network failure surfacing as a traceback or as a line that does not say what to check.
    Also that nothing is left at DATA, where make train would take it for the real data."""
    result = make_data(kaggle_venv, tmp_path, refusing_proxy)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert f"Kaggle CLI {KAGGLE_VERSION}" in result.stdout  # the installed CLI started
    assert "Traceback" not in output
    errors = [line for line in result.stderr.splitlines() if line.startswith("cloudseg: error:")]
    assert len(errors) == 1, output
    assert "could not reach Kaggle" in errors[0] and "Connection refused" in errors[0]
    assert "check the network connection and any proxy setting" in errors[0]
    assert not (tmp_path / "kaggle").exists()


@needs_make_and_uv
@pytest.mark.parametrize("credentials", [None, ".kaggle/access_token", ".kaggle/credentials.json", "config/kaggle.json"])
def test_make_data_looks_for_credentials_where_the_kaggle_library_does(kaggle_venv, tmp_path, refusing_proxy,
                                                                       credentials):
    """CPU. No KAGGLE_ variable; HOME holds an API token file, `kaggle auth login`'s OAuth file, a
    kaggle.json under KAGGLE_CONFIG_DIR, or nothing. Would catch: make data refusing before the
    download a user whose credentials the library would take (kaggle.json alone was looked for),
    or no longer refusing, before installing anything, a user who has none; an API token checked
    with an unreachable Kaggle ending in a traceback (kaggle_api caught only SystemExit)."""
    home = tmp_path / "home"
    env = {k: v for k, v in fake_user_env(home, refusing_proxy).items() if not k.startswith("KAGGLE_")}
    if credentials:
        (home / credentials).parent.mkdir(parents=True)
        (home / credentials).write_text('{"username": "nobody", "key": "0"}' if credentials.endswith("json") else "0")
        env["KAGGLE_CONFIG_DIR"] = str(home / "config")
    result = subprocess.run(["make", "--no-print-directory", "data", f"VENV={kaggle_venv}",
                             f"DATA={tmp_path / 'kaggle'}"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    refused = "make data: no Kaggle API credentials. Create a token on kaggle.com (Settings > API),"
    assert result.returncode != 0 and "Traceback" not in result.stdout + result.stderr
    assert (refused in result.stdout.splitlines()) == (credentials is None), result.stdout + result.stderr
    assert (f"Kaggle CLI {KAGGLE_VERSION}" in result.stdout) == (credentials is not None)
    if credentials:  # the token checked with an unreachable Kaggle, the fake OAuth file refused: one line each
        errors = [line for line in result.stderr.splitlines() if line.startswith("cloudseg: error:")]
        assert len(errors) == 1, result.stderr


@needs_make_and_uv
def test_a_cli_that_does_not_start_is_one_line_with_a_fix_that_works(kaggle_venv, tmp_path, refusing_proxy):
    """six removed, as kaggle 2.2.5 was once installed. Would catch: make data downloading with a
    CLI that does not import, reporting it as a traceback or without the fix, or a fix (the stamp
    removed, make data again) that does not reinstall what is missing."""
    python = str(kaggle_venv / "bin" / "python")
    subprocess.run([UV, "pip", "uninstall", "-q", "--python", python, "six"], check=True)
    try:
        result = make_data(kaggle_venv, tmp_path, refusing_proxy)
        assert result.returncode != 0 and "Traceback" not in result.stdout + result.stderr
        assert f"make data: the kaggle CLI in {kaggle_venv} does not start (ModuleNotFoundError: No module named " \
               f"'six'); reinstall it: rm {kaggle_venv}/.kaggle-installed, then make data" in result.stdout.splitlines()
        assert "cloudseg download" not in result.stdout
    finally:  # the fix named, which the other tests of this module need
        (kaggle_venv / ".kaggle-installed").unlink()
        install_kaggle_extra(kaggle_venv)
    assert subprocess.run([str(kaggle_venv / "bin" / "kaggle"), "--version"], capture_output=True).returncode == 0


REFUSE = """
import sys, requests
from kaggle.api.kaggle_api_extended import KaggleApi
from cloudseg.cli import main

def refuse(*args, **kwargs):
    response = requests.Response()
    response.status_code = int(sys.argv[1])
    raise requests.HTTPError(f"{response.status_code} Client Error", response=response)

KaggleApi.competition_download_files = refuse
sys.exit(main(["download", "--out", sys.argv[2]]))
"""


@needs_make_and_uv
@pytest.mark.parametrize("status, what_to_check", [(401, "check KAGGLE_API_TOKEN"), (403, RULES_URL)])
def test_a_refused_download_is_one_line_that_names_what_to_check(kaggle_venv, tmp_path, refusing_proxy, status,
                                                                  what_to_check):
    """The kaggle library's download answered as Kaggle answers a wrong token (401) or rules not
    accepted (403), with requests' own exception. Would catch: a traceback, the library's page of
    help, or a line that sends the user to the network for a refusal."""
    result = subprocess.run([str(kaggle_venv / "bin" / "python"), "-c", REFUSE, str(status), str(tmp_path / "kaggle")],
                            cwd=ROOT, env=fake_user_env(tmp_path / "home", refusing_proxy), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0 and "Traceback" not in result.stdout + result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("cloudseg: error: Kaggle refused") and f"HTTP {status}" in result.stderr
    assert what_to_check in result.stderr and "network" not in result.stderr


SERVE = """
import sys, zipfile
from pathlib import Path
from kaggle.api.kaggle_api_extended import KaggleApi
from cloudseg.cli import main

def serve(self, competition, path, **kwargs):  # what the library leaves after a download
    Path(path).mkdir(parents=True)
    with zipfile.ZipFile(Path(path) / f"{competition}.zip", "w") as bundle:
        bundle.writestr("train.csv", "Image_Label,EncodedPixels\\n")
        bundle.writestr("train_images/0011165.jpg", "jpeg")

KaggleApi.competition_download_files = serve
sys.exit(main(["download", "--out", sys.argv[1]]))
"""


@needs_make_and_uv
def test_a_download_is_unpacked_into_the_folder_and_leaves_nothing_else(kaggle_venv, tmp_path, refusing_proxy):
    """The library's download stood in for by the zip it would leave. Would catch: the zip or the
    hidden download folder left behind, the files one folder too deep, or a name other than the
    library's for the zip."""
    data = tmp_path / "data"
    result = subprocess.run([str(kaggle_venv / "bin" / "python"), "-c", SERVE, str(data / "kaggle")], cwd=ROOT,
                            env=fake_user_env(tmp_path / "home", refusing_proxy), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert sorted(str(p.relative_to(data)) for p in data.rglob("*")) == [
        "kaggle", "kaggle/train.csv", "kaggle/train_images", "kaggle/train_images/0011165.jpg"]


@needs_make_and_uv
def test_no_credentials_is_one_line_not_the_library_s_page_of_help(kaggle_venv, tmp_path, refusing_proxy):
    """`cloudseg download` run by hand, with no token anywhere. Would catch: the kaggle library's
    help (printed at its import and by authenticate) reaching the user, or its SystemExit."""
    env = {k: v for k, v in fake_user_env(tmp_path / "home", refusing_proxy).items() if not k.startswith("KAGGLE_")}
    result = subprocess.run([str(kaggle_venv / "bin" / "python"), "-m", "cloudseg", "download", "--out",
                             str(tmp_path / "kaggle")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr.strip() == f"cloudseg: error: no usable Kaggle API credentials: {CREDENTIALS}"
    assert "KAGGLE_API_TOKEN" in CREDENTIALS and "kaggle auth login" in CREDENTIALS


def write_zip(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as bundle:
        for name, content in files.items():
            bundle.writestr(name, content)
    return path


@needs_make_and_uv
def test_without_the_package_registry_the_install_skips_saying_why(tmp_path, refusing_proxy):
    """A machine that cannot reach the registry (every request through a refusing proxy, uv's
    cache empty). Would catch: the tests erring there (10 errors on an offline H100), and a skip
    that hides a real install failure (it needs uv's own words for an unreachable registry)."""
    env = {**os.environ, "UV_CACHE_DIR": str(tmp_path / "empty-cache"), "UV_HTTP_TIMEOUT": "5",
           **{name: refusing_proxy for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")}}
    with pytest.raises(pytest.skip.Exception, match="needs the package registry, which uv cannot reach here "
                                                      r"\(.*(Failed to fetch|error sending request)"):
        install_kaggle_extra(tmp_path / "venv", env)


def test_unpack_puts_every_entry_in_place_and_replaces_an_older_folder(tmp_path):
    """Would catch: entries left in the hidden unpacking folder, a nested extra folder, or an
    older train_images/ keeping images the new archive does not have."""
    archive = write_zip(tmp_path / "bundle.zip", {"train.csv": b"a,b\n", "train_images/1.jpg": b"new"})
    out = tmp_path / "data" / "kaggle"
    (out / "train_images").mkdir(parents=True)
    (out / "train_images" / "stale.jpg").write_bytes(b"old")
    unpack(archive, out)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == [
        "bundle.zip", "data/kaggle/train.csv", "data/kaggle/train_images/1.jpg"]
    assert (out / "train_images" / "1.jpg").read_bytes() == b"new"


def test_unpack_of_a_cut_archive_is_one_line_and_writes_nothing(tmp_path):
    """A download cut short. Would catch: a BadZipFile traceback, or a data folder created empty
    (make train would take it for the real data)."""
    archive = tmp_path / "bundle.zip"
    archive.write_bytes(write_zip(tmp_path / "whole.zip", {"train.csv": b"x" * 1000}).read_bytes()[:200])
    with pytest.raises(RuntimeError, match=f"^{re.escape(str(archive))} is not a whole zip .*: delete it"):
        unpack(archive, tmp_path / "kaggle")
    assert not (tmp_path / "kaggle").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle.zip", "whole.zip"]


def test_unpack_of_damaged_compressed_data_is_one_line(tmp_path):
    """A deflated archive with bytes changed inside its compressed data (its directory intact):
    each of 10 such damages one line, the archive named. Would catch zlib's own error (invalid
    distance, bit length repeat) escaping as a traceback."""
    whole = tmp_path / "whole.zip"
    with zipfile.ZipFile(whole, "w", zipfile.ZIP_DEFLATED) as bundle:
        bundle.writestr("train.csv", "Image_Label,EncodedPixels\n" + "".join(f"{i}.jpg_Fish,{i} 1\n" for i in range(20000)))
    data, archive = whole.read_bytes(), tmp_path / "bundle.zip"
    for position in range(100, 1100, 100):
        damaged = bytearray(data)
        damaged[position:position + 8] = bytes(8)
        archive.write_bytes(bytes(damaged))
        with pytest.raises(RuntimeError, match=f"^{re.escape(str(archive))} is not a whole zip .*: delete it"):
            unpack(archive, tmp_path / "kaggle")


def test_an_unpacking_cut_short_leaves_no_train_csv_over_part_of_the_data(tmp_path, monkeypatch):
    """Unpacking over an older download, stopped after its first entry is moved: no train.csv in the
    folder (make train takes a folder with one for the data). Would catch the old train.csv kept
    until replaced, or the new one moved before the images."""
    from cloudseg import download

    archive = write_zip(tmp_path / "bundle.zip", {"train.csv": b"a,b\n", "train_images/1.jpg": b"new",
                                                  "test_images/2.jpg": b"new"})
    out = tmp_path / "kaggle"
    unpack(archive, out)
    moved, real_replace = [], os.replace

    def stopped_after_one(source, target):
        if moved:
            raise KeyboardInterrupt
        moved.append(target)
        real_replace(source, target)

    monkeypatch.setattr(download.os, "replace", stopped_after_one)
    with pytest.raises(KeyboardInterrupt):
        unpack(archive, out)
    assert moved and not (out / "train.csv").exists()
