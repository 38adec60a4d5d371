"""The `stax` command line: `python -m stax ...` (the top of the stack, beside `stax/__init__.py`).

    python -m stax run FILE [--show graph,ir,schedule,kernels,wrapper] [--device cpu|cuda] [-- ARGS]
    python -m stax report FILE [-o report.html] [--device cpu|cuda] [-- ARGS]
    python -m stax cache clear
    python -m stax cache dir
    python -m stax cache stats
    python -m stax --help

`run` executes FILE as `python FILE ARGS` would (`__name__ == "__main__"`, `sys.argv = [FILE, *ARGS]`,
FILE's folder first on `sys.path`) with the chosen stages of STAX_LOGS turned on, then prints a
summary for every function the script compiled with `stax.compile`:

  - its kernels, and which graph nodes each one fuses (the comment above each kernel says the same);
  - the bytes its compiled code moves against the lower bound of Prop. 1.1 (every input read once,
    every output written once);
  - the time of one compiled call against one eager call, re-run on the inputs of its last call.

Where to look: `main` parses the command line; `run` runs the script; `summarize` / `traffic`
compute the summary.
"""
from __future__ import annotations

import argparse
import os
import runpy
import statistics
import sys
import time

import stax
from stax.report import traffic     # Prop. 1.1's bytes moved: the summary and the report share it

SHOW_STAGES = ("graph", "ir", "schedule", "kernels", "wrapper", "guards", "recompiles", "autotune",
               "cudagraphs")


# ---- Time against eager ----


def _time(fn, args, kwargs, budget=1.0, max_runs=50) -> tuple:
    """Median seconds of fn(*args) after one warm-up call, repeated for about `budget` seconds."""
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    first = time.perf_counter() - t0
    runs = max(3, min(max_runs, int(budget / max(first, 1e-6))))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), runs


def _fmt_bytes(n) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= k:
            return f"{n / k:.1f} {unit}"
    return f"{n} B"


def _fmt_time(s) -> str:
    return f"{s * 1e3:.3f} ms" if s < 1 else f"{s:.2f} s"


def _where(f) -> str:
    code = getattr(f.fn, "__code__", None)
    if code is None:
        return ""
    path = os.path.relpath(code.co_filename) if not code.co_filename.startswith("<") else code.co_filename
    return f" ({path}:{code.co_firstlineno})"


def summarize(f, timing=True) -> str:
    """The summary of one CompiledFunction: kernels, bytes against Prop. 1.1, time against eager."""
    name = getattr(f, "__name__", "fn")
    s = f.stats
    lines = [f"{name}{_where(f)}: {s['calls']} call(s), {s['compiles']} compile(s) in "
             f"{s['compile_seconds']:.2f} s, {s['eager_calls']} eager call(s)"]
    if f.last_inputs is None:
        return "\n".join(lines + ["  never called"])
    args, kwargs = f.last_inputs
    if s["compiles"] == 0 or s["eager_calls"] == s["calls"]:
        lines.append("  ran eagerly (not captured: STAX_LOGS=graph says why)")
        return "\n".join(lines)
    saved = os.environ.pop("STAX_LOGS", None)       # regenerate quietly
    try:
        gen = stax.generate(f.fn, *args, **kwargs)
        t = traffic(gen)
    except Exception as e:                          # the summary must never hide the run's result
        lines.append(f"  (no summary for the last inputs: {type(e).__name__}: {e})")
        return "\n".join(lines)
    finally:
        if saved is not None:
            os.environ["STAX_LOGS"] = saved
    shapes = ", ".join(f"{a.dtype.name}{list(a.shape)}" for a in args if isinstance(a, stax.Tensor))
    lines.append(f"  last inputs: {shapes or '(no tensors)'}")
    n_kernels = sum(1 for k in t["kernels"] if not k["kernel"].startswith("fallback "))
    n_fallback = len(t["kernels"]) - n_kernels
    lines.append(f"  kernels: {n_kernels}" + (f" (+ {n_fallback} fallback call(s))" if n_fallback else ""))
    for k in t["kernels"]:
        lines.append(f"    {k['kernel']:<16} {k['kind']:<9} fuses {len(k['nodes'])} node(s): "
                     f"{', '.join(k['nodes'])}  [{_fmt_bytes(k['bytes'])}]")
    ratio = t["moved"] / t["bound"] if t["bound"] else float("nan")
    lines.append(f"  bytes moved: {_fmt_bytes(t['moved'])} ({t['moved']:,} B); lower bound "
                 f"(Prop. 1.1, inputs read once + outputs written once): {_fmt_bytes(t['bound'])} "
                 f"({t['bound']:,} B); ratio {ratio:.2f}")
    if timing:
        tc, nc = _time(f, args, kwargs)
        te, ne = _time(f.fn, args, kwargs)
        lines.append(f"  time per call: compiled {_fmt_time(tc)}, eager {_fmt_time(te)} "
                     f"(medians of {nc} and {ne} calls on the last inputs); speed-up {te / tc:.1f}x")
    return "\n".join(lines)


