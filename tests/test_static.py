"""Static rules that no runtime test would catch reliably."""

from __future__ import annotations

import ast
import pathlib
import re

import graphsafe

PKG = pathlib.Path(graphsafe.__file__).parent


# A family's test case and bench case (`cases.py`, `bench.py`) are plugins of the testing
# and bench layers, not op code: they may sync, launch plainly and import those layers.
PLUGINS = ("cases.py", "bench.py")


def _op_code() -> list[pathlib.Path]:
    """The op code: every module under graphsafe/ops but the families' plugins, and the
    kernel helpers the families share (graphsafe/kernels)."""
    files = [p for p in (PKG / "ops").rglob("*.py") if p.name not in PLUGINS]
    return sorted(files + list((PKG / "kernels").rglob("*.py")))


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


# What a fake (`graphsafe/ops/<family>/fake.py`) and the checks it shares with the real
# impls may import: torch, the standard library, the checks and the byte formats; never
# the workspace, a backend, a kernel or another op.
FAKE_IMPORTS = ("graphsafe.checks", "graphsafe.formats", "graphsafe.errors")


def _fake_files() -> list[pathlib.Path]:
    return sorted((PKG / "ops").glob("*/fake.py")) + [PKG / "checks.py"]


def test_fake_impls_never_import_the_workspace():
    files = _fake_files()
    assert len(files) > 1
    for path in files:
        for name in _imports(path):
            assert "workspace" not in name, f"{path} imports {name}: fakes must not touch the workspace"
            assert not name.startswith("graphsafe.ops"), f"{path} imports {name}: fakes are metadata only"


def test_fakes_import_only_torch_the_checks_and_the_formats():
    for path in _fake_files():
        for name in _imports(path):
            if name.startswith("graphsafe") or name == "graphsafe":
                assert name in ("graphsafe", "graphsafe.checks") or name.startswith(FAKE_IMPORTS), (
                    f"{path.relative_to(PKG)} imports {name}: a fake imports only torch, graphsafe.checks and "
                    "graphsafe.formats")
            elif name.startswith("."):
                raise AssertionError(f"{path.relative_to(PKG)}: relative import {name}")
            else:
                assert name.split(".")[0] in ("torch", "__future__", "math", "typing", "collections", "dataclasses"), (
                    f"{path.relative_to(PKG)} imports {name}")


def test_formats_are_a_leaf():
    """The byte formats are read by fakes, references and kernels alike: they import torch
    and nothing of graphsafe, so any of them can import a format without a cycle."""
    for path in sorted((PKG / "formats").glob("*.py")):
        for name in _imports(path):
            assert not name.startswith("graphsafe"), f"{path.relative_to(PKG)} imports {name}"


# Host-device syncs that have no place in a decode op (docs/design.md, "The op contract"). The runtime
# check is sync-debug "error" on the GPU; this catches them on CPU-only CI too. Strings
# and comments are ignored; a line that must sync (a one-time capability probe, never on
# the hot path) says so with the pragma `# graphsafe: allow-sync (<why>)`.
SYNC_PATTERNS = [r"\.item\(\)", r"\.tolist\(\)", r"\.cpu\(\)", r"\bnonzero\(", r"masked_select", r"\.numpy\("]
ALLOW_SYNC = "graphsafe: allow-sync"


def _code_lines(path: pathlib.Path) -> dict[int, str]:
    """Source lines with string literals and comments blanked out."""
    import io
    import tokenize

    lines: dict[int, list[str]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT) or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            continue
        lines.setdefault(tok.start[0], []).append(tok.string)
    return {n: " ".join(parts) for n, parts in lines.items()}


def test_op_implementations_have_no_obvious_host_syncs():
    offenders = []
    for path in _op_code():
        if path.name == "debug.py":  # the debug switch's value checks: they read values by design
            continue
        raw = path.read_text().splitlines()
        for lineno, code in _code_lines(path).items():
            if lineno > len(raw) or ALLOW_SYNC in raw[lineno - 1]:
                continue
            for pattern in SYNC_PATTERNS:
                if re.search(pattern, code.replace(" ", "")):
                    offenders.append(f"{path.relative_to(PKG)}:{lineno}: {raw[lineno - 1].strip()}")
    assert not offenders, "host syncs in op code:\n" + "\n".join(offenders)


