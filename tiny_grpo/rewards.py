"""The reward terms from outside a train.py: --reward-fn's function, run in a process of its own and each call timed,
and --reward-url's service, each answer checked."""

import base64, importlib.machinery, importlib.util, inspect, json, math, os, pickle, pkgutil, signal  # noqa: E401
import socket, subprocess, sys, sysconfig, threading, time, traceback, urllib3, weakref  # noqa: E401
from multiprocessing.connection import Connection

from tiny_grpo.errors import InputError, RewardError
from tiny_grpo.stopping import say
from tiny_grpo.urls import credentials, redact, scrub

# tiny_grpo.options (and with it torch) is imported where a reward service is asked, not here: the --reward-fn worker
# process imports this module, and starts in a fifth of a second without torch instead of two and a half with it

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
            terms["custom"] = self.custom.many(completions, answers, metadata)
        if self.url:
            terms["remote"] = remote_rewards(self.url, completions, answers, metadata, self.timeout, self.retries)
        return terms

def load_reward_fn(spec, timeout=60.0):
    """--reward-fn package.module:function -> a RewardFunction: called as function(completion, answer, metadata) it
    gives a float, its .many(completions, answers, metadata) a list of them. The function runs in a process of its
    own, each call within `timeout` seconds; its failures become RewardErrors naming the completion. A module that
    cannot be imported, or a function of the wrong shape, is an InputError now, before the model loads."""
    module_name, _, function_name = spec.partition(":")
    if not module_name or not function_name:
        raise InputError(f"--reward-fn {spec}: expected package.module:function")
    if os.getcwd() not in sys.path:  # modules next to where the run starts, found after the installed
        sys.path.append(os.getcwd())  # packages: a peft.py or tqdm.py there replaces nothing
    return RewardFunction(spec, timeout)

# Why a process: the deadline must hold whatever the function does. A function busy in C (a backtracking regex,
# 7 ** 10**7) holds the GIL for as long as it runs, so nothing in this process, neither a timer thread nor a signal
# handler, runs before it returns; and a function may change any signal's handler. A process of its own is killed at
# the deadline by the kernel (SIGKILL), whatever it is doing, and the run goes on to save its steps and stop.
#
# One worker process serves the whole run (a process per call would cost a fifth of a second each, and a step scores
# thousands of completions): each step sends it the step's completions as one batch, and it answers one message per
# completion as each is scored, so that each call has its own deadline, counted from the previous answer. It is
# started by subprocess (fork then exec, at once: no lock held by a thread of the run, such as torch's, can be
# inherited half taken, as by multiprocessing's fork) with `python -c WORKER`, which imports the function by its spec
# in a fresh interpreter. It is killed at a deadline, a failure or an interrupt, and started again at the next call;
# and with it every process its function started (generated code run in a subprocess): it leads a session, and so a
# process group, of its own, and the whole group is killed.
WORKER = "import sys; sys.path[:] = sys.argv[2:]; from tiny_grpo.rewards import serve; serve(int(sys.argv[1]))"

# The worker's import of the function's module is bounded too, if generously: a module whose top level starts a server
# or a loop never returns. It may take the longer of one call's deadline (--reward-fn-timeout) and IMPORT_SECONDS (a
# reward model loaded at import); after NOTICE_SECONDS one line says what is being imported.
IMPORT_SECONDS, NOTICE_SECONDS = 600, 10

