"""The errors a run reports in one line, with no traceback: bad input, a failed reward, a diverged loss."""

class InputError(Exception):
    """Bad input from the user (data file, option, checkpoint): reported in one line, no traceback."""

class RewardError(InputError):
    """A custom reward function or a reward service failed: the run stops and says on what."""

class DivergedError(InputError):
    """The loss or the gradient became inf or nan: the run stops before an update is made with it."""

    def __init__(self, grad_norm, loss, updates_done):
        super().__init__(f"the gradient norm is {grad_norm} (loss {loss}): training diverged; try a lower --lr")
        self.updates_done = updates_done  # updates of this step already applied before it
