"""Stopping: Ctrl-C, SIGTERM, SIGHUP and SIGUSR1 deferred while an update is made, a failed reward or a diverged loss;
the steps done are saved."""

import contextlib, signal, sys  # noqa: E401

from tiny_grpo.errors import DivergedError, RewardError

def say(text, file=None):
    """text on stderr (or file), where it can still be written: a closed pipe must not stop a save, nor a character
    the output's encoding lacks (PYTHONIOENCODING=latin-1 and --run-name 名前), which is written as a backslash escape."""
    file = file or sys.stderr
    try:
        print(text, file=file)
    except UnicodeEncodeError:
        encoding = getattr(file, "encoding", None) or "ascii"
        say(text.encode(encoding, "backslashreplace").decode(encoding), file)
    except OSError:
        pass

class Interrupts:
    """Ctrl-C, SIGTERM, SIGHUP and SIGUSR1 raise KeyboardInterrupt at once, except inside
    `with interrupts.deferred():`, where they wait until the block ends: a checkpoint never holds half an update. Only
    the first one does: the run is stopping and saving then, and a second Ctrl-C (or a scheduler's second SIGTERM)
    must not cut the save short."""

    def __init__(self):
        self.deferring, self.pending, self.stopping = False, None, False
        # a cluster scheduler's SIGTERM is handled like Ctrl-C, and so is a closed terminal or ssh session (SIGHUP)
        # and the warning a scheduler sends before it pre-empts a job (SLURM's --signal=USR1@90; its default action
        # would end the run unsaved); a signal ignored at the start stays ignored: nohup's SIGHUP, a background job's
        # SIGINT
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
            if signal.getsignal(signum) != signal.SIG_IGN:
                signal.signal(signum, self.handle)

    def handle(self, signum, frame):
        if self.stopping:
            return
        if self.deferring:
            self.pending = signum
        else:
            self.stop(signum)

    def stop(self, signum):
        self.stopping = True
        raise KeyboardInterrupt(signal.Signals(signum).name)

    @contextlib.contextmanager
    def deferred(self):
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
        if self.pending is not None and not self.stopping:
            self.stop(self.pending)

def stopped(stop, step, run_dir, save, logger, progress, interrupts, tell=say):
    """Save the steps done and report with tell (a process that does not log: one that says nothing): Ctrl-C exits
    with 130, a reward failure or divergence goes on to main's error message. A step that diverged after some of its
    updates is not saved (its weights are half updated)."""
    interrupts.stopping = True  # any later Ctrl-C or SIGTERM is let pass: the save is not cut short
    try:
        progress.close()
    except OSError:  # its pipe closed: the save below matters, the bar does not
        pass
    half_updated = isinstance(stop, DivergedError) and stop.updates_done > 0
    what = {KeyboardInterrupt: "\ninterrupted", RewardError: "\nthe reward failed"}.get(type(stop), f"\nstep {step + 1} diverged")
    if half_updated:
        tell(f"{what}: its first updates are not saved")
    elif step == 0:  # a checkpoint of zero steps holds nothing of the run and would block its name
        tell(f"{what}: before the first step; nothing to save")
    else:
        tell(f"{what}: saving step {step} to {run_dir} (Ctrl-C again waits until it is written)")
        save()
    logger.close()
    if isinstance(stop, KeyboardInterrupt):
        sys.exit(130)
    raise stop