class RewardFunction:
    """--reward-fn's function, called in its worker process: see above, and serve() for the worker's side."""

    def __init__(self, spec, timeout):
        self.spec, self.timeout = spec, timeout
        self.lock = threading.Lock()  # one call at a time: the worker's answers come in order
        self.process = None
        self.start()

    def start(self):
        """A fresh worker that has imported the function, or InputError saying why it could not."""
        if self.process is not None:  # the one before, ended
            self.stop()
        ours, theirs = socket.socketpair()
        with theirs:  # sys.path is given to the worker before it imports anything: it finds what the run finds
            self.process = subprocess.Popen(
                [sys.executable, "-c", WORKER, str(theirs.fileno()), *map(str, sys.path)], pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,  # what the function prints still goes to the run's output
                start_new_session=True)  # a terminal's Ctrl-C or hang-up goes to the run alone, which stops the worker
        self.connection = Connection(ours.detach())
        # stop() kills the worker; so does this process's end, or its RewardFunction being garbage collected
        self.stop = weakref.finalize(self, stop_worker, self.process, self.connection)
        try:
            self.connection.send((self.spec, os.getpid()))
            said = self.imported()
        except (EOFError, OSError):
            said = f"--reward-fn {self.spec}: its process ended while importing it ({ended(self.process)})"
        except BaseException:
            self.stop()
            raise
        if said is not None:
            self.stop()
            raise InputError(said)

    def imported(self):
        """The worker's word once it has imported the function: None, or why it cannot be called; or why it has not
        within the bound (see IMPORT_SECONDS). Ctrl-C still stops the run meanwhile: poll waits in select()."""
        module_name = self.spec.partition(":")[0]
        bound = max(self.timeout, IMPORT_SECONDS)
        if not self.connection.poll(min(NOTICE_SECONDS, bound)):
            say(f"still importing {module_name} (--reward-fn {self.spec}) after {NOTICE_SECONDS:g} s; it may take up "
                f"to {bound:g} s")
            if not self.connection.poll(max(0, bound - NOTICE_SECONDS)):
                return (f"--reward-fn {self.spec}: importing {module_name} took more than {bound:g} s (the longer of "
                        f"--reward-fn-timeout and {IMPORT_SECONDS:g} s): does its top level start something that never "
                        "ends, a server or a loop? Move that under `if __name__ == \"__main__\":`")
        return self.connection.recv()

    def __call__(self, completion, answer, metadata):
        return self.many([completion], [answer], [metadata])[0]

    def many(self, completions, answers, metadata):
        """The function's number for each completion; RewardError at the first that fails or takes too long."""
        rows = list(zip(completions, answers, metadata))
        with self.lock:
            try:
                return self.ask(rows)
            except BaseException:  # a failure, a deadline or Ctrl-C: the worker may be busy still, and is killed
                self.stop()
                raise

    def ask(self, rows):
        if not rows:
            return []
        if self.process.poll() is not None:  # killed after an earlier failure: a fresh one
            try:
                self.start()
            except InputError as e:
                raise RewardError(str(e))
        items = []
        for completion, answer, metadata in rows:  # each row pickled apart: the one that cannot be is named
            try:
                items.append(pickle.dumps((completion, answer, metadata)))
            except Exception as e:  # a lock, a lambda, an open file: nothing a data row holds once read
                raise self.failure(completion, answer, f"its metadata cannot be sent to the function's process: "
                                                       f"{type(e).__name__}: {one_line(str(e))}")
        try:
            self.connection.send(items)
        except OSError:  # it ended while idle (the out-of-memory killer, a kill by hand)
            raise self.failure(*rows[0][:2], ended(self.process))
        values = []
        for completion, answer, _ in rows:
            if not self.connection.poll(self.timeout):  # waits in select(): no GIL, no signal needed
                raise self.failure(completion, answer, f"TimeoutError: no result within {self.timeout} s")
            try:
                kind, said = self.connection.recv()
            except (EOFError, OSError):  # os._exit, a crash in C, the out-of-memory killer
                raise self.failure(completion, answer, ended(self.process))
            if kind == "failed":
                raise self.failure(completion, answer, said)
            if kind == "not a number":
                raise RewardError(f"--reward-fn {self.spec} returned {said!r}, not a finite number, on completion "
                                  f"{completion[:300]!r} (answer {answer!r})")
            values.append(said)
        return values

    def failure(self, completion, answer, why):
        return RewardError(f"--reward-fn {self.spec} failed on completion {completion[:300]!r} (answer {answer!r}): {why}")

def stop_worker(process, connection):
    """Kill a worker and the processes its function started, and collect it (SIGKILL: it may be busy in C, or ignore
    every other signal). It leads a process group of its own (start_new_session), which they are in unless they left
    it (a daemon's setsid): killing the group leaves no `sleep 4242` of a reward's generated code running on."""
    connection.close()
    try:  # the group's id is its leader's pid, not reused while any process of the group lives, even once the worker
        os.killpg(process.pid, signal.SIGKILL)  # is collected (after it ended by itself: os._exit, a crash)
    except (ProcessLookupError, PermissionError):  # none of them is left (and that id went to another user's group)
        pass
    process.wait()

