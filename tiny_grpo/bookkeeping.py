"""A run's bookkeeping around its loop, in one object: the logger and the rollout log, Ctrl-C and SIGTERM deferred
while an update is made, each phase's memory peak and seconds, the progress bar, the held-out evaluations, a
checkpoint every --checkpoint-interval steps and at the end (with the run's page), the steps done saved when the run
stops early, and the closing line."""

import contextlib, sys, time  # noqa: E401

from tiny_grpo.errors import DivergedError, RewardError
from tiny_grpo.report import Logger, PhasePeaks, diagnostics, held_out, report
from tiny_grpo.rollout_log import RolloutLog
from tiny_grpo.skill import faithful_share
from tiny_grpo.stopping import Interrupts, say, stopped
from tiny_grpo.view import write_page

STOPS = (KeyboardInterrupt, RewardError, DivergedError)  # what ends a run early, the steps done saved


class Silent:
    """The logger and the rollout log of a process that does not log (several processes: the main one logs)."""

    def __getattr__(self, name):  # scalars, text, step, evaluation, close: nothing
        return lambda *args, **kwargs: None


class Bookkeeping:
    """with Bookkeeping(args, run_dir, step, position, save, eval_tasks, tokenizer, weights, baselines=...) as book:
    the loop, which reads book.step and book.position and calls book.phase, book.update, book.evaluation_due,
    book.evaluated and book.report. save(step, position) writes the checkpoint of the steps done (the train.py's:
    what a checkpoint holds is the experiment's); eval_tasks: the held-out tasks an evaluation takes; tokenizer and
    weights ({term: w}): for the rollout log; baselines: the guesses' scores on eval_tasks (tiny_grpo/skill.py's
    baseline_scores). Several processes: main_process=False on all but one, which alone logs, draws the bar and tells
    (every process still saves: the train.py's save may be collective); interrupts: an object that offers Interrupts'
    deferred() and stopping (a run whose processes stop together brings its own)."""

    def __init__(self, args, run_dir, step, position, save, eval_tasks, tokenizer=None, weights=None,
                 main_process=True, interrupts=None, baselines=None):
        from tqdm import tqdm

        self.args, self.run_dir, self.step, self.position = args, run_dir, step, position
        self.save_steps, self.eval_tasks, self.weights = save, eval_tasks, dict(weights or {})
        self.baselines = dict(baselines or {})  # eval/baseline_*: the guesses' scores, logged with each evaluation
        self.main, self.interrupts, self.memory = main_process, interrupts or Interrupts(), PhasePeaks(args.device)
        self.logger = Logger(args, step) if main_process else Silent()
        self.rollouts = RolloutLog(args, step, self.weights, tokenizer) if main_process else Silent()  # rollouts.jsonl
        # step: the held-out evaluation's metrics, for the progress bar and the closing line; a resumed run's from
        # its checkpoint (the accuracy alone), so that both show the whole run's, from step 0
        self.evals = {s: {"eval/accuracy": accuracy} for s, accuracy in getattr(args, "held_out", None) or []}
        self.progress = tqdm(total=args.max_steps, initial=step, desc=args.run_name, dynamic_ncols=True,
                             disable=not main_process)
        self.started = self.sampled = self.last_length = None  # the step's clock; the last step's completion length
        # the evaluation a stop cut short at the step resumed from (claim_run read it): the loop makes it first
        self.evaluation_owed, self.reported = bool(getattr(args, "evaluation_owed", False)), True

    def __enter__(self):
        return self

    @contextlib.contextmanager
    def phase(self, name):
        """A phase of a step ("sampling", "training"), its memory peak logged; the first starts the step's clock."""
        self.started = self.started or time.perf_counter()
        with self.memory.phase(name):
            yield
        if name == "sampling":
            self.sampled = self.sampled or time.perf_counter()

    @contextlib.contextmanager
    def update(self, next_position):
        """The update: weights, optimizer and step change together, a Ctrl-C waits until the block ends."""
        with self.interrupts.deferred(), self.phase("training"):
            yield
            self.step, self.position, self.reported = self.step + 1, next_position, False

    def evaluation_due(self, start=False):
        """Whether the loop evaluates on the held-out tasks now; never with --eval-interval 0. Before the loop
        (start=True): at step 0, the curve's first point, or where a stop cut short the evaluation of the step resumed
        from. After an update: every --eval-interval steps, and after the last step."""
        args = self.args
        if not args.eval_interval:
            return False
        if start:
            return self.step == 0 or self.evaluation_owed
        return self.step % args.eval_interval == 0 or self.step == args.max_steps

    def evaluated(self, metrics, result=None):
        """A held-out evaluation after book.step steps, and its rollout (for the rollout log); the one before any
        step is logged at once (the curve's start), the others with their step's report. Beside evaluate's metrics:
        the guesses' scores (eval/baseline_*) and the share of right answers whose reasoning computes them
        (eval/faithful, where the task's reasoning can be checked: tiny_grpo/skill.py)."""
        if result is not None and "correctness" in result.terms:
            right = [bool(value == 1) for value in result.terms["correctness"]]
            metrics = {**metrics, **faithful_share(getattr(self.args, "task", None), self.eval_tasks,
                                                   result.completions, right)}
        metrics = {**metrics, **self.baselines}
        self.evals[self.step] = metrics
        self.args.held_out = [[s, m["eval/accuracy"]] for s, m in sorted(self.evals.items())]  # what checkpoints keep
        self.rollouts.evaluation(self.step, metrics, self.eval_tasks, result)
        if self.step == 0 or self.evaluation_owed:  # no report of this step follows
            self.logger.scalars(metrics, self.step)
        self.evaluation_owed = self.args.evaluation_owed = False

    def report(self, result, rewards, stats, tasks, advantages=None, extra=None, everyone=None):
        """Log the step (TensorBoard, W&B, the rollout log, the progress bar), then save it every
        --checkpoint-interval steps. extra: the experiment's own metrics of the step. everyone: (rollout, tasks) of
        the whole step where each process sampled a share of it: the metrics and completions logged are of those,
        the rollout log stays this process's (its per-token values are of its own rows)."""
        now = time.perf_counter()
        seconds = (self.sampled or now) - (self.started or now), now - (self.started or now)  # sampling, the whole step
        logged, logged_tasks = everyone or (result, tasks)
        logged_rewards = logged.rewards.view(-1, self.args.group_size) if everyone else rewards
        extra = {**diagnostics(logged, logged_rewards, self.args, self.weights, self.last_length), **(extra or {})}
        metrics = report(self.logger, self.progress, self.args, self.step, logged, logged_rewards, stats, seconds,
                         self.memory, self.evals, logged_tasks, extra)
        self.rollouts.step(self.step, tasks, result, advantages, stats, metrics)
        self.reported = True
        self.started = self.sampled = None
        self.last_length = logged.action_mask.sum(1).float().mean().item()
        if self.args.checkpoint_interval and self.step % self.args.checkpoint_interval == 0:
            self.save(self.step, self.position)

    def save(self, step, position):
        """The checkpoint of the steps done, then the run's page drawn from the rollout log (python -m
        tiny_grpo.view), wherever there is one (a resume with --log-rollouts 0 purged it: the page follows): a page
        that cannot be written is said, and the run goes on."""
        self.save_steps(step, position)
        if self.main and self.rollouts.path.exists():
            try:  # the log read line by line: the page's memory does not grow with the run
                write_page(self.rollouts.path.parent)
            except Exception as e:  # the page is a view of the log; the checkpoint is written
                say(f"the run's page could not be written ({type(e).__name__}: {e}); the rollout log is in "
                    f"{self.rollouts.path}")

    def __exit__(self, kind, stop, trace):
        """At the end the last checkpoint and the closing line; a Ctrl-C, a failed reward or a diverged loss saves the
        steps done (stopped), then exits or goes on to main's one-line error. Other errors pass through."""
        if stop is None:
            try:
                self.save(self.step, self.position)
            except STOPS as e:  # Ctrl-C during the last save
                stop = e
        self.rollouts.close()
        # a stop between the update and its report may have cut the step's evaluation short
        self.args.evaluation_owed = not self.reported and self.evaluation_due() and self.step not in self.evals
        if isinstance(stop, STOPS):  # every process saves; the main one tells
            stopped(stop, self.step, self.run_dir, lambda: self.save(self.step, self.position), self.logger,
                    self.progress, self.interrupts, say if self.main else lambda text: None)  # exits 130, or raises
        if stop is None:
            self.progress.close()
            self.logger.close()
            if self.main:
                say(f"done: {self.step} steps; checkpoint in {self.run_dir / f'step_{self.step:06d}'}"
                    f"{held_out(self.evals, len(self.eval_tasks))}", sys.stdout)  # what the output's encoding lacks, escaped
        return False
