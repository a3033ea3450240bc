"""What a run shows: TensorBoard and W&B, each step's metrics, the phases' memory peaks, the progress bar and the
closing line; train_step's statistics."""

import contextlib, hashlib, math, os, re, resource, sys  # noqa: E401
from pathlib import Path

import torch

from tiny_grpo.errors import InputError
from tiny_grpo.options import recorded_options
from tiny_grpo.stopping import say
from tiny_grpo.urls import redact

class StepStatistics:
    """What train_step logs, as means over a step: the loss terms over its updates (each micro-batch by its share of
    its mini-batch), the gradient norm and the learning rate over its updates, the entropy over the sequences that
    ran; the ratio's extremes before clipping, and the share of tokens clipped on each side. updates: the step's
    optimizer updates. means()["tokens"]: grpo_loss' per-token values of each micro-batch, (rows, {name: [b, T]}) in
    the order run, for the rollout log (a row's last is the last update's)."""

    def __init__(self, kl, updates):
        self.logged = ["loss", "clip_fraction"] + (["kl"] if kl else [])
        self.totals = dict.fromkeys(self.logged + ["grad_norm", "lr"], 0.0)
        self.updates, self.done, self.last_loss = updates, 0, math.nan
        self.entropy_sum, self.ran, self.tokens, self.sides = 0.0, 0, [], {}

    def add(self, loss, stats, share, entropy, mask, rows=None):
        """A micro-batch's loss and grpo_loss' statistics; share: its part of its mini-batch; rows: its sequences."""
        self.last_loss = loss.item()
        stats.update(loss=self.last_loss)
        for name in self.logged:
            self.totals[name] += stats[name] * (share / self.updates)
        self.entropy_sum, self.ran = self.entropy_sum + ((entropy * mask).sum() / mask.sum().clamp(min=1)).item() * len(mask), self.ran + len(mask)
        if "tokens" in stats and mask.any():
            tokens, taken = stats["tokens"], mask.bool()
            self.tokens.append((rows, tokens))
            ratio, sides = tokens["ratio"][taken], self.sides
            sides["ratio_min"] = min(sides.get("ratio_min", math.inf), ratio.min().item())
            sides["ratio_max"] = max(sides.get("ratio_max", -math.inf), ratio.max().item())
            for name, side in (("clip_low_fraction", -1), ("clip_high_fraction", 1)):
                share_clipped = (tokens["clipped"].expand_as(taken)[taken] == side).float().mean().item()
                sides[name] = sides.get(name, 0.0) + share_clipped * (share / self.updates)

    def update(self, grad_norm, optimizer):
        """An optimizer update about to be made: its gradient norm and learning rate."""
        self.totals["grad_norm"] += grad_norm.item() / self.updates
        self.totals["lr"] += optimizer.param_groups[0]["lr"] / self.updates  # the rate used
        self.done += 1

    def means(self):
        return {**self.totals, **({"entropy": self.entropy_sum / self.ran} if self.ran else {}), **self.sides,
                "tokens": self.tokens}

WANDB_REFUSES = "/\\#?%:"  # characters W&B takes in no run id nor project name

def check_wandb(args):
    """With --wandb, what W&B would refuse after the model has loaded, refused now in one line each: a run name or
    project it cannot take, no API key in online mode, a W&B that does not import."""
    if not args.wandb:
        return
    for option, value in (("--run-name", args.run_name), ("--wandb-project", args.wandb_project)):
        bad = sorted(set(value) & set(WANDB_REFUSES))
        if bad:
            raise InputError(f"{option} {value!r}: W&B takes no {' '.join(bad)} in a run's name or project; choose "
                             "another, or leave out --wandb")
    try:
        import wandb
    except Exception as e:  # not installed, or a version that fails on import
        raise InputError(f"--wandb: W&B cannot be imported ({type(e).__name__}: {str(e)[:200]})")
    online = os.environ.get("WANDB_MODE", "online") not in ("offline", "dryrun", "disabled")
    if online and not wandb.login(prompt=False, verify=False):  # reads the key W&B would use; writes nothing
        raise InputError("--wandb: no W&B API key (run `wandb login`, or set WANDB_API_KEY); WANDB_MODE=offline logs "
                         "to the run's folder without one")