def ended(process):
    """How a worker that stopped answering ended: 'its process ended with exit code 3' or '... was killed by SIGSEGV'."""
    try:
        code = process.wait(timeout=10)  # its end of the socket is closed: it is exiting, or gone
    except subprocess.TimeoutExpired:
        return "its process closed its connection and did not end"
    if code >= 0:
        return f"its process ended with exit code {code}"
    try:
        return f"its process was killed by {signal.Signals(-code).name}"
    except ValueError:  # a signal Python has no name for
        return f"its process was killed by signal {-code}"

def one_line(text):
    """text with its line breaks (and runs of spaces) made single spaces."""
    return " ".join(text.split())

def serve(fd):
    """The worker's side (WORKER runs it): import the function the first message names, and answer None, or why it
    cannot be called; then, for each batch, answer each row in turn, ("value", number), ("not a number", what it
    returned) or ("failed", why), stopping the batch at the first answer that is no value. It ends when the run
    closes its end of the socket, or is killed."""
    # signals meant for the run (a scheduler's SIGTERM or SIGUSR1 sent to every process of a job) are the run's to
    # handle: here they are noted and dropped (a handler of Python's, not SIG_IGN, which the function's own child
    # processes would inherit). The run kills this process when it stops.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1):
        signal.signal(signum, lambda signum, frame: None)
    sys.stdout, sys.stderr = (Unbroken(stream) if stream is not None else None for stream in (sys.stdout, sys.stderr))
    os.set_inheritable(fd, False)  # the function's own child processes (os.system) must not keep the socket open
    connection = Connection(fd)
    spec, run = connection.recv()
    die_with(run)
    try:
        function = resolve_reward_fn(spec)
    except InputError as e:
        connection.send(str(e))
        return
    connection.send(None)
    while True:
        try:
            items = connection.recv()
        except EOFError:  # the run is over
            return
        for item in items:
            try:
                completion, answer, metadata = pickle.loads(item)
            except BaseException as e:  # a class the worker cannot import, say
                connection.send(("failed", f"its metadata cannot be read in the function's process: {described(e)}"))
                break
            kind, said = call_reward_fn(function, completion, answer, metadata)
            connection.send((kind, said))
            if kind != "value":
                break
        for stream in (sys.stdout, sys.stderr):  # what it printed, out before a kill could lose it
            try:
                stream.flush()
            except (OSError, ValueError):
                pass

class Unbroken:
    """The worker's sys.stdout or sys.stderr, the run's own: what the function prints is seen while the run's output
    is read, and dropped once its reader has gone (`train.py | head`, `| less` then q), where print would raise
    BrokenPipeError in the function and fail its reward. (The run's own output outlives a closed pipe too.)"""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self.reader_gone()
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except BrokenPipeError:
            self.reader_gone()

    def reader_gone(self):
        """Point the stream's file descriptor at /dev/null: what is left in its buffer, what is printed later, and
        what the function's own child processes write there is dropped without an error."""
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self.stream.fileno())
        os.close(devnull)
        self.stream.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding, buffer: the stream's own
        return getattr(self.stream, name)

def die_with(run):
    """Have the kernel kill this process when the run's process ends, by kill -9 even (Linux's PR_SET_PDEATHSIG):
    else a worker busy in C outlives it. (The kernel watches the thread that started the worker: the run calls the
    reward from its main thread.)"""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the worker ends at its next batch, finding the socket closed
        return
    if os.getppid() != run:  # the run had ended already
        os._exit(1)

def resolve_reward_fn(spec):
    """The function `spec` names, imported; InputError if it cannot be, or cannot be called with three arguments."""
    module_name, _, function_name = spec.partition(":")
    try:
        function = pkgutil.resolve_name(spec)
    except BaseException as e:  # an AttributeError once the module is in: the function is not in it; sys.exit too
        if not (isinstance(e, AttributeError) and module_name in sys.modules):
            raise named_like_stdlib(spec) or InputError(f"--reward-fn {spec}: cannot import {module_name}: "
                                                        f"{type(e).__name__}: {e}")
        function = None
    if not callable(function):
        raise named_like_stdlib(spec) or InputError(f"--reward-fn {spec}: {module_name} has no function "
                                                    f"{function_name!r}")
    try:  # called as function(completion, answer, metadata): a wrong signature fails now, not after the model loads
        inspect.signature(function).bind("completion", "answer", {})
    except TypeError as e:
        raise InputError(f"--reward-fn {spec}: {function_name}{inspect.signature(function)} cannot be called as "
                         f"{function_name}(completion, answer, metadata): {e}")
    except ValueError:  # a built-in without a signature: its first call will tell
        pass
    return function

