"""The GPU check: what a GPU machine should measure first, as one command of at most 8 minutes (--seconds).

Five parts, in this order, each in a process of its own under its own time limit (LIMITS; never past the whole
check's end). Each part's JSON is written under --out (gpu_check.sh: $OUT) as soon as the part has it, and one line
is printed as the part ends, so that a command stopped by its time limit keeps every part it finished:

  1. tests/test_cuda.py: the CUDA-graph decode test first, then the rest;
  2. the decode speed at 16 prompts x 16 completions x 256 tokens: GraphDecode against the eager DecodeBatch, in one
     process, on the same prompts and seed (experiment_base's rollout, as training samples);
  3. three steps at the CUDA defaults (gpu_run.py's: the Llama-3.2-1B architecture with random weights, 4-bit NF4 +
     LoRA, 16 x 8 x 512, a 24 GB cap), each phase's peak GPU memory, allocated and reserved;
  4. memory_estimate.py's estimate for those settings against part 3's reserved peaks;
  5. where time is left, TRL's GRPOTrainer beside experiment_base at 16 x 16 x 256 (gpu_run.py's run_trl).

A part that fails, runs out of time or has none left says so in its JSON's "status" (with what it had saved), and the
next one starts. The output also goes to gpu_check.log beside the JSON (gpu_check.sh).

    bash benchmarks/gpu_check.sh               # on the GPU machine: the wheels of gpu_wheels.sh, then this (docs/gpu.md)
    bash benchmarks/gpu_check.sh --dry-run     # the same parts on the CPU, on gpu_run.py's small dry-run model,
                                               # written under $OUT/dry_run/: a GPU run's results in $OUT stay
"""

import argparse
import datetime
import functools
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

# What every part imports (common.py imports torch at once): looked for before anything imports them, so that a
# python without one is named in a line, not shown in a traceback
NEEDED = ("torch", "transformers", "peft", "safetensors", "tokenizers")


def missing_packages():
    """The line that names this python and the NEEDED packages it lacks, or None."""
    missing = [name for name in NEEDED if importlib.util.find_spec(name) is None]
    if missing:
        return (f"error: {sys.executable} (Python {sys.version.split()[0]}) has no {', '.join(missing)}: run the check "
                "with a python that has them (PYTHON=... bash benchmarks/gpu_check.sh)")
    return None


if __name__ == "__main__" and missing_packages():
    sys.exit(missing_packages())

from common import ROOT, load_experiment, machine, output_folder, step_summary, write_json  # noqa: E402
from tiny_grpo.stopping import Interrupts, say  # noqa: E402

