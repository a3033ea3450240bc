"""The rollout log, LOG_DIR/RUN_NAME/rollouts.jsonl: what each logged step sampled, scored and did to each token, one
JSON record per line (docs/rollout-log.md), flushed as each step ends. python -m tiny_grpo.view draws it as a page."""

import json, math, os, sys, time, uuid  # noqa: E401
from pathlib import Path

from tiny_grpo.files import write_atomically
from tiny_grpo.skill import faithful

NAME = "rollouts.jsonl"
TOKEN_VALUES = ("logp_old", "ratio", "clipped", "kl", "logp_new")  # grpo_loss' (StepStatistics' tokens), and pi_new's
NEW_LOG_PROB_GROUPS = 1  # logged groups a step whose log pi_new is taken after the update (add_new_log_probs)


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
    """RolloutLog(args, resumed_step, weights): opens the log of a run (a resumed one first drops what other
    branches of the run wrote, as TensorBoard's purge_step does; kept_lines) and appends this start's run record,
    then .step(...) and .evaluation(...) append. With --log-rollouts 0 it only drops those lines. It sets
    args.log_starts to the starts of this branch, this one last, which each checkpoint records (training_state)."""

    def __init__(self, args, resumed_step, weights=None, tokenizer=None):
        self.interval, self.groups = defaults(args)
        self.args, self.tokenizer, self.pieces, self.file = args, tokenizer, {}, None
        self.path = Path(args.log_dir) / args.run_name / NAME
        self.start = uuid.uuid4().hex[:16]  # this start's id, in its run record and in its checkpoints' log_starts
        try:
            old = self.path.read_text(encoding="utf-8", errors="replace") if is_file(self.path) else None
        except OSError as e:  # an unreadable log: this start logs nothing rather than lose it
            self.failed(e)
            return
        kept, starts = kept_lines(old or "", resumed_step, getattr(args, "log_starts", None))
        args.log_starts = starts + [self.start]
        if self.interval:  # the options this start samples and trains with, from the step it starts at
            kept.append(json.dumps({"kind": "run", "experiment": args.experiment, "run_name": args.run_name,
                                    "group_size": args.group_size, "clip_eps": getattr(args, "clip_eps", None),
                                    "kl_weight": args.kl_weight, "max_length": args.max_length,
                                    "temperature": args.temperature, "reward_weights": dict(weights or {}),
                                    "epochs_per_step": getattr(args, "epochs_per_step", 1),
                                    "updates_per_step": getattr(args, "updates_per_step", 1),  # ddp: one a pass
                                    "start_step": resumed_step, "start": self.start}, ensure_ascii=False))
        if self.interval or old is not None:  # the log off: the purge alone, no log made
            self.write_file(kept)

    def write_file(self, lines):
        """The log as these lines, replaced in one rename, then open to append (unless logging is off): both in the
        run's folder, whatever link a crashed or hostile start left at the log's names (write_atomically)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(self.path, "".join(line + "\n" for line in lines))
            if self.interval:  # O_NOFOLLOW: a link put at the log's name since the rename is refused, not followed
                self.file = open(os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW), "a", encoding="utf-8")
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
        seconds = self.add_new_log_probs(per_row, count, size, stats.get("new_log_probs"))
        groups = []
        for i in range(count):
            rows = range(i * size, (i + 1) * size)
            rewards = [result.rewards[r].item() for r in rows]
            groups.append({"index": i, "question": str(tasks[i].get("question", "")), "prompt": str(tasks[i]["prompt"]),
                           "answer": str(tasks[i].get("answer", "")), "rewards_equal": max(rewards) == min(rewards),
                           "completions": [self.completion(result, r, advantages, per_row.get(r)) for r in rows]})
        self.write({"kind": "step", "step": step, "scalars": {k: rounded(v) for k, v in scalars.items()
                                                               if isinstance(v, (int, float))}, "groups": groups,
                    "logp_new_seconds": None if seconds is None else rounded(seconds)})

    @staticmethod
    def add_new_log_probs(per_row, groups, size, new_log_probs):
        """log pi_new(a_t | s_t) after the step's last update, of the first logged group a pass ran (it has log
        pi_old): one more no-grad pass (train_step's new_log_probs). One group a step, NEW_LOG_PROB_GROUPS: over every
        row the pass cost 8.8 s of a 50 s step in the default CPU run (the output layer over each action token, as a
        training forward). Returns its seconds, or None where it did not run."""
        ran = [rows for rows in (list(range(i * size, (i + 1) * size)) for i in range(groups))
               if any(row in per_row and "logp_old" in per_row[row] for row in rows)][:NEW_LOG_PROB_GROUPS]
        rows = [row for group in ran for row in group if row in per_row and "logp_old" in per_row[row]]
        if new_log_probs is None or not rows:
            return None
        import torch

        started = time.perf_counter()
        for row, values in zip(rows, new_log_probs(torch.tensor(rows))):
            per_row[row]["logp_new"] = values
        return time.perf_counter() - started

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
        import torch

        right = result.terms.get("correctness", torch.zeros(len(result.completions)))
        self.write({"kind": "eval", "step": step, "metrics": {k: rounded(v) for k, v in metrics.items()},
                    "completions": [{"question": str(task.get("question", "")), "prompt": str(task["prompt"]),
                                     "answer": str(task.get("answer", "")), "text": text, "correct": bool(right[i] == 1),
                                     "faithful": faithful(getattr(self.args, "task", None), str(task.get("question", "")),
                                                          text),
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


def is_file(path):
    """A file of its own: a symbolic link at the log's name is no log of this run (its target is not read)."""
    return path.is_file() and not path.is_symlink()


def kept_lines(text, resumed_step, branch):
    """(the lines of the log text that a start resuming from resumed_step keeps, the starts they belong to). branch:
    the starts whose lines the checkpoint's branch holds (its log_starts: each start's lines follow its run record;
    the lines before any record with a start are None's), [] for a fresh start; their lines up to resumed_step are
    kept, a newer branch's are not. None, a checkpoint from before log_starts: every start's up to resumed_step."""
    kept, starts, start = [], [], None
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a crash
            continue
        if not isinstance(record, dict):
            continue
        run = record.get("kind") == "run"
        start = record.get("start") if run else start
        if (branch is None or start in branch) and (run or record.get("step", 0) <= resumed_step):
            kept.append(line)
            starts += [start] if start not in starts else []
    return kept, starts
