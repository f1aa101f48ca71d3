"""Write docs/performance.md (and its plots) from the bench JSON files in benchmarks/results.

    python benchmarks/performance_page.py            # rewrite docs/performance.md and docs/img/*.png
    python benchmarks/performance_page.py --check    # exit 1 when docs/performance.md is stale

Results live in `benchmarks/results/<device>/<date>-<time>_<what>.json` (the JSON that
`python -m graphsafe bench --json` writes: meta, ceilings, rows). For each device, bench
case and shape, the page shows the newest run that measured it: graphsafe's median (graph
replay), its share of the roofline (of the copy bandwidth, or of the matmul peak for
compute-bound problems, both measured in the same run) and each external peer (FlashMLA,
FlashInfer), graphsafe's own other paths (`BASELINES`) and the compiled reference on the
same inputs, with graphsafe / peer ratios (> 1: graphsafe is slower). Plots (matplotlib, the `plot` extra; skipped without
it): per device and case, time per shape of graphsafe and each peer; per device, the share
of the roofline each case's shapes reach.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from collections import defaultdict

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "performance.md"
IMAGES = ROOT / "docs" / "img"
# Rows of these impls are shown beside graphsafe's (external peers first).
PEERS = ("flashmla", "flashinfer")
REFERENCE = "reference compiled"
# graphsafe's own other paths, shown beside its default as the peers are: the portable Triton
# kernel where a Gluon one replaced it, and what a user without the paged op would run.
BASELINES = ("graphsafe triton kernel", "graphsafe gather + flash_attn_varlen")
# Cases that are not kernels (host cost, the demo's step, workspace bookkeeping): their own section.
HOST_CASES = ("host_cost", "dispatch_overhead", "workspace", "demo_step")
DEVICE_NAMES = {"h100": "H100", "h200": "H200", "h200x2": "2 x H200"}


def load_runs(results: pathlib.Path = RESULTS) -> dict[str, list[tuple[str, dict]]]:
    """{device dir: [(file relative to the repo, bench JSON), ...]} of every bench run."""
    runs: dict[str, list[tuple[str, dict]]] = defaultdict(list)
    for path in sorted(results.glob("*/*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and "meta" in doc and "rows" in doc and doc["meta"].get("device_type") == "cuda":
            runs[path.parent.name].append((str(path.relative_to(ROOT)), doc))
    return runs


def newest_per_case(runs: list[tuple[str, dict]]) -> dict[str, tuple[list[str], dict[str, dict], list[dict]]]:
    """{case: (files, {file: run}, rows)}: each shape of the case from the newest run that
    measured that shape (so a run of a few shapes, as the variants' bench, which reports
    the ops' own cases, hides none of the others), in the order the shapes were first met."""
    per_shape: dict[str, dict[str, tuple[str, dict, list[dict]]]] = defaultdict(dict)
    for file, doc in sorted(runs, key=lambda r: r[1]["meta"].get("started", "")):
        by_shape: dict[tuple[str, str], list[dict]] = defaultdict(list)
        for row in doc["rows"]:
            by_shape[(row["case"], row["shape"])].append(row)
        for (case, shape), rows in by_shape.items():
            per_shape[case][shape] = (file, doc, rows)
    best: dict[str, tuple[list[str], dict[str, dict], list[dict]]] = {}
    for case, shapes in per_shape.items():
        files: list[str] = []
        docs: dict[str, dict] = {}
        rows: list[dict] = []
        for file, doc, shape_rows in shapes.values():
            if file not in docs:
                files.append(file)
                docs[file] = doc
            rows += shape_rows
        best[case] = (files, docs, rows)
    return best


def _is_peer(impl: str) -> bool:
    return impl.lower().startswith(PEERS) or impl == REFERENCE  # ("FlashMLA model1" too)


def _roofline(row: dict) -> float | None:
    """graphsafe's share of the roofline: the larger of its % of bandwidth and % of peak."""
    values = [v for v in (row.get("pct_bandwidth"), row.get("pct_peak")) if v is not None]
    return max(values) if values else None


def _ms(x: float | None, unit: str = "ms") -> str:
    """A median (the JSON holds milliseconds) in the row's unit: ms, or us for host costs."""
    if x is None:
        return "-"
    return f"{x:.4g}" if unit == "ms" else f"{x * 1e3:.3g} us"


def case_table(rows: list[dict]) -> tuple[list[str], list[dict]]:
    """The markdown table of one case, and per shape the numbers the plots draw."""
    shapes: dict[str, dict] = {}
    for row in rows:
        entry = shapes.setdefault(row["shape"], {"graphsafe": None, "peers": {}, "unit": row.get("unit", "ms")})
        if row["impl"].startswith("graphsafe") and entry["graphsafe"] is None:
            entry["graphsafe"] = row
        elif (_is_peer(row["impl"]) or row["impl"] in BASELINES) and row.get("error") is None and row.get("median_ms"):
            entry["peers"][row["impl"]] = row["median_ms"]
    peers = sorted({p for e in shapes.values() for p in e["peers"]}, key=lambda p: (p == REFERENCE, p))
    head = ["shape", "graphsafe", "% roofline"] + [f"{p} (graphsafe / it)" for p in peers]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    points = []
    for shape, entry in shapes.items():
        ours = entry["graphsafe"]
        if ours is None:
            continue
        ms = ours.get("median_ms")
        roof = _roofline(ours)
        cells = [f"`{shape}`", _ms(ms, entry["unit"]), "-" if roof is None else f"{roof:.0f}%"]
        for p in peers:
            theirs = entry["peers"].get(p)
            cells.append("-" if theirs is None or not ms else f"{_ms(theirs, entry['unit'])} ({ms / theirs:.2f})")
        lines.append("| " + " | ".join(cells) + " |")
        points.append({"shape": shape, "graphsafe": ms, "roofline": roof, "peers": entry["peers"], "unit": entry["unit"]})
    return lines, points


def host_table(rows: list[dict]) -> tuple[list[str], list[dict]]:
    """A host-cost case: every impl of every shape (floors, each op), its median per call."""
    lines = ["| shape | impl | per call |", "|---|---|---|"]
    for row in rows:
        if row.get("error") is None:
            lines.append(f"| `{row['shape']}` | {row['impl']} | {_ms(row.get('median_ms'), row.get('unit', 'ms'))} |")
    return lines, []


def render(runs: dict[str, list[tuple[str, dict]]]) -> tuple[str, dict]:
    """The page's markdown, and {(device, case): points} for the plots."""
    out = [
        "# Performance",
        "",
        "Generated by `python benchmarks/performance_page.py` from the bench JSON in `benchmarks/results/`",
        "(`python -m graphsafe bench --json ...` on each GPU); do not edit by hand. Per device, case and shape:",
        "the newest run that measured it, graphsafe's median device time (CUDA-graph replay, ms) and share of",
        "the roofline (copy bandwidth or matmul peak, measured in the same run), and each peer on the same",
        "inputs with the ratio graphsafe / peer (> 1: graphsafe is slower). The tries not kept, and why, are",
        "in `benchmarks/NOTES.md`.",
        "",
    ]
    plots: dict = {}
    for device in sorted(runs):
        best = newest_per_case(runs[device])
        if not best:
            continue
        name = DEVICE_NAMES.get(device, device)
        out += [f"## {name}", ""]
        metas = {file: doc for _, docs, _ in best.values() for file, doc in docs.items()}
        for file, doc in sorted(metas.items(), key=lambda kv: kv[1]["meta"].get("started", "")):
            meta, ceil = doc["meta"], doc.get("ceilings", {})
            bw = ceil.get("copy_bytes_per_s")
            peak = (ceil.get("matmul_flops_per_s") or {}).get("bfloat16")
            out.append(f"- `{file}`: {meta.get('device')}, torch {meta.get('torch')}, triton {meta.get('triton')}, "
                       f"started {meta.get('started', '?')[:16]}; copy bandwidth "
                       f"{'-' if bw is None else f'{bw / 1e12:.2f} TB/s'}, bf16 matmul peak "
                       f"{'-' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}")
        out.append("")
        if (IMAGES / f"{device}_roofline.png").exists() or _can_plot():
            out += [f"![share of the roofline per case, {name}](img/{device}_roofline.png)", ""]
        for case in sorted(best, key=lambda c: (c in HOST_CASES, c)):
            files, _, rows = best[case]
            lines, points = host_table(rows) if case in HOST_CASES else case_table(rows)
            if len(lines) <= 2:
                continue
            plots[(device, case)] = points
            out += [f"### {case} ({name})", "", "From " + ", ".join(f"`{f}`" for f in files) + ".", ""] + lines + [""]
            external = any(k != REFERENCE for p in points for k in p["peers"])
            if external and ((IMAGES / f"{device}_{case}.png").exists() or _can_plot()):
                out += [f"![{case}: graphsafe and peers, {name}](img/{device}_{case}.png)", ""]
    return "\n".join(out).rstrip() + "\n", plots


def _can_plot() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def draw(plots: dict) -> list[pathlib.Path]:
    """The plots of `render` as PNG files under docs/img (none without matplotlib)."""
    if not _can_plot():
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMAGES.mkdir(parents=True, exist_ok=True)
    written = []
    by_device: dict[str, list] = defaultdict(list)
    for (device, case), points in plots.items():
        if case not in HOST_CASES:
            by_device[device] += [(case, p) for p in points if p["roofline"] is not None]
        external = sorted({k for p in points for k in p["peers"] if k != REFERENCE})
        if not external:
            continue
        names = ["graphsafe"] + external
        fig, ax = plt.subplots(figsize=(9, (0.18 * len(names) + 0.12) * len(points) + 1.2))
        height = 0.8 / len(names)
        for i, impl in enumerate(names):
            ys = [j + i * height for j in range(len(points))]
            xs = [p["graphsafe"] if impl == "graphsafe" else p["peers"].get(impl, 0) for p in points]
            bars = ax.barh(ys, xs, height=height, label=impl)
            if impl != "graphsafe":
                for bar, p, x in zip(bars, points, xs):
                    if x:
                        ax.annotate(f"{p['graphsafe'] / x:.2f}x", (x, bar.get_y() + height / 2), fontsize=6,
                                    xytext=(2, 0), textcoords="offset points", va="center")
        ax.set_yticks([j + 0.4 - height / 2 for j in range(len(points))])
        ax.set_yticklabels([p["shape"] for p in points], fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(f"median time ({points[0]['unit']}; shorter is faster; labels: graphsafe / peer)")
        ax.set_title(f"{case} on {DEVICE_NAMES.get(device, device)}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        path = IMAGES / f"{device}_{case}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    for device, entries in by_device.items():
        fig, ax = plt.subplots(figsize=(9, 0.22 * len(entries) + 1.5))
        cases = sorted({c for c, _ in entries})
        colors = {c: f"C{i % 10}" for i, c in enumerate(cases)}
        ax.barh(range(len(entries)), [p["roofline"] for _, p in entries], color=[colors[c] for c, _ in entries])
        ax.set_yticks(range(len(entries)))
        ax.set_yticklabels([f"{c}: {p['shape']}" for c, p in entries], fontsize=6)
        ax.invert_yaxis()
        ax.axvline(100, color="k", lw=0.5)
        ax.set_xlabel("graphsafe, % of the roofline (copy bandwidth or bf16 matmul peak)")
        ax.set_title(f"Share of the roofline on {DEVICE_NAMES.get(device, device)}")
        fig.tight_layout()
        path = IMAGES / f"{device}_roofline.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/performance.md differs from the results")
    opts = ap.parse_args(argv)
    text, plots = render(load_runs())
    if opts.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is stale: run python benchmarks/performance_page.py", file=sys.stderr)
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    for path in draw(plots):
        print(f"wrote {path.relative_to(ROOT)}")
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
