"""A fork server for the suite's `python -m paxlite...` processes: the imports are done once.

Why: about 180 processes of the suite (the docs' commands, the launch scripts, the two-process
runs) each import JAX, Flax, Optax, Fiddle and paxlite before doing anything: about 1.4 of a tiny
training run's 3.2 CPU-s (docs/performance.md, the suite's seventh pass). Here one server process
per environment imports them once; each command is a child forked from it, set up as a fresh
interpreter would be (argv, sys.path[0], the environment, the working directory, the umask, the
resource limits, stdin/stdout/stderr), which then runs the module or script as `__main__`. What runs
is the real entry point in a real process: its own JAX backend, devices, distributed runtime,
threads, exit.

How a command gets here: conftest.py writes a `python` executable (the client, main() below) into
the session's fork directory and puts that directory first on PATH, so the docs' commands and the
launch scripts reach it; a test that starts `python -m paxlite...` itself runs paxlite_python().
The client execs the real interpreter (exactly what `python ARGS` would have done) for anything
else: other modules, scripts outside paxlite/, examples/ and benchmarks/, `-c`, interpreter
options other than -u, `PAXLITE_TEST_NO_FORK_SERVER=1`, or an environment whose server does not
come up. A command whose environment has no server yet starts one (or finds one starting) and
waits for it, so that the first command of an environment is forked too: a pair of processes
started together (the two-process tests) costs one import of JAX and paxlite instead of three (two
interpreters, and a server that only later commands would use). A served command's
sys.executable is the client, so what it starts with sys.executable is served as well.
`python -c` and `python -` are not served: their code sees the preloaded modules (the planner
plans in a subprocess when JAX is imported), and the suite's such commands mostly import no JAX,
so a forked child costs them more than the real interpreter (docs/performance.md, 2026-12-07).

What must match between the server and a child, and how it does:
- Environment variables read at import time (JAX's `JAX_*` configuration, `PYTHON*`, `LD_*`) are
  part of a server's key: a command whose values differ goes to (or starts) another server. The
  rest of the environment is the command's own, set before anything reads it (XLA_FLAGS is read at
  backend start, which a child does itself; the server never starts a backend).
- Modules a command runs as `__main__` (paxlite.main, paxlite/__main__.py, scripts) are not
  preloaded, so they run once, as `__main__`; the preloaded modules define no absl flags beyond
  absl's logging flags, which every paxlite command defines too (PRELOAD).
- Signals sent to the client (SIGTERM, SIGINT, SIGUSR1, ...) are passed to the child; a client
  that dies (SIGKILL, a test's timeout) takes its child with it; the client exits with the child's
  status or dies of the child's signal. SIGSTOP cannot be passed on: the preemption tests that stop
  a run start the real interpreter.
- The child's process id is not the client's, and both share the server's hash seed.
- The garbage collector differs from a fresh interpreter's in when it runs, not in what it
  frees: the preloaded objects are frozen and the thresholds are GC_THRESHOLDS (below).
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import resource
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile

FORK_DIR_VAR = "PAXLITE_TEST_FORK_DIR"  # the session's directory: sockets, pid files, bin/python
OWNER_VAR = "PAXLITE_TEST_FORK_OWNER"  # the controlling pytest process: servers end with it
DISABLE_VAR = "PAXLITE_TEST_NO_FORK_SERVER"
# Not Orbax or Grain: they define absl flags of their own, which a command that has not imported
# them yet does not know (absl's "Did you mean" for an unknown flag would name Orbax's).
PRELOAD = ("jax", "jax.numpy", "flax.linen", "optax", "fiddle", "paxlite.experiments.build",
           "paxlite.cli.job", "paxlite.cli.app")
KEY_PREFIXES = ("JAX_", "PYTHON", "LD_")
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                     signal.SIGUSR2, signal.SIGALRM, signal.SIGCONT)
LIMITS = (resource.RLIMIT_FSIZE, resource.RLIMIT_NOFILE, resource.RLIMIT_AS, resource.RLIMIT_CORE,
          resource.RLIMIT_CPU, resource.RLIMIT_DATA)
# The cyclic garbage collector's thresholds in the test processes (conftest.py) and in the commands
# served here (set in the server, so every child inherits them): Python's default (700, 10, 10)
# walks the young objects every 700 allocations, and tracing a model allocates millions of
# short-lived ones, of which almost none are in cycles. Collections run less often; what they
# collect is the same. Measured with gc.callbacks on 2 cores (2026-12-06), test_moe_sharded.py and
# test_transformer.py in one process: 2,379 collections took 2.94 of the ~54 CPU-s; with these
# thresholds and conftest.py's gc.freeze() after collection, 235 took 0.55 CPU-s.
GC_THRESHOLDS = (20_000, 20, 20)
# How long a command waits for its environment's server to listen before it runs in the real
# interpreter instead (a server imports JAX, Flax, Optax, Fiddle and paxlite: 2-3 s on an idle
# machine, several times that beside a loaded test session).
SERVER_START_TIMEOUT_S = 120
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HEADER = struct.Struct("!I")
_STATUS = struct.Struct("!ci")  # b"P" + the child's pid, then b"S" + its status (-N: signal N)


def paxlite_python() -> str:
    """The interpreter to start a paxlite command with in a test: the session's client (it forks
    the command from a server that has the imports done), or this interpreter without one."""
    fork_dir = os.environ.get(FORK_DIR_VAR)
    client = os.path.join(fork_dir, "bin", "python") if fork_dir else ""
    return client if client and os.path.exists(client) else sys.executable


def served_file(env: dict[str, str]) -> str:
    """The file where the server for commands started with `env` lists what it forked (one JSON
    [pid, args] a line); nothing is started."""
    return os.path.join(env[FORK_DIR_VAR], f"{_key(env, sys.executable)}.served")


def served_python(env: dict[str, str]) -> str:
    """paxlite_python() for commands started with `env`, its server started first if it is not up
    yet: otherwise the first such command is a fresh interpreter, which starts the server beside
    it for the next one."""
    if FORK_DIR_VAR in env:
        start_server(env)
    return paxlite_python()


def write_client(fork_dir: str, real_python: str) -> str:
    """bin/python in `fork_dir`: the real interpreter without site (the client needs the standard
    library only) running main() of this file."""
    bin_dir = os.path.join(fork_dir, "bin")
    os.makedirs(bin_dir, exist_ok=True)
    path = os.path.join(bin_dir, "python")
    here = os.path.dirname(os.path.abspath(__file__))
    with open(path, "w") as f:
        f.write(f"#!{real_python} -S\n"
                f"import sys\nsys.path.insert(0, {here!r})\n"
                "import fork_server\nfork_server.main()\n")
    os.chmod(path, 0o755)
    return path


def stop_servers(fork_dir: str) -> None:
    for name in os.listdir(fork_dir):
        if name.endswith(".pid"):
            with contextlib.suppress(OSError, ValueError), open(os.path.join(fork_dir, name)) as f:
                os.kill(int(f.read()), signal.SIGTERM)


def start_server(env: dict[str, str], *, timeout_s: float = 120) -> str:
    """Start the server for `env` (a command's environment) and wait until it serves; returns the
    file where it lists the commands it forked (one JSON [pid, args] a line)."""
    import time

    fork_dir = env[FORK_DIR_VAR]
    key = _key(env, sys.executable)
    socket_path = os.path.join(fork_dir, f"{key}.sock")
    if not os.path.exists(socket_path):
        _start_server(fork_dir, key, sys.executable, env=env)
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(socket_path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no fork server at {socket_path} after {timeout_s} s")
        time.sleep(0.1)
    return served_file(env)


def _key(env: dict[str, str], real_python: str) -> str:
    items = sorted((k, v) for k, v in env.items() if k.startswith(KEY_PREFIXES))
    return hashlib.sha1(json.dumps([real_python, items]).encode()).hexdigest()[:16]


def _unbuffered(args: list[str]) -> tuple[bool, list[str]]:
    """Whether `python ARGS` asks for unbuffered stdout and stderr (-u, the one interpreter option
    served), and the arguments after it."""
    return (True, args[1:]) if args[:1] == ["-u"] else (False, args)


def _command(args: list[str]) -> tuple[str, str] | None:
    """("module", NAME) for `-m paxlite...`, ("script", PATH) for a script of paxlite/,
    examples/ or benchmarks/; None: not served (another script may set JAX's environment
    variables before it imports JAX, which a child of a server that has imported it would not
    see)."""
    _, args = _unbuffered(args)
    if len(args) >= 2 and args[0] == "-m" and args[1].split(".")[0] == "paxlite":
        return "module", args[1]
    if args and args[0].endswith(".py") and os.path.isfile(args[0]):
        script = os.path.realpath(args[0])
        if any(script.startswith(os.path.join(_REPO, part) + os.sep)
               for part in ("paxlite", "examples", "benchmarks")):
            return "script", args[0]
    return None


# ------------------------------------------------------------------------------------------------
# The client: `python ARGS` in a test's command


def main() -> None:
    real_python = sys.executable
    args = sys.argv[1:]
    fork_dir = os.environ.get(FORK_DIR_VAR, "")
    command = _command(args)
    if command is None or not fork_dir or os.environ.get(DISABLE_VAR) == "1":
        os.execv(real_python, [real_python, *args])
    key = _key(dict(os.environ), real_python)
    conn = _connect(fork_dir, key)
    if conn is None:
        conn = _connect_once_up(fork_dir, key, _start_server(fork_dir, key, real_python))
    if conn is None:
        _log(fork_dir, f"{key} not served (its server did not come up): {args[:2]}")
        os.execv(real_python, [real_python, *args])
    request = {
        "args": args, "executable": os.path.abspath(sys.argv[0]), "cwd": os.getcwd(),
        "env": dict(os.environ), "umask": _umask(),
        "limits": {str(limit): resource.getrlimit(limit) for limit in LIMITS},
    }
    payload = json.dumps(request).encode()
    pid = None
    early: list[int] = []  # signals that came before the child's pid: passed on once it is known

    def forward(signum, _frame):
        if pid is None:
            early.append(signum)
            return
        with contextlib.suppress(ProcessLookupError):  # it has ended; its status is on its way
            os.kill(pid, signum)

    for number in FORWARDED_SIGNALS:  # before the child exists, so that no signal is lost
        signal.signal(number, forward)
    socket.send_fds(conn, [_HEADER.pack(len(payload)) + payload], [0, 1, 2])
    _, pid = _STATUS.unpack(_recv_exactly(conn, _STATUS.size))
    for signum in early:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    _, status = _STATUS.unpack(_recv_exactly(conn, _STATUS.size))
    if status >= 0:
        os._exit(status)
    signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
    os._exit(128 - status)


def _connect(fork_dir: str, key: str) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(os.path.join(fork_dir, f"{key}.sock"))
    except OSError:
        conn.close()
        return None
    return conn


def _connect_once_up(fork_dir: str, key: str,
                     server: subprocess.Popen | None) -> socket.socket | None:
    """A connection to the server of `key` once it listens (a server imports for a few seconds),
    or None when it has exited or is not listening after SERVER_START_TIMEOUT_S. `server`: the one
    this command started (None: another command started it)."""
    import time

    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        conn = _connect(fork_dir, key)
        if conn is not None:
            return conn
        if server is not None:
            gone = server.poll() is not None  # reaped here: for the others it is gone, not a zombie
        else:
            try:
                with open(os.path.join(fork_dir, f"{key}.starting")) as f:
                    gone = not _alive(int(f.read()))
            except (OSError, ValueError):  # the command that took the lock is writing it
                gone = False
        if gone:
            return _connect(fork_dir, key)
        time.sleep(0.05)
    return None


def _log(fork_dir: str, line: str) -> None:
    """clients.log in the session's directory: the commands started without the server."""
    with open(os.path.join(fork_dir, "clients.log"), "a") as f:
        f.write(line + "\n")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise SystemExit(f"fork server: the server closed the connection ({len(data)} bytes)")
        data += chunk
    return data


def _start_server(fork_dir: str, key: str, real_python: str, *,
                  env: dict[str, str] | None = None) -> subprocess.Popen | None:
    """Start the server for this environment unless another command has (the lock file); the
    server, or None where another command started it."""
    try:
        os.close(os.open(os.path.join(fork_dir, f"{key}.lock"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return None
    with open(os.path.join(fork_dir, f"{key}.log"), "ab") as log:
        server = subprocess.Popen([real_python, os.path.abspath(__file__), fork_dir, key], env=env,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                  start_new_session=True, close_fds=True)
    # for the commands that wait for it (_connect_once_up): whether it is still starting
    with open(os.path.join(fork_dir, f"{key}.starting.tmp"), "w") as f:
        f.write(str(server.pid))
    os.rename(os.path.join(fork_dir, f"{key}.starting.tmp"),
              os.path.join(fork_dir, f"{key}.starting"))
    return server


# ------------------------------------------------------------------------------------------------
# The server


def _serve(fork_dir: str, key: str) -> dict:
    """Accept commands until the session ends; returns (in a forked child only) its request."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()  # the children's collections leave the preloaded objects (and their pages) alone
    gc.set_threshold(*GC_THRESHOLDS)
    owner = int(os.environ.get(OWNER_VAR, "0"))
    path = os.path.join(fork_dir, f"{key}.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)
    with open(os.path.join(fork_dir, f"{key}.pid"), "w") as f:
        f.write(str(os.getpid()))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ, "accept")
    selector.register(wake_r, selectors.EVENT_READ, "children")
    children: dict[int, socket.socket] = {}  # pid -> its client's connection

    def kill_children():  # no command outlives its server
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def stop(*_):  # the session ends (stop_servers)
        kill_children()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    while True:
        events = selector.select(timeout=30)
        if not events and (not os.path.isdir(fork_dir) or (owner and not _alive(owner))):
            kill_children()
            return {}
        for selected, _ in events:
            if selected.data == "accept":
                conn, _ = listener.accept()
                request, fds = _read_request(conn)
                sys.stdout.flush()
                sys.stderr.flush()
                # SIGTERM (stop) waits until the new child is in `children`, so it is killed too
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    for number in (signal.SIGCHLD, signal.SIGTERM):
                        signal.signal(number, signal.SIG_DFL)
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
                    selector.close()
                    for open_socket in (listener, conn, *children.values()):
                        open_socket.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    request["fds"] = fds
                    return request
                # Known as a child before anyone can learn its pid (the .served record, the
                # client) or stop the server: a stop in between would leave it running alone.
                children[pid] = conn
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
                for fd in fds:
                    os.close(fd)
                with open(os.path.join(fork_dir, f"{key}.served"), "a") as served:
                    served.write(json.dumps([pid, request["args"]]) + "\n")
                with contextlib.suppress(OSError):  # a client killed already: its EOF comes next
                    conn.sendall(_STATUS.pack(b"P", pid))
                selector.register(conn, selectors.EVENT_READ, pid)
            elif selected.data == "children":
                os.read(wake_r, 4096)
                _reap(children, selector)
            else:  # the client of this child went away (killed): the child goes too
                pid = selected.data
                try:
                    gone = not selected.fileobj.recv(1)
                except OSError:  # reset by a killed client
                    gone = True
                if gone:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    selector.unregister(selected.fileobj)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
    while len(data) < _HEADER.size:
        data += conn.recv(1 << 20)
    (length,) = _HEADER.unpack(data[:_HEADER.size])
    data = data[_HEADER.size:]
    while len(data) < length:
        data += conn.recv(length - len(data))
    return json.loads(data), list(fds)


def _reap(children: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    while children:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        status = os.waitstatus_to_exitcode(raw)
        with contextlib.suppress(KeyError):  # its client's end was seen closed already
            selector.unregister(conn)
        with contextlib.suppress(OSError):  # the client is gone
            conn.sendall(_STATUS.pack(b"S", status))
        conn.close()


def _become(request: dict) -> None:
    """Turn this forked child into the process `python ARGS` would have started."""
    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
    for fd in request["fds"]:
        if fd > 2:
            os.close(fd)
    os.chdir(request["cwd"])
    # what `python` resolved to in the command, as a fresh interpreter has it: the commands it
    # starts with sys.executable (a benchmark's runs, the planner's fresh process) come here too
    sys.executable = request["executable"]
    os.environ.clear()
    os.environ.update(request["env"])
    os.umask(request["umask"])
    tempfile.tempdir = None  # found again from this environment's TMPDIR
    for limit, (soft, hard) in request["limits"].items():
        if resource.getrlimit(int(limit)) != (soft, hard):
            resource.setrlimit(int(limit), (soft, hard))
    unbuffered, _ = _unbuffered(request["args"])
    sys.stdout.reconfigure(line_buffering=os.isatty(1), write_through=unbuffered)
    sys.stderr.reconfigure(write_through=unbuffered)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _run(request: dict) -> None:
    import runpy
    import types

    _, args = _unbuffered(request["args"])
    kind, target = _command(args)
    sys.modules["__main__"] = types.ModuleType("__main__")
    if kind == "module":
        sys.path[0] = os.getcwd()
        sys.argv = ["-m", *args[2:]]
        runpy._run_module_as_main(target)
    else:
        sys.path[0] = os.path.dirname(os.path.realpath(target))
        sys.argv = list(args)
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__" and len(sys.argv) == 3:
    _request = _serve(sys.argv[1], sys.argv[2])
    if _request:
        _become(_request)
        _run(_request)
