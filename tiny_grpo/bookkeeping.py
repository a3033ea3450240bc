"""A run's bookkeeping around its loop, in one object: the logger, Ctrl-C and SIGTERM deferred while an update is
made, each phase's memory peak and seconds, the progress bar, the held-out evaluations, a checkpoint every
--checkpoint-interval steps and at the end, the steps done saved when the run stops early, and the closing line."""

import contextlib, time  # noqa: E401

from tiny_grpo.errors import DivergedError, RewardError
from tiny_grpo.report import Logger, PhasePeaks, held_out, report
from tiny_grpo.stopping import Interrupts, stopped

STOPS = (KeyboardInterrupt, RewardError, DivergedError)  # what ends a run early, the steps done saved


class Bookkeeping:
    """with Bookkeeping(args, run_dir, step, position, save, problems) as book: the loop, which reads book.step and
    book.position and calls book.phase, book.update, book.evaluated and book.report. save(step, position) writes the
    checkpoint of the steps done (the train.py's: what a checkpoint holds is the experiment's); problems: how many
    held-out tasks an evaluation takes, for the closing line. report: the function that logs a step (the package's,
    or the train.py's own), given book.report's extra arguments after its own."""

    def __init__(self, args, run_dir, step, position, save, problems, report=report):
        from tqdm import tqdm

        self.args, self.run_dir, self.step, self.position = args, run_dir, step, position
        self.save, self.problems, self.log_step = save, problems, report
        self.logger, self.interrupts, self.memory = Logger(args, step), Interrupts(), PhasePeaks(args.device)
        self.evals = {}  # step: the held-out evaluation's metrics, for the progress bar and the closing line
        self.progress = tqdm(total=args.max_steps, initial=step, desc=args.run_name, dynamic_ncols=True)
        self.started = self.sampled = None  # the step's clock: its first phase's start, its first sampling's end

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
            self.step, self.position = self.step + 1, next_position

    def evaluated(self, metrics):
        """A held-out evaluation after book.step steps; the one before any step is logged at once (the curve's
        start), the others with their step's report."""
        self.evals[self.step] = metrics
        if self.step == 0:
            self.logger.scalars(metrics, 0)

    def report(self, result, rewards, stats, tasks, *extra):
        """Log the step (TensorBoard, W&B, the progress bar), then save it every --checkpoint-interval steps."""
        now = time.perf_counter()
        seconds = (self.sampled or now) - (self.started or now), now - (self.started or now)  # sampling, the whole step
        self.log_step(self.logger, self.progress, self.args, self.step, result, rewards, stats, seconds, self.memory,
                      self.evals, tasks, *extra)
        self.started = self.sampled = None
        if self.args.checkpoint_interval and self.step % self.args.checkpoint_interval == 0:
            self.save(self.step, self.position)

    def __exit__(self, kind, stop, trace):
        """At the end the last checkpoint and the closing line; a Ctrl-C, a failed reward or a diverged loss saves the
        steps done (stopped), then exits or goes on to main's one-line error. Other errors pass through."""
        if stop is None:
            try:
                self.save(self.step, self.position)
            except STOPS as e:  # Ctrl-C during the last save
                stop = e
        if isinstance(stop, STOPS):
            stopped(stop, self.step, self.run_dir, lambda: self.save(self.step, self.position), self.logger,
                    self.progress, self.interrupts)  # exits with 130, or raises stop again
        if stop is None:
            self.progress.close()
            self.logger.close()
            print(f"done: {self.step} steps; checkpoint in {self.run_dir / f'step_{self.step:06d}'}"
                  f"{held_out(self.evals, self.problems)}")
        return False
