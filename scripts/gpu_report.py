"""The GPU check's helper (scripts/gpu_check.sh): what the machine is, and the one report.

    gpu_report.py --probe                      machine JSON (GPUs, driver, torch, NCCL) on stdout
    gpu_report.py --packages                   the versions and places of the packages the check uses
    gpu_report.py --setup-config ROOT          what setup.py would compile and link, without compiling
    gpu_report.py --junit FILE                 pytest's JUnit XML summed up; exit 1 unless some test
                                               passed and none failed (all skipped is no pass)
    gpu_report.py --report STATE OUT [--dry 1] report.md + gpu_check.json (+ logs/, raw/) in OUT

The report is made from what the steps left in STATE: steps/NAME.tsv (status, rc, seconds,
limit, start, call, note), logs/NAME.log, raw/ (machine.json, packages.json, build_info.json,
test.xml, test-multi.xml, collbench_cuda.json, ddp_cuda.json). Anything missing is reported as
missing; the report never fails for it. Plain Python: runs before anything is installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

STEPS = ["env", "build", "hostcost", "test", "test-multi", "bench", "ddp", "hvd"]
WHAT = {
    "env": "python with torch, venv, wheels from the wheelhouse",
    "build": "c10d_ext with the NCCL engine",
    "hostcost": "host time per op vs nccl; DDP on many small parameters",
    "test": "pytest -m cuda tests (tests/cuda/test_cuda.py at world sizes 1 and 2 on one GPU, and every other file's)",
    "test-multi": "tests/cuda/test_cuda.py at world size N on N GPUs",
    "bench": "collbench --device cuda, myccl vs nccl",
    "ddp": "DDP training over myccl vs over nccl",
    "hvd": "Horovod's synthetic benchmark on c10d_ext.horovod vs torch DDP over nccl",
}


# ---- probes ------------------------------------------------------------------------------

def _run(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def probe() -> dict:
    import platform

    import torch

    info = {"python": sys.version.split()[0], "python_executable": sys.executable,
            "torch": torch.__version__, "torch_cuda": torch.version.cuda, "torch_file": torch.__file__,
            "cuda_available": torch.cuda.is_available(), "gpu_count": 0, "gpus": [],
            "cpus": os.cpu_count(), "platform": platform.platform(),
            "compiler": (_run(["c++", "--version"]) or "").split("\n")[0] or None}
    try:
        info["nccl_torch"] = ".".join(str(v) for v in torch.cuda.nccl.version()[:3])
    except Exception as e:  # noqa: BLE001 - a CPU-only torch
        info["nccl_torch"] = f"n/a ({type(e).__name__})"
    if info["cuda_available"]:
        info["gpu_count"] = torch.cuda.device_count()
        for i in range(info["gpu_count"]):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                                 "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count})
    smi = _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    info["nvidia_smi"] = smi.splitlines() if smi else None
    head = _run(["nvidia-smi"])
    m = re.search(r"CUDA Version:\s*([\d.]+)", head or "")
    info["driver_cuda"] = m.group(1) if m else None
    m = re.search(r"Driver Version:\s*([\d.]+)", head or "")
    info["driver"] = m.group(1) if m else None
    topo = _run(["nvidia-smi", "topo", "-m"])
    info["topology"] = topo if topo and info["gpu_count"] > 1 else None
    return info


PACKAGES = ["torch", "nvidia-nccl-cu13", "nvidia-nccl-cu12", "nvidia-cuda-runtime", "nvidia-cuda-runtime-cu12",
            "nvidia-cuda-crt", "nvidia-cuda-cccl", "setuptools", "wheel", "packaging", "ninja", "pytest",
            "pytest-xdist", "pytest-timeout", "numpy", "pip"]


def packages() -> dict:
    import importlib.metadata as md

    out = {}
    for name in PACKAGES:
        try:
            d = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        where = str(d.locate_file(""))
        out[name] = {"version": d.version, "where": "venv" if where.startswith(sys.prefix) else where}
    return out


def setup_config(root: str) -> None:
    """Runs setup.py with setuptools.setup replaced: prints the extension's build inputs."""
    import runpy

    import setuptools

    def fake_setup(**kw):
        ext = kw["ext_modules"][0]
        print(json.dumps({"version": kw.get("version"), "sources": len(ext.sources),
                          "cuda_sources": sum(s.startswith("src/cuda/") for s in ext.sources),
                          "include_dirs": ext.include_dirs, "library_dirs": ext.library_dirs,
                          "libraries": ext.libraries, "runtime_library_dirs": ext.runtime_library_dirs,
                          "define_macros": ext.define_macros}, indent=1))

    setuptools.setup = fake_setup
    os.chdir(root)
    sys.path.insert(0, root)
    runpy.run_path(os.path.join(root, "setup.py"), run_name="__main__")


