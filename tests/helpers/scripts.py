"""Import a repository script (`examples/*.py`, `scripts/*.py`) as a module, to test its functions."""

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(rel: str) -> ModuleType:
    """The module at ``ROOT/rel`` (e.g. ``"examples/make_kind_prompts.py"``), executed once per call."""
    path = ROOT / rel
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