def _jit_functions(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if ast.unparse(target) in ("triton.jit", "jit", "triton.autotune"):
                    yield node
                    break


def _plain_constant_globals(tree: ast.Module) -> set[str]:
    """Module-level names bound by assignment to anything but a tl.constexpr(...) object."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            value = node.value
            if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("constexpr"):
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_triton_kernels_read_only_constexpr_globals():
    """The Triton compiler rejects globals in @jit code that are not tl.constexpr objects
    (plain numbers, float("-inf"), tables); the CPU interpreter accepts them, so CPU-only
    CI would never see the error. Wrap them in tl.constexpr(...)."""
    offenders = []
    for path in _op_code():
        tree = ast.parse(path.read_text())
        plain = _plain_constant_globals(tree)
        for fn in _jit_functions(tree):
            local = {a.arg for a in fn.args.args} | {
                t.id for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AugAssign, ast.For)) for t in ast.walk(n.target if not isinstance(n, ast.Assign) else n.targets[0]) if isinstance(t, ast.Name)
            }
            for n in ast.walk(fn):
                if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in plain and n.id not in local:
                    offenders.append(f"{path.relative_to(PKG)}:{n.lineno}: {fn.name} reads global {n.id}")
    assert not offenders, "\n".join(offenders)


# `kernel[grid](...)` pays Triton's binder on every call (graphsafe.launch says what that
# costs); op code binds its kernels once per signature with graphsafe.launch.bind. A line
# that must launch the plain way (a one-time probe, never per call) says so with the
# pragma `# graphsafe: plain-launch (<why>)`.
PLAIN_LAUNCH = re.compile(r"\b\w+\[\(?[^\[\]]*\)?\]\(")
ALLOW_PLAIN = "graphsafe: plain-launch"


def test_op_code_launches_kernels_through_bound_launches():
    offenders = []
    for path in _op_code():
        raw = path.read_text().splitlines()
        jit_names = {fn.name for fn in _jit_functions(ast.parse(path.read_text()))} | {
            n.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Name) and n.id.endswith("_kernel")
        }
        for lineno, code in _code_lines(path).items():
            compact = code.replace(" ", "")
            if lineno > len(raw) or ALLOW_PLAIN in raw[lineno - 1]:
                continue
            for match in PLAIN_LAUNCH.finditer(compact):
                name = match.group(0).split("[", 1)[0]
                if name in jit_names or name.endswith("kernel"):
                    offenders.append(f"{path.relative_to(PKG)}:{lineno}: {raw[lineno - 1].strip()}")
    assert not offenders, "plain kernel launches in op code (bind them: graphsafe.launch):\n" + "\n".join(offenders)


def test_debug_checks_are_reached_only_through_the_switch():
    """ops/<family>/debug.py may sync (they read values): no op code imports them; the
    registry calls them, by their "module:function" reference, only while
    `graphsafe.debug_checks` is on."""
    offenders = []
    for path in _op_code():
        if path.name == "debug.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and (
                node.module.endswith(".debug") or any(a.name == "debug" for a in node.names)):
                offenders.append(f"{path.relative_to(PKG)}:{node.lineno}")
    assert not offenders, "op code imports a debug module:\n" + "\n".join(offenders)


def test_only_plugins_reach_up_to_the_testing_and_bench_layers():
    """Op code never imports graphsafe.testing or graphsafe.bench (layers above it); a
    family's cases.py and bench.py, which those layers load, may."""
    offenders = []
    for path in _op_code():
        for name in _imports(path):
            if name.startswith(("graphsafe.testing", "graphsafe.bench", "graphsafe.demo", "graphsafe.models")):
                offenders.append(f"{path.relative_to(PKG)} imports {name}")
    assert not offenders, "\n".join(offenders)