# ---- the report --------------------------------------------------------------------------

def _load_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _steps(state: str) -> dict:
    out = {}
    for name in STEPS:
        try:
            with open(os.path.join(state, "steps", name + ".tsv")) as f:
                fields = f.read().rstrip("\n").split("\t")
        except OSError:
            continue
        fields += [""] * (7 - len(fields))
        status, rc, secs, limit, started, call, note = fields[:7]
        out[name] = {"status": status, "rc": int(rc) if rc.strip() else None, "seconds": int(secs or 0),
                     "limit_s": int(limit or 0), "started": started, "call": call, "note": note}
    return out


def _junit(path: str) -> dict | None:
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    res = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    res["seconds"] = round(sum(float(s.get("time", 0)) for s in suites), 1)
    res["passed"] = res["tests"] - res["failures"] - res["errors"] - res["skipped"]
    res["failed"] = []
    res["files"] = {}  # test file -> {"passed", "failed", "skipped"}: which GPU paths ran
    for case in root.iter("testcase"):
        module = (case.get("classname") or "").split(".")
        name = next((m for m in module if m.startswith("test_")), module[-1]) + ".py"
        counts = res["files"].setdefault(name, {"passed": 0, "failed": 0, "skipped": 0})
        outcome = "passed"
        for kind in ("failure", "error"):
            el = case.find(kind)
            if el is not None:
                outcome = "failed"
                msg = (el.get("message") or el.text or "").strip().splitlines()
                res["failed"].append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": kind,
                                      "message": msg[0][:300] if msg else ""})
        if outcome == "passed" and case.find("skipped") is not None:
            outcome = "skipped"
        counts[outcome] += 1
    return res


