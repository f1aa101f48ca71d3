"""Static rules that no runtime test would catch reliably."""

from __future__ import annotations

import ast
import pathlib
import re

import graphsafe

PKG = pathlib.Path(graphsafe.__file__).parent


def _imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ("." * node.level) + (node.module or "")
            names += [base] + [f"{base}.{a.name}" for a in node.names]
    return names


def test_fake_impls_never_import_the_workspace():
    files = sorted((PKG / "fake_impls").glob("*.py"))
    assert files
    for path in files:
        for name in _imports(path):
            assert "workspace" not in name, f"{path.name} imports {name}: fakes must not touch the workspace"
            assert not name.startswith("graphsafe.ops"), f"{path.name} imports {name}: fakes are metadata only"


# Host-device syncs that have no place in a decode op (DESIGN.md rule 5). The runtime
# check is sync-debug "error" on the GPU; this catches them on CPU-only CI too.
SYNC_PATTERNS = [r"\.item\(\)", r"\.tolist\(\)", r"\.cpu\(\)", r"\.nonzero\(", r"torch\.nonzero\(", r"masked_select", r"\.numpy\("]


def test_op_implementations_have_no_obvious_host_syncs():
    offenders = []
    for path in sorted((PKG / "ops").rglob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            for pattern in SYNC_PATTERNS:
                if re.search(pattern, code):
                    offenders.append(f"{path.relative_to(PKG)}:{lineno}: {line.strip()}")
    assert not offenders, "host syncs in op code:\n" + "\n".join(offenders)
