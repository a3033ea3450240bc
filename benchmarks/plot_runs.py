"""Compare training runs: curves of chosen TensorBoard tags as a PNG, and a table of their values.

Reads the event files every experiment writes (`--log-dir/--run-name`), draws one panel per tag
with one line per run, and prints a Markdown table of each tag's mean over the first and the last
--window steps of each run (and writes it as JSON with --json).

    python benchmarks/plot_runs.py runs/grpo-20 runs/drgrpo-20 --out benchmarks/figures/algorithms.png
    python benchmarks/plot_runs.py runs/tool20 --tags rollout/reward_mean rollout/tool_calls_per_episode

A run is named by its folder's name and read as TensorBoard reads it: the event files in the folder
itself (not in a subfolder, such as the superseded-*/ that train.py sets an earlier start's events
aside in), with the steps that a --resume from an earlier checkpoint wrote again in place of the
first ones. A tag a run did not log is left out of that run's panel and table row, and a folder
without event files of its own is an error. An event file cut short or damaged (a copy
stopped half-way, a full disk) is named with a warning: its records up to the damage are used.
"""

import argparse
import json
import sys
from pathlib import Path

from common import event_files, output_file, scalars

TAGS = ["rollout/reward_mean", "rollout/accuracy", "rollout/format_rate", "train/kl"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run folders holding TensorBoard event files")
    p.add_argument("--tags", nargs="+", default=TAGS, help="scalar tags to compare (default: %(default)s)")
    p.add_argument("--window", type=int, default=5, help="steps averaged at the start and the end (default: %(default)s)")
    p.add_argument("--out", type=output_file, help="write the curves here as a PNG")
    p.add_argument("--title", default="", help="the figure's title")
    p.add_argument("--json", type=output_file, help="also write the table as JSON here")
    return p.parse_args(argv)


def cut_short(events):
    """The byte at which an event file's records stop making sense, or None when they run whole to its end. A record
    is an 8-byte length, its 4-byte checksum, the data and the data's 4-byte checksum (TFRecord); TensorBoard's reader
    stops at the first bad one without a word, so a file cut short reads as a run that logged less."""
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c

    size, at = events.stat().st_size, 0
    with open(events, "rb") as f:
        while at < size:
            header = f.read(12)
            length = int.from_bytes(header[:8], "little")
            whole = len(header) == 12 and at + 16 + length <= size
            if not whole or int.from_bytes(header[8:], "little") != masked_crc32c(header[:8]):
                return at
            at += 16 + length
            f.seek(at)
    return None


def first_and_last(points, window):
    """(mean of the first `window` values, mean of the last `window` values) of [(step, value), ...]."""
    values = [value for _, value in points]
    head, tail = values[:window], values[-window:]
    return sum(head) / len(head), sum(tail) / len(tail)


def plot(curves, tags, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, panels = plt.subplots(len(tags), 1, figsize=(8, 2.4 * len(tags) + 0.6), sharex=True, squeeze=False)
    for panel, tag in zip(panels[:, 0], tags):
        for run, run_curves in curves.items():
            if tag in run_curves:
                steps, values = zip(*run_curves[tag])
                panel.plot(steps, values, marker=".", label=run)
        panel.set_ylabel(tag.split("/")[-1])
        panel.grid(alpha=0.3)
    panels[0, 0].legend(fontsize="small")
    panels[-1, 0].set_xlabel("step")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv=None):
    args = parse_args(argv)
    if args.window < 1:
        sys.exit(f"error: --window must be at least 1, got {args.window}")
    curves, damaged = {}, []
    for folder in args.runs:
        if not event_files(folder):
            sys.exit(f"error: no TensorBoard event files in {folder} (a run's are in its own folder, LOG_DIR/RUN_NAME)")
        for events in event_files(folder):
            at = cut_short(events)
            if at is not None:
                damaged.append(f"{events} is cut short or damaged: its records stop at byte {at} of {events.stat().st_size}")
                print(f"warning: {damaged[-1]}; the steps after it are missing", file=sys.stderr)
        curves[folder.name] = scalars(folder)
    missing = [tag for tag in args.tags if not any(tag in run_curves for run_curves in curves.values())]
    if missing:
        sys.exit(f"error: {damaged[0]}, and no run logged {', '.join(missing)} (--tags) before that" if damaged
                 else f"error: no run logged {', '.join(missing)} (--tags)")

    table = {run: {tag: first_and_last(run_curves[tag], args.window) for tag in args.tags if tag in run_curves}
             for run, run_curves in curves.items()}
    print(f"mean of the first / last {args.window} steps\n")
    print("| run | steps | " + " | ".join(args.tags) + " |")
    print("| --- | --- |" + " --- |" * len(args.tags))
    for run, row in table.items():
        steps = max(len(points) for points in curves[run].values())
        cells = [f"{row[tag][0]:.2f} -> {row[tag][1]:.2f}" if tag in row else "" for tag in args.tags]
        print(f"| {run} | {steps} | " + " | ".join(cells) + " |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        plot(curves, args.tags, args.out, args.title)
        print(f"\nwrote {args.out}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"window": args.window, "table": table, "curves": curves}, indent=2))


if __name__ == "__main__":
    main()