NAMES = {1: "tests", 2: "decode", 3: "default_steps", 4: "estimate", 5: "trl"}
LIMITS = {1: 120, 2: 90, 3: 150, 4: 90, 5: 480}  # seconds a part may take; part 5 takes what is left
LEAST = 30  # seconds a part needs at the least: with less left it is skipped
GRAPH_TEST = "test_the_graph_decode_step_on_cuda"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=output_folder, help="the folder for each part's JSON (default: $OUT, else "
                   "output/gpu_check; with --dry-run its dry_run/ folder, so that a GPU run's results brought back there stay)")
    p.add_argument("--seconds", type=float, default=480, help="the whole check's time (default: %(default)s)")
    p.add_argument("--dry-run", action="store_true", help="the same parts on the CPU, on gpu_run.py's small "
                   "model and sizes (2 prompts x 2 completions x 8 tokens), in seconds: for the tests")
    p.add_argument("--part", type=int, choices=NAMES, help=argparse.SUPPRESS)  # one part, in this process
    p.add_argument("--folder", type=Path, help=argparse.SUPPRESS)  # where the parts share the random model
    # gpu_check.sh's first call: the refusal, or the folder the check writes in, before it makes the folder and the log
    p.add_argument("--ready", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.out is None:
        args.out = Path(os.environ.get("OUT") or ROOT / "output" / "gpu_check") / ("dry_run" if args.dry_run else "")
        try:
            output_folder(str(args.out))
        except argparse.ArgumentTypeError as e:
            p.error(f"--out {args.out} (from $OUT): {e}")
    return args


def json_path(out, part):
    return out / f"part{part}_{NAMES[part]}.json"


# ---- The parts: each returns (its result, a one-line summary); save(result, status) writes its JSON earlier ----

def tests(args, save):
    """tests/test_cuda.py under pytest: the graph test alone first, then the rest (on a GPU in 8 worker processes)."""
    runs = {}
    with tempfile.TemporaryDirectory() as folder:
        for run, selection in (("graph", [f"tests/test_cuda.py::{GRAPH_TEST}"]),
                               ("rest", ["tests/test_cuda.py", "-k", f"not {GRAPH_TEST}"])):
            workers = ["-n", "0"] if args.dry_run or run == "graph" else ["-n", "8", "--dist", "load"]
            report = Path(folder) / f"{run}.xml"
            command = [sys.executable, "-m", "pytest", *selection, "-q", "-p", "no:cacheprovider", *workers,
                       f"--junitxml={report}"]
            runs[run] = {"returncode": subprocess.run(command, cwd=ROOT).returncode,
                         **outcomes(report if report.exists() else None)}
    return runs, "; ".join(f"{run}: " + ", ".join(f"{r[o]} {o}" for o in ("passed", "failed", "skipped") if r[o])
                           for run, r in runs.items())


def outcomes(report):
    """From pytest's JUnit XML: each test's outcome (passed, failed, skipped), their counts, each failure's message."""
    tests, failures = {}, {}
    for case in ElementTree.parse(report).iter("testcase") if report else []:
        failure = next((e for e in case if e.tag in ("failure", "error")), None)
        tests[case.get("name")] = "failed" if failure is not None else "skipped" if case.find("skipped") is not None else "passed"
        if failure is not None:
            failures[case.get("name")] = (failure.get("message") or "")[:500]
    counts = {outcome: list(tests.values()).count(outcome) for outcome in ("passed", "failed", "skipped")}
    return {**counts, "tests": tests, "failures": failures}


def decode(args, save):
    """experiment_base's rollout at 16 x 16 x 256 with the CUDA-graph decode step and with the eager one, alternated
    after a short warm-up of each, in one process on the same prompts and seed (on the CPU GraphDecode runs its
    static step eagerly: graphs=False)."""
    import gpu_run
    from tiny_grpo import decode as decoding

    sizes = gpu_run.parse_args(["--prompts", "16", "--group-size", "16", "--max-new-tokens", "256", "--steps", "1"]
                               + ["--dry-run"] * args.dry_run)
    base, options, tokenizer, tasks = gpu_run.setup(sizes, args.model, args.device)
    torch, cuda = base.torch, args.device.startswith("cuda")
    model, tokenizer = base.load_model(options)
    model.eval()
    ways, made = {"eager": decoding.DecodeBatch, "graph": lambda *a: decoding.GraphDecode(*a, graphs=cuda)}, []

    def rollout(way, tokens):
        decoding.decode_batch = lambda *a: made.append(ways[way](*a)) or made[-1]
        torch.manual_seed(0)
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        with base.sampling_weights(model, options):
            result = base.rollout(model, tokenizer, tasks[:sizes.prompts], sizes.group_size, tokens,
                                  options.temperature, generation_batch_size=options.generation_batch_size)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - started, result

    for way in ways:  # warm-up: the kernels, the allocator, a first capture
        rollout(way, 8)
    seconds, results = {way: [] for way in ways}, {}
    for _ in range(2):
        for way in ways:
            took, results[way] = rollout(way, sizes.max_new_tokens)
            seconds[way].append(took)
    result = {way: {"seconds": min(s), "all_seconds": s, "tokens": int(results[way].action_mask.sum()),
                    "tokens_per_second": int(results[way].action_mask.sum()) / min(s)} for way, s in seconds.items()}
    graph = made[-1]  # the last rollout's decode
    result.update(graph_over_eager=result["graph"]["tokens_per_second"] / result["eager"]["tokens_per_second"],
                  completions_unlike=sum(a != b for a, b in zip(results["graph"].completions, results["eager"].completions)),
                  graph_captured=getattr(graph, "graph", None) is not None, graph_trouble=list(decoding.GRAPH_TROUBLE),
                  settings={"prompts": sizes.prompts, "group_size": sizes.group_size, "max_new_tokens": sizes.max_new_tokens})
    return result, (f"graph {result['graph']['tokens_per_second']:.0f} tokens/s, eager {result['eager']['tokens_per_second']:.0f}"
                    f" ({result['graph_over_eager']:.2f}x); graph captured: {result['graph_captured']}")


def default_steps(args, save):
    """gpu_run.py's steps at the CUDA defaults (16 x 8 x 512, 24 GB cap), three of them, with each phase's peaks."""
    import gpu_run

    sizes = gpu_run.parse_args(["--steps", "3"] + ["--dry-run"] * args.dry_run)
    steps, prompt_tokens = gpu_run.run_steps(sizes, args.model, args.device)
    peaks = {phase: {kind: max(s[f"{phase}_{kind}_gb"] for s in steps) for kind in ("allocated", "reserved")}
             for phase in ("sampling", "training")} if "sampling_reserved_gb" in steps[0] else None
    summary = step_summary(steps)
    result = {"settings": settings(sizes), "steps": steps, "prompt_tokens": prompt_tokens, "peak_gb": peaks,
              "summary": summary, "hours_for_500_steps": 500 * summary["step_seconds"] / 3600}
    where = (f"peak GB reserved: sampling {peaks['sampling']['reserved']:.2f}, training {peaks['training']['reserved']:.2f}"
             if peaks else "no GPU peaks (CPU)")
    return result, f"{summary['step_seconds']:.1f} s a step, {result['hours_for_500_steps']:.1f} h for 500; {where}"


def estimate(args, save):
    """memory_estimate.py's peaks for part 3's settings and prompts, against part 3's reserved peaks (its JSON)."""
    import gpu_run
    import memory_estimate

    sizes = gpu_run.parse_args(["--steps", "3"] + ["--dry-run"] * args.dry_run)
    if args.dry_run:  # the dry run's small widths here too: at Llama-3.2-1B's, this part took 25 s on a 2-core CPU
        memory_estimate.build_random_llama = functools.partial(gpu_run.build_random_llama, **gpu_run.DRY_RUN_SHAPE)
    steps = json_path(args.out, 3)
    measured = (json.loads(steps.read_text()).get("result") or {}) if steps.exists() else {}
    parts = memory_estimate.measure(argparse.Namespace(tiny=args.dry_run, lora_r=sizes.lora_r,
                                                       measure_tokens=32 if args.dry_run else 256))
    estimated = gpu_run.estimate(sizes, measured.get("prompt_tokens", 0), sizes.generation_batch_size,
                                 sizes.train_batch_size, parts)
    reserved = {phase: peaks["reserved"] for phase, peaks in measured["peak_gb"].items()} if measured.get("peak_gb") else None
    ratio = {phase: estimated[phase] / reserved[phase] for phase in estimated} if reserved else None
    result = {"settings": settings(sizes), "estimate_gb": estimated, "reserved_gb": reserved, "estimate_over_reserved": ratio}
    return result, (f"estimate GB: sampling {estimated['sampling']:.2f}, training {estimated['training']:.2f}; "
                    + (f"over the reserved peak: {ratio['sampling']:.2f}, {ratio['training']:.2f}" if ratio
                       else "no reserved peak from part 3 to set it against"))


def trl(args, save):
    """experiment_base's steps at 16 x 16 x 256 (saved at once), then TRL's GRPOTrainer on the same (gpu_run.py)."""
    import importlib.util

    import gpu_run

    sizes = gpu_run.parse_args(["--prompts", "16", "--group-size", "16", "--max-new-tokens", "256", "--steps", "2"]
                               + ["--dry-run"] * args.dry_run)
    steps, _ = gpu_run.run_steps(sizes, args.model, args.device)
    result = {"settings": settings(sizes), "steps": steps, "trl": None, "side_by_side": None, "step_time_over_trl": None}
    save(result, "experiment_base done, TRL running")
    if importlib.util.find_spec("trl") is None:
        result["trl"] = {"steps": [], "error": "skipped: TRL is not installed"}
    else:
        result["trl"] = gpu_run.run_trl(sizes, args.model, args.device)
    if result["trl"]["steps"]:
        result["side_by_side"] = sides = gpu_run.side_by_side(steps, result["trl"], args.device.startswith("cuda"))
        result["step_time_over_trl"] = sides["experiment_base"]["step_seconds"] / sides["TRL"]["step_seconds"]
        return result, (f"{sides['experiment_base']['step_seconds']:.1f} s a step against TRL's "
                        f"{sides['TRL']['step_seconds']:.1f} ({result['step_time_over_trl']:.2f}x)")
    return result, f"experiment_base {step_summary(steps)['step_seconds']:.1f} s a step; TRL: {result['trl']['error']}"


PARTS = {1: tests, 2: decode, 3: default_steps, 4: estimate, 5: trl}


def settings(sizes):
    return {name: getattr(sizes, name) for name in ("steps", "prompts", "group_size", "max_new_tokens",
                                                     "generation_batch_size", "train_batch_size", "lora_r", "memory_cap_gb")}


# ---- Running the parts ----

def run_part(args):
    """This process runs part args.part and writes its JSON."""
    import gpu_run

    load_experiment()  # its import sets the CUDA allocator's options, before anything starts CUDA
    import torch

    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.cuda.get_device_name(0) if cuda else "CPU (dry run)"
    if cuda and args.part in (2, 3, 5):
        gpu_run.cap_memory(torch, 24.0)  # gpu_run.py's cap: the GPU as a 24 GB card
    args.device = "cuda:0" if cuda else "cpu"
    args.model = args.folder / "llama"  # the random Llama, built once for the parts that load it
    if args.part in (2, 3, 5) and not args.model.exists():
        building = args.folder / "building"  # renamed when whole: a part stopped while building leaves no half model
        shutil.rmtree(building, ignore_errors=True)
        gpu_run.build_random_llama(building, **(gpu_run.DRY_RUN_SHAPE if args.dry_run else {}))
        building.rename(args.model)
    where = machine(f"bfloat16 on {device}")
    started = time.perf_counter()

    def save(result, status, summary=None):
        write_json(json_path(args.out, args.part), {"part": args.part, "name": NAMES[args.part], "status": status,
                                                   "seconds": time.perf_counter() - started, "summary": summary,
                                                   "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                                                   "device": device, "result": result}, where)

    result, summary = PARTS[args.part](args, save)
    save(result, "done", summary)


def unready(args):
    """Why this python cannot run the check, in one line, or None: a package missing, or no CUDA without --dry-run."""
    if missing_packages():
        return missing_packages()
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            return (f"error: no CUDA device here (torch {torch.__version__} in {sys.executable}); --dry-run runs the "
                    "same parts on the CPU")
    return None


def main(argv=None):
    args = parse_args(argv)
    if args.part:
        return run_part(args)
    if unready(args):  # before anything is written: a GPU run's JSON and log in --out stay as they are
        raise SystemExit(unready(args))
    if args.ready:  # gpu_check.sh makes this folder and the log in it next
        print(args.out)
        return
    args.out.mkdir(parents=True, exist_ok=True)  # finish() writes a part's JSON there, the part's or not
    end = time.monotonic() + args.seconds
    folder = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    try:
        for part in PARTS:
            limit = min(LIMITS[part], end - time.monotonic())
            path = json_path(args.out, part)
            path.unlink(missing_ok=True)
            started = time.monotonic()
            if limit < LEAST:
                status = f"skipped: {max(0, end - time.monotonic()):.0f} s left of the check's {args.seconds:.0f}"
            else:
                try:
                    status = run_process(part_command(args, part, folder), limit)
                except KeyboardInterrupt as stop:  # stopped already (run_process): its JSON says so, then the folder goes
                    finish(path, part, f"interrupted ({stop or 'SIGINT'})", time.monotonic() - started)
                    raise
            finish(path, part, status, time.monotonic() - started)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def part_command(args, part, folder):
    """The command that runs one part in a process of its own."""
    return ([sys.executable, __file__, "--part", str(part), "--out", str(args.out), "--folder", str(folder)]
            + ["--dry-run"] * args.dry_run)


def run_process(command, limit):
    """Run command in a process group of its own for at most limit seconds: "done", or what stopped it. On Ctrl-C or
    SIGTERM (KeyboardInterrupt, raised on) the group is stopped first: nothing of the part runs on once the check
    ends and removes the folder of the random model it may be writing."""
    process = subprocess.Popen(command, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        return f"failed: exit status {process.returncode}" if process.wait(timeout=limit) else "done"
    except subprocess.TimeoutExpired:
        stop_group(process)
        return f"timed out after {limit:.0f} s"
    except BaseException:
        stop_group(process)
        raise


def stop_group(process, seconds=10):
    """Kill the process and every process it started (its group), and wait for it and, at most `seconds`, for the
    rest of the group to be gone: a process killed goes on a moment after its leader has been waited for."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # ended already, and all it started
        pass
    process.wait()
    deadline = time.monotonic() + seconds
    while running_in_group(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def running_in_group(group):
    """Whether a process of this process group still runs (a zombie, ended and not yet reaped, does not)."""
    for entry in os.listdir("/proc"):
        try:
            fields = Path("/proc", entry, "stat").read_text().rpartition(")")[2].split()
        except (OSError, ValueError):  # not a process, or one that ended meanwhile
            continue
        if entry.isdigit() and int(fields[2]) == group and fields[0] != "Z":
            return True
    return False


def finish(path, part, status, seconds):
    """The part's JSON kept, or made, with its status and wall seconds; then the part's line."""
    data = json.loads(path.read_text()) if path.exists() else {"part": part, "name": NAMES[part], "result": None}
    if status != "done" or "status" not in data:  # a part stopped after saving some of its result says what
        data["status"] = status + (f" ({data['status']})" if "status" in data else "")
    data["wall_seconds"] = seconds
    path.write_text(json.dumps(data, indent=2))
    print(f"part {part} ({NAMES[part]}, {seconds:.0f} s): {data.get('summary') if data['status'] == 'done' else data['status']}"
          f" -> {path}", flush=True)


def command_line():
    """python benchmarks/gpu_check.py: SIGTERM and SIGHUP as Ctrl-C, which stops the part running (its JSON says so;
    a second one waits for that) and exits with 130."""
    Interrupts()
    try:
        main()
    except KeyboardInterrupt as stop:
        say(f"interrupted ({stop or 'SIGINT'}): the part running was stopped; the parts that ended are kept")
        sys.exit(130)


if __name__ == "__main__":
    command_line()
