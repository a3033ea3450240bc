"""An example reward service over HTTP, standard library only: replace `reward()` with your own.

POST /reward with a JSON body, one answer (and optionally one metadata object) per completion:
  {"completions": ["<think>6*2</think> <answer>12</answer>", "<answer>13</answer>"],
   "answers": ["12", "12"], "metadata": [{"id": 1}, {"id": 2}]}
returns 200 {"rewards": [1.0, 0.0]}. The example reward is 1.0 when the text inside the completion's last
<answer>...</answer> equals the answer as a number (exact fractions, after stripping spaces, commas, a leading
"$" and a trailing "."; "$1,200." equals "1200", "0.5" equals "1/2"), else 0.0 (no tag, not a number).
A malformed request (bad JSON, a missing field, lists of different lengths, a completion that is not a string, a
Content-Length that is not plain decimal digits or two that differ, a body shorter than its Content-Length, whether
it ends early or is not all in within --client-timeout) gets 400 {"error": "what is wrong"}; an unknown path 404, a
body over 64 MiB 413, an exception in reward() 500. A query string is ignored: /reward?x=1 is /reward.
GET /health returns 200 {"status": "ok"}. --delay applies to /reward only, so /health stays a quick check.

The first line on stdout is the address, e.g. "listening on http://127.0.0.1:8731/reward" (with --port 0 the
system picks a free port and that line says which). Ctrl-C (or SIGTERM) stops the server cleanly.

    python tools/reward_server.py                      # http://127.0.0.1:8731/reward
    python tools/reward_server.py --port 0 --delay 5   # a free port; each /reward answer comes 5 s late
    curl -s localhost:8731/reward -d '{"completions": ["<answer>4</answer>"], "answers": ["4"]}'
"""

import argparse
import json
import re
import signal
import socket
import sys
import threading
import time
import urllib.parse
from fractions import Fraction
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
MAX_BODY_BYTES = 64 * 2**20  # a request bigger than this is refused (413) rather than read into memory


def parse_number(text):
    """' $1,200. ' -> Fraction(1200); '1/2' -> Fraction(1, 2); anything that is not a number -> None."""
    text = text.replace(" ", "").replace(",", "").strip()
    text = text.removeprefix("$").removesuffix(".")
    if len(text) > 100 or re.search(r"[eE][+-]?\d{4,}", text):  # Fraction("1e10000000") takes seconds to build
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def reward(completion, answer, metadata=None):
    """1.0 when the last <answer>...</answer> holds the answer's number, else 0.0. metadata: unused here."""
    found = ANSWER.findall(completion)
    predicted = parse_number(found[-1]) if found else None
    return 1.0 if predicted is not None and predicted == parse_number(answer) else 0.0


class BadRequest(Exception):
    """A request the server refuses: the message goes back as {"error": message} with HTTP 400."""


