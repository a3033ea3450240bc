"""The rollout log, LOG_DIR/RUN_NAME/rollouts.jsonl: what each logged step sampled, scored and did to each token, one
JSON record per line (docs/rollout-log.md), flushed as each step ends. python -m tiny_grpo.view draws it as a page."""

import json, math, os, sys  # noqa: E401
from pathlib import Path

import torch

NAME = "rollouts.jsonl"
TOKEN_VALUES = ("logp_old", "ratio", "clipped", "kl")  # grpo_loss' per-token values (StepStatistics' tokens)


def rounded(value):
    """4 significant digits; None for nan and inf, which JSON has no word for."""
    value = float(value)
    return float(f"{value:.4g}") if math.isfinite(value) else None


def defaults(args):
    """--log-rollouts and --log-rollout-groups where not given: every step and group on a CPU (the 20-step demo),
    every 10th step and 4 groups on CUDA (a 500-step run of 16 groups of 512 tokens)."""
    cuda = args.device.startswith("cuda")
    interval = args.log_rollouts if args.log_rollouts is not None else (10 if cuda else 1)
    groups = args.log_rollout_groups if args.log_rollout_groups is not None else (4 if cuda else 0)
    return interval, groups


class RolloutLog:
    """RolloutLog(args, resumed_step, weights): opens the log of a run (a resumed one first drops what a crashed run
    wrote after its checkpoint, as TensorBoard's purge_step does), then .step(...) and .evaluation(...) append."""

    def __init__(self, args, resumed_step, weights=None, tokenizer=None):
        self.interval, self.groups = defaults(args)
        self.args, self.tokenizer, self.pieces, self.file = args, tokenizer, {}, None
        self.path = Path(args.log_dir) / args.run_name / NAME
        if not self.interval:
            return
        kept = []
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    record = json.loads(line)
                except ValueError:  # a line cut short by a crash
                    continue
                if record.get("kind") == "run" or record.get("step", 0) <= resumed_step:
                    kept.append(line)
        if not kept:
            kept.append(json.dumps({"kind": "run", "experiment": args.experiment, "run_name": args.run_name,
                                    "group_size": args.group_size, "clip_eps": getattr(args, "clip_eps", None),
                                    "kl_weight": args.kl_weight, "max_length": args.max_length,
                                    "temperature": args.temperature, "reward_weights": dict(weights or {})},
                                   ensure_ascii=False))
        self.write_file(kept)

    def write_file(self, lines):
        """The log as these lines, replaced in one rename (a crash leaves the old or the new), then open to append."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(NAME + ".partial")
            partial.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
            os.replace(partial, self.path)
            self.file = open(self.path, "a", encoding="utf-8")
        except OSError as e:
            self.failed(e)

    def wanted(self, step):
        return self.file is not None and step % self.interval == 0

    def step(self, step, tasks, result, advantages, stats, scalars):
        """The step's record: its scalars, and each logged group's prompt and completions, with their rewards,
        advantages and per-token values (the last update's of each row; None where no pass ran it)."""
        if not self.wanted(step):
            return
        size = self.args.group_size
        per_row = {}
        for rows, values in stats.get("tokens", ()) if advantages is not None else ():  # of the batch trained
            for j, row in enumerate(rows.tolist()):
                per_row[row] = {name: values[name][j] for name in TOKEN_VALUES if name in values}
        count = len(tasks) if not self.groups else min(self.groups, len(tasks))
        groups = []
        for i in range(count):
            rows = range(i * size, (i + 1) * size)
            rewards = [result.rewards[r].item() for r in rows]
            groups.append({"index": i, "question": str(tasks[i].get("question", "")), "prompt": str(tasks[i]["prompt"]),
                           "answer": str(tasks[i].get("answer", "")), "rewards_equal": max(rewards) == min(rewards),
                           "completions": [self.completion(result, r, advantages, per_row.get(r)) for r in rows]})
        self.write({"kind": "step", "step": step, "scalars": {k: rounded(v) for k, v in scalars.items()
                                                               if isinstance(v, (int, float))}, "groups": groups})

    def completion(self, result, row, advantages, values):
        width = result.action_mask.shape[1]
        ids = result.sequence_ids[row, -width:]
        present = result.attention_mask[row, -width:].bool()  # the completion's tokens and context; not the padding
        actions = result.action_mask[row]
        record = {"text": result.completions[row], "reward": rounded(result.rewards[row]),
                  "terms": {name: rounded(v[row]) for name, v in result.terms.items()},
                  "advantage": None if advantages is None else rounded(advantages[row]),
                  "truncated": int(actions.sum()) >= self.args.max_length,
                  "tokens": [self.piece(i) for i in ids[present].tolist()],
                  "action": actions[present].tolist()}
        for name in TOKEN_VALUES:
            if name == "kl" and not (self.args.kl_weight or (values and "kl" in values)):  # measured: beta > 0, --log-kl
                continue
            if values is None or name not in values:  # no pass ran this row (beta = 0, A = 0): nothing computed
                record[name] = None
                continue
            column = values[name].broadcast_to(actions.shape)  # a ratio per sequence (GSPO) holds for each token
            kind = int if name == "clipped" else rounded
            record[name] = [kind(v) if a else None for v, a in zip(column[present].tolist(), actions[present].tolist())]
        return record

    def piece(self, token_id):
        """A token decoded alone (cached: the same ids recur)."""
        if token_id not in self.pieces:
            self.pieces[token_id] = self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)
        return self.pieces[token_id]

    def evaluation(self, step, metrics, tasks, result):
        """A held-out evaluation after `step` steps: its metrics and each completion, right or wrong."""
        if self.file is None or result is None:
            return
        right = result.terms.get("correctness", torch.zeros(len(result.completions)))
        self.write({"kind": "eval", "step": step, "metrics": {k: rounded(v) for k, v in metrics.items()},
                    "completions": [{"question": str(task.get("question", "")), "prompt": str(task["prompt"]),
                                     "answer": str(task.get("answer", "")), "text": text, "correct": bool(right[i] == 1),
                                     "terms": {name: rounded(v[i]) for name, v in result.terms.items()}}
                                    for i, (task, text) in enumerate(zip(tasks, result.completions))]})

    def write(self, record):
        try:
            self.file.write(json.dumps(record, ensure_ascii=False, allow_nan=False) + "\n")
            self.file.flush()
        except OSError as e:
            self.failed(e)

    def failed(self, error):
        """A log that cannot be written (a full disk) is dropped with one warning, as the loggers are."""
        if self.file is not None:
            try:
                self.file.close()
            except OSError:
                pass
        self.file = None
        print(f"writing the rollout log {self.path} failed ({error}); training goes on without it, and checkpoints "
              "are still saved", file=sys.stderr)

    def close(self):
        if self.file is not None:
            self.file.close()
            self.file = None
