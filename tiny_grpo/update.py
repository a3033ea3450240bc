"""train_step's two fast forms, each the plain form's numbers at less cost: the rows that add nothing left out, and
pi_old taken from the first pass's own forward instead of its own pass (train.py's pi_old_pass). Each is held equal
to its plain form in tests/test_experiments_grpo_math.py (test_zero_advantages_are_left_out_and_the_update_is_the_same,
test_pi_old_from_the_first_pass_is_its_own_pass). And the update's guard: clip_gradients, which stops the run before
an update with a gradient of inf or nan."""

import torch

from tiny_grpo.errors import DivergedError


def micro_batches(rows, size, counted=None):
    """rows.split(size), the plain form; with counted [n] (a bool per sequence of the batch), the fast form: only the
    rows counted, in the batch's order, and no empty part. With beta = 0 a sequence whose advantage is 0 (a group of
    equal rewards) adds exactly 0 to the loss and to its gradient: no pass needs to run it, and each mean still
    divides by all the sequences. The batch's order: a rollout lays each prompt's completions side by side, so a
    micro-batch holds whole groups and pack_prompts runs each prompt once for all of its rows there, not once for each
    of the one or two a shuffled split leaves it. Which micro-batch a row of the mini-batch falls in changes only the
    order of the gradient's sum (every weight is a row's or a token's share of the whole mini-batch)."""
    if counted is not None:
        rows = rows[counted[rows]].sort().values
    return [idx for idx in rows.split(size) if len(idx)]


def rows_that_count(advantages, kl_weight):
    """The sequences a pass must run: all of them with beta > 0 (the KL term has a gradient everywhere), else those
    whose advantage is not 0."""
    return torch.ones(len(advantages), dtype=torch.bool) if kl_weight > 0 else (advantages != 0).cpu()


class OldLogProbs:
    """log pi_old(a_t | s_t) [n, T] of a rollout batch, the policy that sampled, without gradient: old(idx, epoch,
    new_log_probs) gives the rows idx. The plain form is train.py's: plain_pass(rows) -> [len(rows), T], one no-grad
    pass in eval mode (no LoRA dropout) before the first update, over the rows counted. The fast form: while the first
    pass's forward is still pi_old (one update per pass, no dropout), the rows are taken from that forward, detached,
    at no cost; first_pass=False, where pi_old is needed whole before the first update (REINFORCE++'s per-token
    rewards) or a run takes every plain form (--plain), and FAST = False always take the plain form."""

    FAST = True

    def __init__(self, plain_pass, counted, num_actions, updates_per_pass, dropout, first_pass=True):
        self.shape, self.values = (len(counted), num_actions), None
        self.first_pass = self.FAST and first_pass and updates_per_pass == 1 and dropout == 0
        rows = torch.arange(len(counted))[counted]
        if not self.first_pass and len(rows):
            taken = plain_pass(rows)
            self.values = torch.zeros(self.shape, device=taken.device)
            self.values[rows] = taken

    def __call__(self, idx, epoch, new_log_probs):
        if self.values is None:  # the fast form's, filled by the first pass
            self.values = torch.zeros(self.shape, device=new_log_probs.device)
        if self.first_pass and epoch == 0:
            self.values[idx] = new_log_probs.detach()
        return self.values[idx]


def clip_gradients(model, max_norm, stats):
    """torch.nn.utils.clip_grad_norm_ over the trainable weights, after a zero gradient for those no sequence reached
    (the update still steps, as it would on zero gradients). A norm of inf or nan stops the run (DivergedError) before
    an update is made with it. Returns the norm before clipping."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if not torch.isfinite(grad_norm):
        raise DivergedError(grad_norm.item(), stats.last_loss, stats.done)
    return grad_norm
