"""The reward terms from outside a train.py: --reward-fn's function, each call timed, and --reward-url's service,
each answer checked."""

import base64, inspect, json, math, os, pkgutil, signal, sys, threading, time, urllib3  # noqa: E401

from tiny_grpo.errors import InputError, RewardError
from tiny_grpo.options import credentials, redact, scrub

class OutsideTerms:
    """The reward terms from outside the file: --reward-fn's function (custom), each call timed, and --reward-url's
    service (remote), asked once at the start (a run fails now, not an hour in). Each weighs 1 unless
    --reward-weights says otherwise."""

    def __init__(self, reward_fn, custom_timeout, url, timeout, retries, weights):
        self.custom = load_reward_fn(reward_fn, custom_timeout) if reward_fn else None
        self.url, self.timeout, self.retries = url, timeout, retries
        if self.custom:
            weights.setdefault("custom", 1.0)
        if self.url:
            weights.setdefault("remote", 1.0)
            remote_rewards(self.url, [], [], [], timeout, retries)

    def __call__(self, completions, answers, metadata):
        terms = {}
        if self.custom:
            terms["custom"] = [self.custom(c, a, m) for c, a, m in zip(completions, answers, metadata)]
        if self.url:
            terms["remote"] = remote_rewards(self.url, completions, answers, metadata, self.timeout, self.retries)
        return terms

def load_reward_fn(spec, timeout=60.0):
    """--reward-fn package.module:function -> a function (completion, answer, metadata) -> float that calls it,
    within `timeout` seconds, and turns its failures into a RewardError naming the completion."""
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise InputError(f"--reward-fn {spec}: expected package.module:function")
    if os.getcwd() not in sys.path:  # modules next to where the run starts, found after the installed
        sys.path.append(os.getcwd())  # packages: a peft.py or tqdm.py there replaces nothing
    try:
        function = pkgutil.resolve_name(spec)
    except Exception as e:  # an AttributeError once the module is in: the function is not in it
        if not (isinstance(e, AttributeError) and module_name in sys.modules):
            raise InputError(f"--reward-fn {spec}: cannot import {module_name}: {type(e).__name__}: {e}")
        function = None
    if not callable(function):
        raise InputError(f"--reward-fn {spec}: {module_name} has no function {function_name!r}")
    try:  # called as function(completion, answer, metadata): a wrong signature fails now, not after the model loads
        inspect.signature(function).bind("completion", "answer", {})
    except TypeError as e:
        raise InputError(f"--reward-fn {spec}: {function_name}{inspect.signature(function)} cannot be called as "
                         f"{function_name}(completion, answer, metadata): {e}")
    except ValueError:  # a built-in without a signature: its first call will tell
        pass

    def call(completion, answer, metadata):
        try:  # sys.exit in it is a failure like any other: the steps done are saved first
            value = on_time(timeout, function, completion, answer, metadata)
        except (Exception, SystemExit) as e:
            raise RewardError(f"--reward-fn {spec} failed on completion {completion[:300]!r} "
                              f"(answer {answer!r}): {type(e).__name__}: {e}")
        try:  # a number of any kind (numpy, a 0-d tensor), but not "0.5" or True, which float() would take
            number = float(value) if not isinstance(value, (str, bytes, bool)) else math.nan
        except (TypeError, ValueError, OverflowError):
            number = math.nan
        if not math.isfinite(number):
            raise RewardError(f"--reward-fn {spec} returned {str(value)[:100]!r}, not a finite number, on completion "
                              f"{completion[:300]!r} (answer {answer!r})")
        return number

    return call

MAX_REPLY_BYTES = 64 * 2**20  # a reward service's answer larger than this stops the run instead of filling memory