class Logger:
    """TensorBoard always; Weights & Biases with --wandb, its files in the same claimed folder, LOG_DIR/RUN_NAME/wandb.
    A logger that fails (a full disk) is dropped with one warning: the run goes on, its checkpoints still saved."""

    def __init__(self, args, resumed_step):
        from torch.utils.tensorboard import SummaryWriter

        folder = Path(args.log_dir) / args.run_name
        # purge_step drops the events a crashed run wrote after its last checkpoint
        self.writer = SummaryWriter(folder, purge_step=resumed_step + 1 if resumed_step else None)
        self.wandb = None
        if args.wandb:
            import wandb

            # one W&B run per run folder: the same --run-name under another --checkpoint-path is another run
            owner = hashlib.sha1(str((Path(args.checkpoint_path) / args.run_name).resolve()).encode()).hexdigest()[:8]
            if args.reward_url:  # W&B stores the command line (sys.argv) in its run files, and `wandb sync` uploads it
                sys.argv[:] = [word.replace(args.reward_url, redact(args.reward_url)) for word in sys.argv]
            # W&B's service writes its debug logs under WANDB_CACHE_DIR (else ~/.cache/wandb): the run's, unless set
            ours = "WANDB_CACHE_DIR" not in os.environ
            os.environ.setdefault("WANDB_CACHE_DIR", str(folder / "wandb" / "cache"))
            try:
                self.wandb = wandb.init(project=args.wandb_project, name=args.run_name, id=f"{args.run_name}-{owner}",
                                        resume="allow", config=recorded_options(args), dir=folder)
            finally:
                if ours:
                    del os.environ["WANDB_CACHE_DIR"]

    def scalars(self, metrics, step):
        self.each(lambda writer: [writer.add_scalar(name, value, step) for name, value in metrics.items()],
                  lambda run: run.log(metrics, step=step))

    def text(self, name, text, step):
        self.each(lambda writer: writer.add_text(name, text, step), lambda run: run.log({name: text}, step=step))

    def close(self):
        self.each(lambda writer: writer.close(), lambda run: run.finish())

    def each(self, tensorboard, wandb):
        for attribute, write in (("writer", tensorboard), ("wandb", wandb)):
            if getattr(self, attribute) is not None:
                try:
                    write(getattr(self, attribute))
                except OSError as e:  # a full disk, a folder gone: the run matters more than its curves
                    setattr(self, attribute, None)
                    print(f"logging to {'TensorBoard' if attribute == 'writer' else 'W&B'} failed ({e}); training "
                          "goes on without it, and checkpoints are still saved", file=sys.stderr)

def step_metrics(result, rewards, stats, rollout_seconds, seconds, memory):
    """What a step logs: the rollout's rewards and terms, train_step's statistics, time and memory. The learning
    signal: the share of completions, and of their tokens, in a group whose rewards differ (the others' advantage is
    0: with beta = 0 they carry no gradient)."""
    generated = result.action_mask.sum().item()
    spread = (rewards.max(1).values > rewards.min(1).values).repeat_interleave(rewards.shape[1])  # per completion
    lengths = result.action_mask.sum(1).cpu()
    return {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item(),
        "rollout/reward_min": rewards.min().item(),
        "rollout/reward_max": rewards.max().item(),
        "rollout/format_rate": result.terms["format"].mean().item(),
        "rollout/accuracy": (result.terms["correctness"] == 1).float().mean().item(),
        **{f"rollout/reward_{name}": values.mean().item() for name, values in result.terms.items()},
        "rollout/completion_length": generated / len(result.completions),
        "rollout/zero_spread_groups": (rewards.max(1).values == rewards.min(1).values).float().mean().item(),
        "rollout/completions_with_signal": spread.float().mean().item(),
        "rollout/tokens_with_signal": lengths[spread.cpu()].sum().item() / max(generated, 1),
        **{f"train/{k}": v for k, v in stats.items() if k not in ("tokens", "new_log_probs")},  # for the rollout log
        "perf/step_seconds": seconds,
        "perf/rollout_seconds": rollout_seconds,
        "perf/tokens_per_second": generated / rollout_seconds,
        **memory.metrics(),  # each phase's memory peak, and the run's
    }

class PhasePeaks:
    """Each phase's own memory peak, every step (perf/sampling_peak_gb, perf/training_peak_gb): on CUDA the allocator's
    peak allocated bytes, and reserved (..._reserved_gb), reset at the phase's start; on a CPU the process's resident
    peak (VmHWM), reset through /proc/self/clear_refs (where the kernel refuses that: the peak since the start). A phase
    entered twice in a step keeps the higher peak. perf/memory_gb stays the run's peak so far, phases or not."""

    def __init__(self, device):
        self.device, self.cuda, self.values, self.most = device, device.startswith("cuda"), {}, 0.0

    @contextlib.contextmanager
    def phase(self, name):
        self.reset()
        yield
        for kind, value in zip(("peak", "reserved"), self.peak()):
            if value is not None:
                key = f"perf/{name}_{kind}_gb"
                self.values[key] = max(value, self.values.get(key, 0.0))

    def reset(self):
        self.most = max(self.most, self.peak()[0])  # what came before the phase (an evaluation, say) counts for the run
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets this process's VmHWM to its resident size now
        except OSError:
            pass

    def peak(self):
        """(peak GB since the last reset, reserved peak GB on CUDA or None)."""
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / 2**30, torch.cuda.max_memory_reserved(self.device) / 2**30
        try:
            return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text())[1]) / 2**20, None
        except (OSError, TypeError):  # no /proc: the peak since the start (Linux reports KiB)
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, None

    def metrics(self):
        """The step's phase peaks and the run's peak; the phases start afresh for the next step."""
        self.most = max(self.most, self.peak()[0])
        values, self.values = self.values, {}
        return {**values, "perf/memory_gb": self.most}

