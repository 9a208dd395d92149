"""Private PyTorch / submitit internals live in moetrain/internals.py alone, and are still there.

import-linter cannot see attribute access, so the package's source is scanned: an import from a
private torch / submitit module, or an access ``x._name`` of a private attribute that moetrain
itself never defines, outside moetrain/internals.py, fails the test with file and line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from moetrain import internals

PACKAGE = Path(__file__).resolve().parents[1] / "moetrain"
ADAPTER = PACKAGE / "internals.py"

# Used as public by torchao and TorchTitan (moetrain/internals.py's docstring), or the standard library's.
ALLOWED_MODULES = {"torch.distributed._functional_collectives"}
ALLOWED_ATTRIBUTES = {"torch._scaled_mm", "os._exit", "sys._current_frames"}
ALLOWED_PREFIXES = ("torch.ops.aten._scaled_dot_product_",)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def own_private_names(files: list[Path]) -> set[str]:
    """Private names moetrain defines itself: functions, classes, module and class variables,
    arguments, and attributes it assigns on ``self`` / ``cls`` (an assignment ``obj._x = v`` on
    another object is a use of that object's private attribute, not a definition)."""
    names: set[str] = set()
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for sub in ast.walk(t):
                        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) \
                                and sub.value.id in ("self", "cls"):
                            names.add(sub.attr)
                        elif isinstance(sub, ast.Name):
                            names.add(sub.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
    return {n for n in names if _private(n)}


def private_uses(source: str, own: set[str]) -> list[tuple[int, str]]:
    """(line, text) of each use of a private torch / submitit internal in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "submitit"):
            if node.module not in ALLOWED_MODULES and (any(_private(p) for p in node.module.split("."))
                                                       or any(_private(a.name) for a in node.names)):
                found.append((node.lineno, f"from {node.module} import {', '.join(a.name for a in node.names)}"))
        elif isinstance(node, ast.Import):
            for a in node.names:
                parts = a.name.split(".")
                if parts[0] in ("torch", "submitit") and any(_private(p) for p in parts) \
                        and a.name not in ALLOWED_MODULES:
                    found.append((node.lineno, f"import {a.name}"))
        elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
            text = ast.unparse(node)
            if text in ALLOWED_ATTRIBUTES or text.startswith(ALLOWED_PREFIXES) or text in ALLOWED_MODULES:
                continue
            found.append((node.lineno, text))
    return found


def test_no_private_internal_outside_the_adapter():
    files = sorted(f for f in PACKAGE.rglob("*.py") if f != ADAPTER)
    own = own_private_names(files)
    bad = [f"{f.relative_to(PACKAGE.parent)}:{line}: {text}"
           for f in files for line, text in private_uses(f.read_text(), own)]
    assert not bad, "private torch / submitit internals outside moetrain/internals.py:\n" + "\n".join(bad)


def test_the_scan_finds_what_it_should():
    """Negative control: the uses moetrain/internals.py wraps are each found in plain code."""
    planted = """
import torch.distributed._composable.replicate_with_fsdp
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.pipelining.schedules import FORWARD, _Action
state = module._get_fsdp_state()
g = grad._local_tensor
flat = mesh["dp", "cp"]._flatten("dp_cp")
torch.autograd.Variable._execution_engine.queue_callback(fn)
job._cancel_at_deletion = False
self._prepare_schedule_with_comms(order)
ok = torch._scaled_mm(a, b, sa, sb)
ok = self._own_helper()
"""
    texts = sorted(t for _, t in private_uses(planted, own={"_own_helper"}))
    assert texts == sorted([
        "import torch.distributed._composable.replicate_with_fsdp",
        "from torch.distributed.tensor._utils import compute_local_shape_and_global_offset",
        "from torch.distributed.pipelining.schedules import FORWARD, _Action",
        "module._get_fsdp_state", "grad._local_tensor", "mesh['dp', 'cp']._flatten",
        "torch.autograd.Variable._execution_engine", "job._cancel_at_deletion",
        "self._prepare_schedule_with_comms"]), texts


def test_every_wrapped_internal_is_still_there():
    gone = internals.missing()
    assert not gone, (f"torch {torch.__version__} (moetrain was checked on {', '.join(internals.CHECKED_TORCH)}) "
                      f"lacks internals moetrain/internals.py wraps: {gone}")


def test_a_torch_whose_pipeline_stages_keep_no_outputs_refuses_ep_overlap_with_pp(tmp_path, monkeypatch):
    """torch 2.15 dropped the stages' ``fwd_cache`` (moetrain/internals.py): ep_overlap with pp > 1
    is refused by the config, before anything starts, naming the field and the fix; ep_overlap at
    pp = 1 and pp without it are not affected."""
    import pytest

    from moetrain.utils import ConfigError

    from conftest import tiny_config

    assert internals.stage_keeps_outputs(), f"torch {torch.__version__} keeps fwd_cache: the refusal is not needed"
    monkeypatch.setattr(internals, "stage_keeps_outputs", lambda: False)
    with pytest.raises(ConfigError, match=r"parallel.ep_overlap = True: with pp > 1 .*fwd_cache.*torch 2.11-2.14"):
        tiny_config(tmp_path, tmp_path / "r", parallel={"pp": 2, "dp": 2, "ep": 2, "ep_overlap": True})
    tiny_config(tmp_path, tmp_path / "r", parallel={"dp": 2, "ep": 2, "ep_overlap": True})
    tiny_config(tmp_path, tmp_path / "r", parallel={"pp": 2, "dp": 2, "ep": 2})
    with pytest.raises(NotImplementedError, match="fwd_cache"):
        internals.PipelineRuntime([], 2, lambda *a: None)