def remote_rewards(url, completions, answers, metadata, timeout=30.0, retries=3):
    """POST {"completions", "answers", "metadata"} as JSON to a reward service; it answers {"rewards": [...]}.
    Retried with back-off on timeouts, broken connections and server errors; a malformed answer, a redirect or a 4xx
    stops the run. The tries are counted here, not by urllib3's Retry: each try runs under within(), its whole answer
    in `timeout` seconds (urllib3's timeout bounds each read only: a byte a second would hold the run), and urllib3
    retries inside one call, which no outside bound can cut into tries, nor would it reread a body cut short."""
    shown = redact(url)
    body = json.dumps({"completions": completions, "answers": answers, "metadata": metadata}).encode()
    for attempt in range(1, retries + 1):
        try:
            status, location, answer = within(timeout, post, url, body, timeout)
        except (urllib3.exceptions.HTTPError, TimeoutError) as e:  # refused, reset, not HTTP, cut short (IncompleteRead)
            problem = f"{type(e).__name__}: {scrub(str(e), url)}; is the service running?"
        else:
            if 300 <= status < 400:
                raise RewardError(f"--reward-url {shown}: HTTP {status}, a redirect to {redact(location)}; "
                                  "give that address instead (a redirected POST would lose its body)")
            if 400 <= status < 500:
                raise RewardError(f"--reward-url {shown}: HTTP {status}: {answer[:300].decode(errors='replace')}")
            if status < 300:
                break
            problem = f"HTTP {status}: {answer[:300].decode(errors='replace')}"
        if attempt == retries:
            raise RewardError(f"--reward-url {shown}: no answer after {retries} tries ({problem})")
        time.sleep(min(2 ** (attempt - 1), 10))
    if len(answer) > MAX_REPLY_BYTES:
        raise RewardError(f"--reward-url {shown}: the answer is larger than {MAX_REPLY_BYTES:,} bytes")
    try:
        rewards = json.loads(answer)["rewards"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:  # numbers past 4,300 digits, JSON nested too deep
        raise RewardError(f"--reward-url {shown}: the answer is not {{\"rewards\": [...]}}: {type(e).__name__}: "
                          f"{str(e)[:200]}")
    if not isinstance(rewards, list) or len(rewards) != len(completions) or not all(map(finite_number, rewards)):
        raise RewardError(f"--reward-url {shown}: expected {len(completions)} finite numbers, got {str(rewards)[:200]}")
    return [float(r) for r in rewards]

def post(url, body, timeout):
    """One POST of JSON by urllib3, neither retried nor redirected (a redirected POST would lose its body): the status,
    the Location and at most MAX_REPLY_BYTES + 1 bytes of the answer; urllib3 raises IncompleteRead (in a
    ProtocolError) where the answer stops short of its Content-Length. A user:password@ in the URL is sent as basic
    authentication (UTF-8, RFC 7617), never as part of the address urllib3 sees and may quote."""
    address, auth = credentials(url)
    headers = {"Content-Type": "application/json"}
    if auth is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(auth.encode()).decode()
    with urllib3.PoolManager() as http:
        reply = http.request("POST", address, body=body, headers=headers, timeout=timeout, retries=False, redirect=False,
                             preload_content=False)
        return reply.status, reply.headers.get("Location"), reply.read(MAX_REPLY_BYTES + 1)

def finite_number(value):
    """A number, not a boolean nor a string, that is finite as a float (10**400 is an int too large for one)."""
    try:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:
        return False

def on_time(seconds, function, *args):
    """function(*args) in this thread, or TimeoutError after `seconds`: a timer thread interrupts it with SIGUSR1, and
    again every second should it catch the error and go on. In the main thread a function can use signals itself,
    as math-verify does (SIGALRM), which a worker thread cannot; in another thread this is within().
    concurrent.futures is no substitute: it runs the call in a worker thread and, when late, leaves it running."""
    if threading.current_thread() is not threading.main_thread():
        return within(seconds, function, *args)
    done, late = threading.Event(), []

    def expire(signum, frame):
        if not done.is_set():
            late.append(signum)
            raise TimeoutError(f"no result within {seconds} s")

    def watch():
        if not done.wait(seconds):
            while not done.is_set():
                signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
                done.wait(1.0)

    previous = signal.signal(signal.SIGUSR1, expire)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        value = function(*args)
    finally:
        done.set()
        watcher.join()  # no signal is sent after this
        signal.signal(signal.SIGUSR1, signal.SIG_DFL if previous is None else previous)
    if late:  # it caught the TimeoutError and returned: too late all the same
        raise TimeoutError(f"no result within {seconds} s")
    return value

def within(seconds, function, *args):
    """function(*args), or TimeoutError after `seconds`. It runs in a thread, left behind if late: neither a Python
    call nor an HTTP answer read a byte at a time can be cut short from outside."""
    result = {}

    def call():
        try:
            result["value"] = function(*args)
        except BaseException as e:  # sys.exit included: handed to the caller
            result["error"] = e

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        raise TimeoutError(f"no result within {seconds} s")
    if "error" in result:
        raise result["error"]
    return result["value"]