def _summary_lines(log: str) -> list[str]:
    """pytest's closing line and its FAILED/ERROR lines."""
    try:
        with open(log, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    keep = [ln for ln in lines if re.match(r"^(FAILED|ERROR) ", ln)]
    keep += [ln for ln in lines if re.match(r"^=+ .*\b(passed|failed|error|errors|skipped|deselected)\b.* =+$", ln)]
    return keep[-40:]


def _fmt_size(n: int) -> str:
    for unit, mult in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult and n % mult == 0:
            return f"{n // mult} {unit}"
    return f"{n} B"


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _collbench_md(cb: dict) -> list[str]:
    b = cb.get("baseline", "nccl")
    out = [f"World size {cb.get('world_size')}, baseline {b} (same run, same tensors; "
           "time = issue + completion, closed by torch.cuda.synchronize(); issue = host time to enqueue one op; "
           f"ratio = {b} time / myccl time, above 1 myccl is faster).", ""]
    rows = cb.get("rows", [])
    small = [r for r in rows if r["bytes"] <= 64]
    if small:
        out += ["Host overhead, smallest size:", "",
                f"| op | size | myccl us | myccl issue us | {b} us | {b} issue us | ratio |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        for r in small:
            out.append(f"| {r['op']} | {_fmt_size(r['bytes'])} | {_f(r['time_us'], '.1f')} | {_f(r.get('issue_us'), '.1f')} "
                       f"| {_f(r.get('baseline_time_us'), '.1f')} | {_f(r.get('baseline_issue_us'), '.1f')} "
                       f"| {_f(r.get('speedup'), '.2f')} |")
        out.append("")
    big = [r for r in rows if r["bytes"] > 64]
    if big:
        out += ["Bandwidth (busbw per nccl-tests, GB/s):", "",
                f"| op | size | myccl us | myccl busbw | {b} us | {b} busbw | ratio | check |",
                "|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in big:
            chk = "-" if r.get("check") is None else ("ok" if r["check"] else "FAIL")
            out.append(f"| {r['op']} | {_fmt_size(r['bytes'])} | {_f(r['time_us'], '.1f')} | {_f(r['busbw_gbs'], '.2f')} "
                       f"| {_f(r.get('baseline_time_us'), '.1f')} | {_f(r.get('baseline_busbw_gbs'), '.2f')} "
                       f"| {_f(r.get('speedup'), '.2f')} | {chk} |")
        out.append("")
    return out


def _hostcost_md(h: dict) -> list[str]:
    out = [f"World size {h.get('world_size')}, {h.get('gpu')}, torch {h.get('torch')}, NCCL {h.get('nccl')}; "
           f"median of {h.get('rounds')} rounds x {h.get('reps')} ops, the backends measured in turn in every round "
           "(`benchmarks/cuda_host_cost.py --device cuda`). Host time to issue one op: sync = the call with "
           "async_op=False; async = one of 16 issued back to back. Ratio = myccl / nccl (goal: at most 1.00).", "",
           "| op | size | sync myccl us | sync nccl us | ratio | async myccl us | async nccl us | ratio "
           "| allocs/op myccl | nccl |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in h.get("rows", []):
        sr = r["myccl_sync_us"] / r["nccl_sync_us"] if r.get("nccl_sync_us") else None
        ar = r["myccl_issue_us"] / r["nccl_issue_us"] if r.get("nccl_issue_us") else None
        out.append(f"| {r['op']} | {r['size']} | {_f(r['myccl_sync_us'], '.1f')} | {_f(r['nccl_sync_us'], '.1f')} "
                   f"| {_f(sr, '.2f')} | {_f(r['myccl_issue_us'], '.1f')} | {_f(r['nccl_issue_us'], '.1f')} "
                   f"| {_f(ar, '.2f')} | {_f(r.get('myccl_sync_allocs'), '.1f')} | {_f(r.get('nccl_sync_allocs'), '.1f')} |")
    out.append("")
    return out


def _ddp_md(d: dict) -> list[str]:
    a = d.get("args", {})
    out = [f"{d.get('params', 0) / 1e6:.1f}M parameters, world size {a.get('world_size')}"
           + (" sharing GPUs" if d.get("shared_gpu") else "") + f", {a.get('steps')} steps after {a.get('warmup')} "
           f"warm-up, baseline {d.get('baseline')}; tolerance rtol {a.get('rtol')}, atol {a.get('atol')}.", "",
           "| config | step ms | vs nccl | last loss | max abs loss diff | max abs param diff | replicas | result |",
           "|---|---:|---:|---:|---:|---:|---|---|"]
    for name, r in d.get("results", {}).items():
        if not r.get("supported"):
            out.append(f"| {name} | | | | | | | not supported: {r.get('reason', '')} |")
            continue
        base = name == d.get("baseline")
        verdict = "baseline" if base else ("ok" if r.get("matches_baseline") else "DIFFERS")
        out.append(f"| {name} | {r['median_step_s'] * 1e3:.1f} | {_f(r.get('speedup'), '.2f')} | {r['losses'][-1]:.6f} "
                   f"| {'-' if base else _f(r.get('max_loss_diff'), '.1e')} "
                   f"| {'-' if base else _f(r.get('max_param_diff'), '.1e')} "
                   f"| {'same' if r.get('replicas_identical') else 'DIFFER'} | {verdict} |")
    out.append("")
    return out


def _hvd_md(d: dict) -> list[str]:
    out = [f"{d.get('world_size')} ranks" + (" sharing one GPU" if d.get("shared_gpu") else "")
           + f", torch {d.get('torch')}; goal: within 5 % of the baseline "
           f"({'met' if d.get('met') else 'not met'}, {_f(d.get('ratio'), '.3f')}x).", "",
           "| config | img/s | +- | vs baseline |", "|---|---:|---:|---:|"]
    rows = d.get("rows", [])
    base = rows[0]["img_s"] if rows else 0
    for r in rows:
        out.append(f"| {r['config']} | {r['img_s']:.1f} | {r['conf']:.1f} | "
                   f"{_f(r['img_s'] / base if base else None, '.3f')} |")
    ov = d.get("overlap")
    if ov:
        out += ["", f"Rank 0's profiled steps: {ov['nccl_kernels']} NCCL kernels on streams {ov['nccl_streams']}, "
                f"{ov['compute_kernels']} compute kernels on {ov['compute_streams']}; "
                f"{_f(ov.get('overlap'), '.3f')} of NCCL kernel time ({ov['nccl_us']} µs) ran beside compute "
                f"kernels of other streams."]
    out.append("")
    return out


def report(state: str, out_dir: str, dry: bool) -> int:
    raw = os.path.join(state, "raw")
    steps = _steps(state)
    machine = _load_json(os.path.join(raw, "machine.json")) or {}
    build = _load_json(os.path.join(raw, "build_info.json"))
    pkgs = _load_json(os.path.join(raw, "packages.json"))
    tests = {n: _junit(os.path.join(raw, f"{n}.xml")) for n in ("test", "test-multi")}
    lines = {n: _summary_lines(os.path.join(state, "logs", f"{n}.log")) for n in ("test", "test-multi")}
    cb = _load_json(os.path.join(raw, "collbench_cuda.json"))
    ddp = _load_json(os.path.join(raw, "ddp_cuda.json"))
    hostcost = _load_json(os.path.join(raw, "cuda_host_cost.json"))
    ddp_small = _load_json(os.path.join(raw, "ddp_small.json"))
    hvd = _load_json(os.path.join(raw, "hvd_synthetic.json"))
    bad = [n for n, s in steps.items() if s["status"] not in ("pass", "skipped")]
    ok = bool(steps) and not bad
    calls = sorted({s["call"] for s in steps.values() if s["call"]})
    now = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())

    md = [f"# myccl GPU check, {now}", ""]
    if dry:
        md += ["**DRY RUN** (GPU_CHECK_DRY_RUN=1): no GPU was used; the steps checked what can be checked without one.", ""]
    md += [f"**{'PASS' if ok else 'FAIL'}**: {sum(s['status'] == 'pass' for s in steps.values())} of {len(steps)} "
           f"steps passed" + (f"; failed: {', '.join(bad)}" if bad else "")
           + (f" (from {len(calls)} calls: {', '.join(calls)})" if len(calls) > 1 else ""), ""]

    md += ["## Machine", ""]
    gpus = machine.get("gpus") or []
    gpu_names = ", ".join(sorted({g["name"] for g in gpus})) or "none visible"
    md += ["| | |", "|---|---|",
           f"| GPU | {gpu_names} x{machine.get('gpu_count', 0)}"
           + (f", {gpus[0]['memory_gib']} GiB, sm {gpus[0]['capability']}" if gpus else "") + " |",
           f"| driver / its CUDA | {machine.get('driver') or '-'} / {machine.get('driver_cuda') or '-'} |",
           f"| torch / its CUDA / its NCCL | {machine.get('torch', '-')} / {machine.get('torch_cuda') or '-'} / "
           f"{machine.get('nccl_torch', '-')} |",
           f"| python | {machine.get('python', '-')} ({machine.get('python_executable', '-')}) |",
           f"| CPUs / compiler | {machine.get('cpus', '-')} / {machine.get('compiler') or '-'} |"]
    if build:
        md.append(f"| c10d_ext build | {build.get('version')}, with_nccl={build.get('with_nccl')}, "
                  f"NCCL header {build.get('nccl_build_header')}, NCCL runtime {build.get('nccl_runtime_version', '-')}, "
                  f"python {build.get('python')} |")
    else:
        md.append("| c10d_ext build | none (the build step did not produce one) |")
    md.append("")
    if machine.get("topology"):
        md += ["```", machine["topology"], "```", ""]

    md += ["## Steps", "", "| step | what | result | seconds | limit | note |", "|---|---|---|---:|---:|---|"]
    for n in STEPS:
        s = steps.get(n)
        if s is None:
            continue
        earlier = f" (call {s['call']})" if len(calls) > 1 else ""
        md.append(f"| {n} | {WHAT[n]} | {s['status']}{earlier} | {s['seconds']} | {s['limit_s']} | {s['note']} |")
    md.append("")

    for n in ("test", "test-multi"):
        if n not in steps:
            continue
        md += [f"## Tests ({n})", ""]
        t = tests[n]
        if t:
            md.append(f"{t['passed']} passed, {t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped "
                      f"in {t['seconds']} s")
            for fcase in t["failed"]:
                md.append(f"- {fcase['kind'].upper()} `{fcase['test']}`: {fcase['message']}")
            md.append("")
            if t.get("files"):
                md += ["| test file | passed | failed | skipped |", "|---|---:|---:|---:|"]
                md += [f"| {f} | {c['passed']} | {c['failed']} | {c['skipped']} |" for f, c in sorted(t["files"].items())]
                md.append("")
        if lines[n]:
            md += ["```"] + lines[n] + ["```", ""]
        elif not t:
            md += [f"no result (see logs/{n}.log)", ""]

    md += ["## Host cost per op: myccl vs nccl", ""]
    md += _hostcost_md(hostcost) if hostcost else ["no result (see logs/hostcost.log)", ""]
    md += ["## DDP on many small parameters (small buckets): myccl vs nccl", ""]
    md += _ddp_md(ddp_small) if ddp_small else ["no result (see logs/hostcost.log)", ""]
    md += ["## Collectives: myccl vs nccl", ""]
    md += _collbench_md(cb) if cb else ["no result (see logs/bench.log)", ""]
    md += ["## DDP training: myccl vs nccl", ""]
    md += _ddp_md(ddp) if ddp else ["no result (see logs/ddp.log)", ""]
    md += ["## Horovod's synthetic benchmark: c10d_ext.horovod vs torch DDP over nccl", ""]
    md += _hvd_md(hvd) if hvd else ["no result (see logs/hvd.log)", ""]
    if pkgs:
        md += ["## Packages", "", ", ".join(f"{k} {v['version']} ({v['where']})" for k, v in pkgs.items()), ""]
    md += ["## Logs", "", "Every step's full output: " + ", ".join(f"`logs/{n}.log`" for n in STEPS if n in steps)
           + "; raw results in `raw/`.", ""]

    os.makedirs(out_dir, exist_ok=True)
    for sub in ("logs", "raw"):
        src, dst = os.path.join(state, sub), os.path.join(out_dir, sub)
        if os.path.isdir(src) and os.path.abspath(src) != os.path.abspath(dst):
            os.makedirs(dst, exist_ok=True)
            for name in os.listdir(src):
                if os.path.isfile(os.path.join(src, name)):
                    shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    with open(os.path.join(out_dir, "report.md"), "w") as f:
        f.write("\n".join(md))
    doc = {"created": now, "dry_run": dry, "ok": ok, "failed_steps": bad, "steps": steps, "machine": machine,
           "packages": pkgs, "build_info": build, "tests": tests, "test_summary_lines": lines,
           "collbench": cb, "ddp": ddp, "hostcost": hostcost, "ddp_small_params": ddp_small, "hvd_synthetic": hvd}
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(os.path.join(out_dir, "report.md"))
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--probe"]:
        print(json.dumps(probe(), indent=1))
    elif argv[:1] == ["--packages"]:
        print(json.dumps(packages(), indent=1))
    elif argv[:1] == ["--junit"] and len(argv) == 2:
        res = _junit(argv[1])
        if res is None:
            print(f"no JUnit XML at {argv[1]}")
            return 1
        print(f"{res['passed']} passed, {res['failures']} failed, {res['errors']} errors, {res['skipped']} skipped")
        return 0 if res["passed"] > 0 and not res["failures"] and not res["errors"] else 1
    elif argv[:1] == ["--setup-config"] and len(argv) == 2:
        setup_config(argv[1])
    elif argv[:1] == ["--report"] and len(argv) in (3, 5):
        dry = len(argv) == 5 and argv[3] == "--dry" and argv[4] == "1"
        return report(argv[1], argv[2], dry)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
