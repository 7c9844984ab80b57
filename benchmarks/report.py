"""Write the benchmark tables from the JSON under ``benchmarks/results/``.

Every ``results/<platform>-jax<version>/`` folder gets a ``README.md`` of its own with every table of its JSON, key
for key. ``benchmarks/README.md`` gets, between ``<!-- BEGIN generated ... -->`` and ``<!-- END generated ... -->``
lines, a summary of the step costs on every machine (``summary``) and the cost table of the shapes users train of
each folder that has one (``cost <folder>``). Run: ``python benchmarks/report.py``.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

HERE = Path(__file__).parent
RESULTS = HERE / "results"
ORDER = tuple(
    "scale peers gsgd path_sgd ddp kernels buffers eager ddp_norm trace depth memory collectives "
    "collectives_8dev".split()
)
CAPTIONS = {
    "scale": "Every optimiser on the shapes users train (`bench_scale.py`): step time as a ratio to `optax.sgd` "
    "and to `optax.adam` in the same rounds, optimizer state, and the compiled step's peak memory as a ratio "
    "to SGD's.",
    "peers": "The public PyTorch G-SGD of Meng et al. (github.com/MSRA-COLT/gsgd), Path-SGD of Neyshabur et al. "
    "(github.com/bneyshabur/path-sgd, with its two bugs fixed from outside) and GSpace's G-SGD "
    "(github.com/chris-je/ScaleInvariantParameterSpaces, on a four-layer MLP: it needs four weight matrices), eager, "
    "against ours on the same bias-free MLPs (`bench_peers.py`): ms per train step, and each step over its own "
    "framework's SGD.",
    "gsgd": "G-SGD and G-Adam against plain optax (`bench_gsgd.py`), and the update alone in ns per parameter.",
    "path_sgd": "Path-SGD step time as a ratio to `optax.sgd` (`bench_path_sgd.py`).",
    "ddp": "DDP-SGD step time as a ratio to `optax.sgd` (`bench_ddp.py`).",
    "kernels": "Kernels per compiled train step (`bench_kernels.py`): the entry computation's instructions that "
    "launch work; a loop or conditional counts once. On the CPU a proxy, on a GPU the launches of one step.",
    "buffers": "What an array in the optimizer state costs (`bench_buffers.py`): SGD whose state also carries "
    "`arrays` arrays passed through untouched (small ones, or copies of the params), and Adam; `host_us` one call's "
    "time to return with the device idle, `vs_sgd` the step over plain SGD's.",
    "eager": "The public functions of the params called outside a trace (`bench_eager.py`): `first_ms` the first "
    "call (trace and compile), `call_ms` a later one, compiled whole; and the same with the function's own "
    "operations run op by op (the functions it calls compiled), as before `jit_when_eager`.",
    "ddp_norm": "An SGD step on the DDP-normalised network against the plain one and against BatchNorm "
    "(`bench_ddp_norm.py`).",
    "trace": "`pj.trace` in seconds (`bench_trace.py`).",
    "flax_examples": "google/flax's example models at the test suite's widths, each as its example trains it "
    "(`bench_flax_examples.py`): the step of each optimiser over `optax.sgd`'s (G-Adam over `optax.adam`'s), and "
    "SGD's step in ms. Steps of 0.1-1 ms are mostly the launch of small kernels.",
    "depth": "Building and compiling one train step of a Transformer LM whose blocks are stacked with `nn.scan`, "
    "against depth (`bench_depth.py`): seconds, lines of StableHLO, and `x_sgd` the compile time over SGD's.",
    "memory": "Peak host memory of trace + init + the first step, one process per run (`bench_memory.py`): "
    "`over_sgd_x` is the excess over `optax.sgd`'s peak in units of the params' bytes, `over_plain_x` over the "
    "plain counterpart's (Adam for G-Adam); `host_peak_mb` the library's Python/numpy allocations; set-up seconds.",
    "collectives": "Collectives per train step in the compiled program on 4 devices, data parallel and FSDP-style "
    "(`bench_collectives.py`): count, MB of results, and `extra_x` the bytes beyond SGD's in units of the params'.",
    "collectives_8dev": "The same on 8 devices (`bench_collectives.py 8`).",
}


def cell(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.2f}" if abs(v) >= 0.1 else f"{v:.3g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def table(rows: dict[str, dict], first: str) -> str:
    cols = list(dict.fromkeys(k for r in rows.values() for k in r))
    out = [f"| {first} | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    out += [f"| {name} | " + " | ".join(cell(r.get(c)) for c in cols) + " |" for name, r in rows.items()]
    return "\n".join(out)


def render(name: str, results: dict) -> str:
    """Setups whose values are all numbers form one table; a setup holding dicts gets a table of its own."""
    flat = {k: v for k, v in results.items() if not any(isinstance(x, dict) for x in v.values())}
    parts = [f"**{name}** — {CAPTIONS.get(name, '')}"]
    if flat:
        parts.append(table(flat, "setup"))
    for setup, v in results.items():
        if setup in flat:
            continue
        scalars = {k: x for k, x in v.items() if not isinstance(x, dict)}
        caption = ", ".join(f"{k} {cell(x)}" for k, x in scalars.items())
        parts.append(f"*{setup}*" + (f" ({caption})" if caption else ""))
        parts.append(table({k: x for k, x in v.items() if isinstance(x, dict)}, "row"))
    return "\n\n".join(parts)


def section(folder: Path) -> str:
    files = sorted(folder.glob("*.json"), key=lambda p: ORDER.index(p.stem) if p.stem in ORDER else len(ORDER))
    blocks, metas = [], {}
    for path in files:
        data = json.loads(path.read_text())
        if "meta" not in data or "results" not in data:  # another script's output (lr_transfer.py has its own table)
            continue
        meta = data["meta"]
        metas[path.stem] = (
            f"{meta.get('date', 'date not recorded')}, {meta['backend']} ({meta.get('device_kind', meta['devices'][0])}"
            + (f", {meta['cpu_count']} cores" if meta.get("cpu_count") and meta["backend"] == "cpu" else "")
            + f"), jax {meta['jax']}, Python {meta['python']}"
        )
        blocks.append(render(path.stem, data["results"]) + f"\n\n<sub>{path.name}: {metas[path.stem]}</sub>")
    png = folder / "scale.png"
    if png.exists():
        blocks.append(f"![step time against batch and width]({png.name})")
    head = (
        f"# Benchmark tables: `{folder.name}`\n\nWritten by `python benchmarks/report.py` from the JSON in this folder "
        "(`benchmarks/README.md` says what each benchmark measures). Keys: `a/b`, `vs_sgd`, `vs_adam`: step time of "
        "`a` over that of `b`; `state_mb`: the optimizer state; `peak_vs_sgd`: the compiled step's peak memory over "
        "SGD's; `build_compile_s`: building and compiling the step, seconds."
    )
    return head + "\n\n" + "\n\n".join(blocks) + "\n"


# The summary table: one row per optimiser setting, one column per results folder; each cell the ratios to
# optax.sgd's step on the three models of common.py (ReLU RNN / MLP / small CNN), "—" where not measured.
SUMMARY_MODELS = ("relu_rnn_h100_t28_b64", "mlp_784_512_512_10_b128", "small_cnn_b64")
SUMMARY_ROWS = (
    ("G-SGD", "gsgd", "g_sgd/sgd"),
    ("G-Adam (× Adam)", "gsgd", "g_adam/adam"),
    ("Path-SGD κ⁽¹⁾", "path_sgd", "kappa1_every1"),
    ("Path-SGD κ⁽¹⁾, `every=10`", "path_sgd", "kappa1_every10"),
    ("Path-SGD exact κ⁽²⁾", "path_sgd", "exact_kappa2_every1"),
    ("DDP-SGD α=1, one probe", "ddp", "alpha1_probes1"),
    ("DDP-SGD α=1, probe on ¼ of the batch", "ddp", "alpha1_probes1_quarter_batch"),
    ("DDP-SGD α=1, exact", "ddp", "alpha1_exact"),
)


def summary(folders: list[Path]) -> str:
    data = {
        f: {
            n: json.loads((f / f"{n}.json").read_text())
            for n in ("gsgd", "path_sgd", "ddp")
            if (f / f"{n}.json").exists()
        }
        for f in folders
    }
    folders = [f for f in folders if data[f]]
    links = [f"[`{f.name}`](results/{f.name}/README.md)" for f in folders]
    head = "| × `optax.sgd` (RNN / MLP / CNN) | " + " | ".join(links)
    rows = [head + " |", "|---|" + "---|" * len(folders)]
    for label, name, key in SUMMARY_ROWS:
        cells = []
        for f in folders:
            res = data[f].get(name, {}).get("results", {})
            vals = [res.get(m, {}).get(key) for m in SUMMARY_MODELS]
            cells.append(" / ".join(cell(v) for v in vals) if any(v is not None for v in vals) else "—")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    dates = []
    for f in folders:
        ds = sorted({d["meta"].get("date") or "date not recorded" for d in data[f].values()})
        dates.append(ds[0] if len(ds) == 1 else f"{ds[0]} to {ds[-1]}")
    rows.append("| measured on | " + " | ".join(dates) + " |")
    return "\n".join(rows)


def replace_between(text: str, tag: str, body: str) -> str:
    begin, end = f"<!-- BEGIN generated {tag} -->", f"<!-- END generated {tag} -->"
    block = f"{begin}\n{body}\n{end}"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    return pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip("\n") + f"\n\n{block}\n"


def cost_table(folder: Path) -> str:
    """The top-level README's table: each optimiser's step as a multiple of SGD's (and Adam's), per model."""
    data = json.loads((folder / "scale.json").read_text())
    models = {k: v for k, v in data["results"].items() if "sgd" in v}
    opts = list(dict.fromkeys(o for v in models.values() for o in v if isinstance(v[o], dict)))
    head = "| optimiser | " + " | ".join(f"{m} (SGD {v['sgd_step_ms']:.3g} ms)" for m, v in models.items()) + " |"
    rows = [head, "|---|" + "---:|" * len(models)]
    for o in opts:
        cells = [f"{v[o]['vs_sgd']:.2f}× SGD, {v[o]['vs_adam']:.2f}× Adam" if o in v else "—" for v in models.values()]
        rows.append(f"| `{o}` | " + " | ".join(cells) + " |")
    meta = data["meta"]
    return "\n".join(rows) + f"\n\n<sub>benchmarks/results/{folder.name}/scale.json, {meta.get('date', '')}</sub>"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.parse_args(argv)
    bench_readme = HERE / "README.md"
    text = bench_readme.read_text()
    folders = sorted(p for p in RESULTS.iterdir() if p.is_dir())
    for folder in folders:
        (folder / "README.md").write_text(section(folder))
        if (folder / "scale.json").exists():
            text = replace_between(text, f"cost {folder.name}", cost_table(folder))
    text = replace_between(text, "summary", summary(folders))
    bench_readme.write_text(text)
    print("wrote", bench_readme, "and", ", ".join(str(f / "README.md") for f in folders))


if __name__ == "__main__":
    main()