def check_request(body):
    """JSON bytes -> (completions, answers, metadata); raises BadRequest naming what is wrong."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:  # a ValueError also for an integer of more than 4,300 digits
        raise BadRequest(f"the body is not valid JSON: {str(e)[:200]}")
    except RecursionError:
        raise BadRequest("the body is nested too deeply")
    if not isinstance(request, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(request).__name__}")
    for key in ("completions", "answers"):
        if key not in request:
            raise BadRequest(f"missing field {key!r}; the body has {sorted(request)}")
    completions, answers = request["completions"], request["answers"]
    metadata = request.get("metadata")
    if metadata is None:
        metadata = [None] * len(completions) if isinstance(completions, list) else None
    for key, values, kinds, what in (("completions", completions, str, "a string"),
                                     ("answers", answers, (str, int, float), "a string or a number"),
                                     ("metadata", metadata, (dict, type(None)), "an object or null")):
        if not isinstance(values, list):
            raise BadRequest(f"field {key!r} must be a list, got {type(values).__name__}")
        for i, value in enumerate(values):
            if not isinstance(value, kinds) or isinstance(value, bool):
                raise BadRequest(f"{key}[{i}] must be {what}, got {type(value).__name__}")
        if len(values) != len(completions):
            raise BadRequest(f"{len(completions)} completions but {len(values)} {key}: give one per completion")
    return completions, [str(a) for a in answers], metadata


class RewardHandler(BaseHTTPRequestHandler):
    delay = 0.0  # seconds to wait before answering /reward; set from --delay
    quiet = False  # True: no line per request on stderr
    timeout = 10.0  # seconds a client has to send its whole request before it is dropped; set from --client-timeout
    timed_out = False  # set by drop() when the deadline ends a request's read

    def log_message(self, format, *args):
        if not self.quiet:
            super().log_message(format, *args)

    def send_json(self, status, payload):
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def setup(self):
        super().setup()  # the deadline bounds the whole request, so that a client sending a byte a second is dropped too
        self.deadline = threading.Timer(self.timeout, self.drop)
        self.deadline.start()
        # each read's own bound, a backstop past the deadline: at --client-timeout itself it raced the deadline's timer
        # on a busy machine, and where it won the client got no 400, only a closed connection
        self.connection.settimeout(2 * self.timeout + 5)

    def drop(self):
        self.timed_out = True
        try:  # the blocked read returns what came; the sending side stays open for the 400 that says so
            self.connection.shutdown(socket.SHUT_RD)
        except OSError:
            pass

    def route(self):
        """The request's path without its query string: /reward?x=1 is /reward."""
        return urllib.parse.urlsplit(self.path).path

    def content_length(self):
        """The body's size from the Content-Length header(s); raises BadRequest for a missing, non-decimal or
        ambiguous one (int() alone takes "+58" and "5_8", and a second, different header would be ignored)."""
        values = {value.strip() for value in self.headers.get_all("Content-Length", [])}
        if not values:
            raise BadRequest("a Content-Length header with the body's size in bytes is required")
        if len(values) > 1:
            raise BadRequest(f"the request has different Content-Length headers: {', '.join(sorted(values))}")
        value = values.pop()
        if not re.fullmatch(r"[0-9]{1,20}", value):
            raise BadRequest(f"Content-Length must be the body's size in decimal digits, got {value[:40]!r}")
        return int(value)

    def finish(self):
        self.deadline.cancel()
        super().finish()

    def do_GET(self):
        self.deadline.cancel()
        if self.route() == "/health":
            self.send_json(200, {"status": "ok"})
        elif self.route() == "/reward":
            self.send_json(405, {"error": "use POST for /reward"})
        else:
            self.send_json(404, {"error": f"no such path {self.path!r}; use POST /reward or GET /health"})

    def do_POST(self):
        if self.route() != "/reward":
            self.send_json(404, {"error": f"no such path {self.path!r}; use POST /reward or GET /health"})
            return
        try:
            length = self.content_length()
        except BadRequest as e:
            self.send_json(400, {"error": str(e)})
            return
        if length > MAX_BODY_BYTES:
            self.send_json(413, {"error": f"the body has {length} bytes, more than the {MAX_BODY_BYTES} allowed"})
            return
        body = self.rfile.read(length)  # at the deadline drop() ends the read with what came
        self.deadline.cancel()  # the request is in: --delay and reward() take the time they take
        if len(body) < length:
            how = (f"within --client-timeout's {self.timeout:g} s" if self.timed_out
                   else "before the client stopped sending")
            self.send_json(400, {"error": f"only {len(body)} of the body's {length} bytes (its Content-Length) "
                                          f"came {how}"})
            return
        try:
            completions, answers, metadata = check_request(body)
        except BadRequest as e:
            self.send_json(400, {"error": str(e)})
            return
        time.sleep(self.delay)
        try:
            rewards = [float(reward(c, a, m)) for c, a, m in zip(completions, answers, metadata)]
        except Exception as e:  # a bug in reward(): tell the client instead of dropping the connection
            self.send_json(500, {"error": f"reward() failed: {type(e).__name__}: {e}"})
            raise
        self.send_json(200, {"rewards": rewards})

    def handle(self):
        try:
            super().handle()
        except OSError:  # BrokenPipeError, ConnectionResetError, TimeoutError, a socket shut at the deadline
            pass  # the client gave up (its timeout ran out during --delay) or went silent: nothing left to answer


class Server(ThreadingHTTPServer):
    request_queue_size = 128  # the listen backlog (socketserver's 5 reset a third of 100 clients arriving at once)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8731, help="port; 0 picks a free one (default: %(default)s)")
    parser.add_argument("--delay", type=float, default=0.0,
                        help="seconds to sleep before answering each /reward request, to test client timeouts "
                             "(default: %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="do not log each request on stderr (default: %(default)s)")
    parser.add_argument("--client-timeout", type=float, default=10.0, help="seconds a client has to send its whole "
                        "request (a body that never comes, or one byte at a time) before its connection is dropped "
                        "(default: %(default)s)")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    if not 0 <= args.delay <= 1e6:  # time.sleep and socket timeouts overflow far above that
        parser.error(f"--delay must be a number of seconds from 0 to 1e6, got {args.delay}")
    if not 0 < args.client_timeout <= 1e6:
        parser.error(f"--client-timeout must be a number of seconds above 0, at most 1e6, got {args.client_timeout}")
    return args


def stop(signum, frame):
    raise KeyboardInterrupt  # SIGTERM stops the server the same clean way as Ctrl-C


def main(argv=None):
    args = parse_args(argv)
    handler = type("Handler", (RewardHandler,), {"delay": args.delay, "quiet": args.quiet, "timeout": args.client_timeout})
    try:
        server = Server((args.host, args.port), handler)
    except OSError as e:
        sys.exit(f"error: cannot listen on {args.host}:{args.port}: {e}")
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored (e.g. with &)
    signal.signal(signal.SIGTERM, stop)
    host, port = server.server_address[:2]
    print(f"listening on http://{host}:{port}/reward", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", flush=True)
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