def diagnostics(result, rewards, args, weights, last_length):
    """What tells why a step did not learn: each reward term's share of the total reward, w_k mean(term_k) over
    sum_k |w_k mean(term_k)|; the share of completions whose actions reached --max-length (cut at the budget); the
    change in mean completion length since the last step (last_length; None at the first)."""
    lengths = result.action_mask.sum(1).float()
    contributions = {name: weights.get(name, 0.0) * values.float().mean().item() for name, values in result.terms.items()}
    whole = sum(abs(c) for c in contributions.values())
    metrics = {"rollout/cut_at_budget": (lengths >= args.max_length).float().mean().item()}
    if whole > 0:
        metrics.update({f"rollout/reward_share_{name}": c / whole for name, c in contributions.items()})
    if last_length is not None:
        metrics["rollout/completion_length_change"] = lengths.mean().item() - last_length
    return metrics

def report(logger, progress, args, step, result, rewards, stats, seconds, memory, evals, tasks, extra=None):
    """Log a step (TensorBoard, W&B): step_metrics, the experiment's extra metrics, and the held-out evaluation if
    one ran; every --log-completions-interval steps a few completions; then the progress bar, its postfix the step's
    mean reward, KL and the held-out accuracy so far. Returns the metrics logged."""
    metrics = {**step_metrics(result, rewards, stats, *seconds, memory), **(extra or {}), **evals.get(step, {})}
    if args.log_completions_interval and step % args.log_completions_interval == 0:
        logger.text("rollout/completions", sample_text(result, tasks, args.group_size), step)
    logger.scalars(metrics, step)
    advance_bar(progress, metrics, stats, evals)
    return metrics

def advance_bar(progress, metrics, stats, evals):
    """One step on the progress bar, its postfix the step's mean reward, KL and the held-out accuracy so far (none
    before the first evaluation, or with --eval-interval 0). A bar that cannot be drawn (its pipe closed: `| head`,
    or `| less` then q) is dropped with one warning, as a logger is: the run trains on, its checkpoints still saved."""
    try:
        progress.update(1)
        known = {"held_out": held_out(evals)} if evals else {}
        progress.set_postfix(reward=f"{metrics['rollout/reward_mean']:.3f}", kl=f"{stats.get('kl', 0):.4f}", **known)
    except OSError as e:
        progress.disable = True
        say(f"the progress bar cannot be drawn ({e}); training goes on without it, and checkpoints are still saved")

def held_out(evals, problems=None):
    """The held-out accuracy at the first and last evaluations of this run ({step: evaluate's metrics}): '3% -> 55%'
    for the progress bar; with problems, the closing line's '; held-out accuracy 3% at step 0 -> 55% at step 20 (100
    problems, greedy)'."""
    if not evals:
        return ""
    first, last = min(evals), max(evals)
    accuracy = {s: f"{evals[s]['eval/accuracy']:.0%}" for s in (first, last)}
    if problems is None:
        return f"{accuracy[first]} -> {accuracy[last]}" if first != last else accuracy[last]
    span = f"{accuracy[first]} at step {first} -> " if first != last else ""
    return (f"; held-out accuracy {span}{accuracy[last]} at step {last} ({problems} problems, greedy)"
            f"{skill_said(evals[last])}")

def skill_said(metrics):
    """The closing line's word on whether the accuracy is the skill: the best guess that needs none (eval/baseline_*)
    and the share of right answers whose reasoning computes them (eval/faithful), where the evaluation has them."""
    said = ""
    guesses = {k.removeprefix("eval/baseline_"): v for k, v in metrics.items() if k.startswith("eval/baseline_")}
    if guesses:
        best = max(guesses, key=guesses.get)
        said += f"; the best guess without the skill ({best}) {guesses[best]:.0%}"
    if "eval/faithful" in metrics:
        said += f"; {metrics['eval/faithful']:.0%} of the right answers computed by their reasoning"
    return said

def sample_text(rollout, tasks, group_size, count=4):
    """A few completions as markdown; a multi-turn episode's whole transcript, its tool results or passages too."""
    texts, label = getattr(rollout, "transcripts", rollout.completions), "episode" if hasattr(rollout, "transcripts") else "completion"
    rows = []
    for i in range(min(count, len(texts))):
        rows.append(f"**Q:** {tasks[i // group_size]['question']}  \n**{label}:** `{texts[i]!r}`  \n"
                    f"**reward:** {rollout.rewards[i].item():.2f}")
    return "\n\n".join(rows)