def named_like_stdlib(spec):
    """InputError saying that the standard library's module was imported instead of the user's file of the same name
    (a gc.py or json.py beside the run: Python's own modules are found first), or None where no such file is on
    sys.path."""
    name = spec.partition(":")[0].partition(".")[0]
    if name not in sys.stdlib_module_names:
        return None
    library = os.path.join(sysconfig.get_paths()["stdlib"], "")
    standard = importlib.util.find_spec(name)  # what `import name` takes: built-in, frozen or in the library
    if standard is None:  # not in this Python (winreg on Linux): a file of that name is imported, and is the user's
        return None
    for folder in sys.path:
        found = importlib.machinery.PathFinder.find_spec(name, [folder])
        where = found and (found.origin or next(iter(found.submodule_search_locations or []), None))
        if where and where != standard.origin and not os.path.abspath(where).startswith(library):
            return InputError(f"--reward-fn {spec}: {name} is the standard library's module, imported instead of your "
                              f"{where}: rename that file")
    return None

def call_reward_fn(function, completion, answer, metadata):
    """One call, in the worker: ("value", a finite float), ("not a number", what it returned) or ("failed", why)."""
    try:
        value = function(completion, answer, metadata)
    except BaseException as e:  # sys.exit in it is a failure like any other: the run saves the steps done first
        return "failed", described(e)
    try:  # a number of any kind (numpy, a 0-d tensor), but not "0.5" or True, which float() would take
        number = float(value) if not isinstance(value, (str, bytes)) and not truth_value(value) else math.nan
    except Exception:  # whatever its __float__ raises
        number = math.nan
    if math.isfinite(number):
        return "value", number
    try:
        return "not a number", str(value)[:100]
    except Exception:
        return "not a number", f"a {type(value).__name__}"

def truth_value(value):
    """Whether value is a boolean of any kind: True, numpy.True_, a 0-d bool array or tensor. Each is refused as a
    reward, as a reward service's true is: `x > 0.5` returned instead of a score is a slip, whichever library made it."""
    return isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool")

def json_problem(metadata):
    """"field 'when' (Object of type datetime is not JSON serializable)": the first field of a row's metadata that
    JSON cannot encode (a parquet file's timestamp or bytes column), or None."""
    for name, value in metadata.items() if isinstance(metadata, dict) else ():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            return f"field {name!r} ({e})"
    return None

def described(error):
    """'ValueError: cannot score this (my_rewards.py:9 in reward > my_rewards.py:4 in check)': the error and, on the
    same line, where it was raised (its traceback's last frames, the outermost first), call_reward_fn's left out."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename != __file__][-4:]
    where = " > ".join(f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" for f in frames)
    return f"{type(error).__name__}: {one_line(str(error))}" + (f" ({where})" if where else "")

MAX_REPLY_BYTES = 64 * 2**20  # a reward service's answer larger than this stops the run instead of filling memory

def remote_rewards(url, completions, answers, metadata, timeout=30.0, retries=3):
    """POST {"completions", "answers", "metadata"} as JSON to a reward service; it answers {"rewards": [...]}.
    Retried with back-off on timeouts, broken connections and server errors; a malformed answer, a redirect or a 4xx
    stops the run. The tries are counted here, not by urllib3's Retry: each try runs under within(), its whole answer
    in `timeout` seconds (urllib3's timeout bounds each read only: a byte a second would hold the run), and urllib3
    retries inside one call, which no outside bound can cut into tries, nor would it reread a body cut short."""
    shown = redact(url)
    try:
        body = json.dumps({"completions": completions, "answers": answers, "metadata": metadata}).encode()
    except (TypeError, ValueError) as e:  # a data column JSON cannot encode: the run saves its steps and says which
        why = next(filter(None, map(json_problem, metadata)), f"its metadata ({e})")
        raise RewardError(f"--reward-url {shown}: cannot send {why} as JSON: drop that column of the data, or cast it "
                          "to text")
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