# ---- Commands ----


def _use_device(device: str) -> None:
    """--device: tensors the script creates default to `device`.

    Without an NVIDIA GPU, `--device cuda` says so and exits 2 (with TRITON_INTERPRET=1 the
    Triton kernels run in Triton's interpreter instead)."""
    if device == "cpu":
        return
    try:
        stax.set_default_device(device)
    except RuntimeError as e:           # e.g. no GPU or no CUDA driver on this machine
        print(f"stax: --device {device}: {e}", file=sys.stderr)
        sys.exit(2)


def _run_script(path: str, device: str, script_args) -> tuple:
    """Run FILE as `python FILE ARGS` would; returns (exit status, compiled functions it made)."""
    _use_device(device)
    try:                                # keep the script's prints in order with the stage logs
        sys.stdout.reconfigure(line_buffering=True)
    except (AttributeError, ValueError):
        pass
    stax._RUN_REGISTRY = []
    argv, path0 = sys.argv[:], sys.path[0] if sys.path else None
    sys.argv = [path, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:             # the script's own sys.exit(): keep its status
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    finally:
        sys.argv = argv
        if sys.path and path0 is not None and sys.path[0] != path0:
            sys.path.pop(0)
    compiled = stax._RUN_REGISTRY
    stax._RUN_REGISTRY = None
    sys.stdout.flush()
    return code, compiled


def run(path: str, show: list, device: str = "cpu", script_args=(), summary=True,
        timing=True) -> int:
    if not os.path.isfile(path):
        print(f"stax run: no such file: {path}", file=sys.stderr)
        return 2
    stages = set(filter(None, os.environ.get("STAX_LOGS", "").split(","))) | set(show)
    if stages:
        os.environ["STAX_LOGS"] = ",".join(sorted(stages))
    code, compiled = _run_script(path, device, script_args)
    if summary:
        print(f"\n==== stax summary: {len(compiled)} compiled function(s) in {path} ====")
        for f in compiled:
            print(summarize(f, timing=timing))
        sys.stdout.flush()
    return code


def report(path: str, out: str | None, device: str = "cpu", script_args=(), timing=True) -> int:
    """`python -m stax report FILE`: run it, then write one self-contained HTML page."""
    from stax import report as report_mod
    if not os.path.isfile(path):
        print(f"stax report: no such file: {path}", file=sys.stderr)
        return 2
    recorder = report_mod.Recorder()
    stax._OBSERVERS.append(recorder)
    try:
        code, compiled = _run_script(path, device, script_args)
    finally:
        stax._OBSERVERS.remove(recorder)
        recorder.close()
    expl = report_mod.explain_functions(compiled, recorder, timing=timing, device=device)
    out = out or os.path.splitext(os.path.basename(path))[0] + ".html"
    with open(out, "w", encoding="utf-8") as fh:
        fh.write(expl.to_html(f"Stax report: {os.path.basename(path)}"))
    print(f"stax report: wrote {out} ({len(compiled)} compiled function(s), "
          f"{len(expl.kernels())} kernel(s))", file=sys.stderr)
    return code


def _cache_stats(root, cache) -> str:
    """`python -m stax cache stats`: hits, misses and bytes of both levels, summed over the
    processes that used this cache since it was last cleared."""
    from . import remote_cache
    total = cache.stats_totals()
    local, rem = total.get("local", {}), total.get("remote", {})
    lines = [f"cache folder: {root}",
             f"local:  {local.get('hits', 0)} hits, {local.get('misses', 0)} misses, "
             f"{local.get('bytes_read', 0)} bytes read"]
    for kind, per in sorted(local.get("by_kind", {}).items()):
        lines.append(f"  {kind:<10} {per.get('hits', 0)} hits, {per.get('misses', 0)} misses")
    store = remote_cache.remote()
    if store is None and not rem:
        lines.append(f"remote: none ({remote_cache.ENV} is not set)")
        return "\n".join(lines)
    lines.append(f"remote: {rem.get('hits', 0)} hits, {rem.get('misses', 0)} misses, "
                 f"{rem.get('bytes_read', 0)} bytes read, {rem.get('writes', 0)} writes "
                 f"({rem.get('bytes_written', 0)} bytes), {rem.get('bad_entries', 0)} bad entries, "
                 f"{rem.get('errors', 0)} errors, {rem.get('skipped_large', 0)} too large to send")
    for kind, per in sorted(rem.get("by_kind", {}).items()):
        lines.append(f"  {kind:<10} {per.get('hits', 0)} hits, {per.get('misses', 0)} misses")
    if store is not None:
        info = store.server_info()
        lines.append(f"server {store.url}: " + ("unreachable" if info is None else
                     f"{info['keys']} Stax entries, {info['used_memory']} used"))
    return "\n".join(lines)


def _cache(action: str) -> int:
    from . import cache
    try:
        root = cache.cache_dir()
        if action == "clear":
            n = cache.clear_cache()
            print(f"stax: removed {n} file(s) from {root} (Stax's subfolders only)")
        elif action == "dir":
            print(root)
        elif action == "stats":
            print(_cache_stats(root, cache))
    except cache.CacheError as e:
        print(f"stax cache {action}: {e}", file=sys.stderr)
        return 2
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m stax",
        description="Stax, a small tensor-program compiler: run a script with the compiler's "
                    "stages shown, or manage the kernel cache.",
        epilog="examples:\n"
               "  python -m stax run examples/ex1_1_relu_sum.py --show kernels,wrapper\n"
               "  python -m stax run my_script.py --show graph,ir -- --my-flag 3\n"
               "  python -m stax report examples/softmax.py -o softmax.html\n"
               "  python -m stax cache clear\n"
               "environment: STAX_LOGS=graph,ir,schedule,kernels,wrapper,guards,recompiles "
               "(stages to print), STAX_CACHE_DIR (default ~/.cache/stax), CXX, STAX_CXXFLAGS, "
               "STAX_COMPILE_TIMEOUT (seconds, default 300), STAX_REMOTE_CACHE (redis://host:port/db, "
               "a shared second level), STAX_REMOTE_CACHE_TRUST_NATIVE=1 (load .so files from it)",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="{run,report,cache}")
    r = sub.add_parser("run", help="run a Python script with Stax's stages shown, then summarize",
                       description="Run FILE as `python FILE ARGS` would, with the chosen stages "
                                   "printed to stderr, then print a summary per compiled function "
                                   "(kernels, fused nodes, bytes moved against the Prop. 1.1 lower "
                                   "bound, compiled time against eager).")
    r.add_argument("file", help="the Python script to run")
    r.add_argument("--show", default="", metavar="STAGES",
                   help=f"comma-separated stages to print: {','.join(SHOW_STAGES)} (or all)")
    r.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="default device of the tensors the script creates (default: cpu)")
    r.add_argument("--no-summary", action="store_true", help="skip the summary at the end")
    r.add_argument("--no-timing", action="store_true",
                   help="summary without re-running the functions to time them")
    r.add_argument("script_args", nargs="*", metavar="-- ARGS",
                   help="arguments for the script, after `--`")
    rp = sub.add_parser("report", help="run a script, then write one HTML page: fusion graph, kernels, "
                                       "roofline, guards, autotuning",
                        description="Run FILE as `run` does and write one self-contained HTML file with, "
                                    "per compiled function and artifact, the fusion graph, each kernel's "
                                    "source tied to its graph nodes, the IR, the wrapper, a roofline and "
                                    "the guards.")
    rp.add_argument("file", help="the Python script to run")
    rp.add_argument("-o", "--output", default=None, help="the HTML file to write (default: FILE's name .html)")
    rp.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="default device of the tensors the script creates (default: cpu)")
    rp.add_argument("--no-timing", action="store_true", help="no kernel timing and no roofline")
    rp.add_argument("script_args", nargs="*", metavar="-- ARGS", help="arguments for the script, after `--`")
    c = sub.add_parser("cache", help="manage the kernel cache ($STAX_CACHE_DIR or ~/.cache/stax)")
    c.add_argument("action", choices=["clear", "dir", "stats"],
                   help="clear: delete every cached kernel, wrapper and record (only the subfolders "
                        "Stax made; the folder must carry Stax's CACHEDIR.TAG); dir: print the cache "
                        "folder; stats: hits, misses and bytes of the local and remote levels")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = []
    if argv[:1] in (["run"], ["report"]) and "--" in argv:        # everything after `--` belongs to the script
        i = argv.index("--")
        argv, script_args = argv[:i], argv[i + 1:]
    p = _parser()
    ns = p.parse_args(argv)
    if ns.command is None:
        p.print_help()
        return 0
    if ns.command == "cache":
        return _cache(ns.action)
    if ns.command == "report":
        return report(ns.file, ns.output, ns.device, list(ns.script_args) + script_args,
                      timing=not ns.no_timing)
    show = [s.strip() for s in ns.show.split(",") if s.strip()]
    if "all" in show:
        show = list(SHOW_STAGES)
    bad = [s for s in show if s not in SHOW_STAGES]
    if bad:
        p.error(f"--show: unknown stage(s) {', '.join(bad)}; choose from {', '.join(SHOW_STAGES)}")
    return run(ns.file, show, ns.device, list(ns.script_args) + script_args,
               summary=not ns.no_summary, timing=not ns.no_timing)


if __name__ == "__main__":
    sys.exit(main())
