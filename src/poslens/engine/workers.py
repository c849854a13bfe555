"""Worker processes for jobs run side by side: the sweep's training parts, the report's length runs.

A spawned process imports torch and transformers again before it can work (7.4 s a worker on the 2-core machine,
BENCHMARKS.md "Length section against the previous release"). Here workers are forked from one server per program
(multiprocessing's forkserver) that has imported them once, so a pool after the first starts in a fraction of a
second; `start()` starts that server early, so its imports run beside other work. Where a platform has no forkserver,
workers are spawned as before.

What a forked worker would otherwise get wrong, handled here:

* the environment: a worker is the server's child, and the server's environment is the one it started with; each
  job runs under the submitting process's environment of the moment it was submitted (`Pool.submit`);
* CPU time: `RUSAGE_CHILDREN` of this process does not see the server's children; each job adds its CPU seconds
  (its own and its children's) to a counter this process reads (`cpu_seconds`), and at exit the server is stopped and
  waited for, so a parent of this program sees the whole tree's CPU time in its `RUSAGE_CHILDREN`, as with spawned
  workers;
* the caller's script: multiprocessing imports the parent's main module in every worker it starts (so that functions
  defined there unpickle), which runs a script's top level again, and a script without `if __name__ == "__main__":`
  that starts workers then fails in each worker; the jobs here are poslens functions, so a worker is started without
  the parent's main module (`_without_main`), and a script or notebook needs no guard;
* its owner's death: a process killed without a word (SIGKILL, or a SIGTERM, which runs no exit handler) cannot stop
  its workers, and a forked worker is not its child; each worker ends as soon as the process that made its pool is
  gone (`_end_with`), instead of finishing its job (minutes of training) for nobody while holding its cache locks;
* Ctrl-C while the server imports PRELOAD (a few seconds after the first pool or `start()`): the terminal sends it to
  the whole process group, and the server, which ignores it only once its imports are done, printed a traceback of
  the interrupted import under the command's one-line message; it is started ignoring SIGINT (inherited across
  exec), and each worker restores Python's handler, so that a job is interrupted as before (`_server_running`);
* Ctrl-C while a pool's first worker waits for the server's imports: the worker's start had already sent the server
  the pool's pickled queues, whose semaphores this process removes as it exits, and the worker, forked once the
  imports were done, printed a traceback of the missing semaphore (FileNotFoundError) under the command's one-line
  message; a pool is made only once the server has forked a first, trivial process (`_server_ready`), so a Ctrl-C
  during the imports finds no pool to be sent.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import resource
import select
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import context as mp_context
from multiprocessing import spawn
from typing import Any

# what the server imports once: every module a worker's job needs (an import that fails is skipped by the server)
PRELOAD = ["torch", "transformers", "poslens.train.sweep", "poslens.analyses.length.run"]

_counters: list[Any] = []  # one shared CPU-seconds counter per forkserver pool made here


def forked() -> bool:
    """Whether workers are forked from the server here (False: spawned, where the platform has no forkserver)."""
    return "forkserver" in multiprocessing.get_all_start_methods()


_launching = threading.Lock()  # one worker started at a time while the preparation data leaves out the main module


def _without_main(start: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A process class's `_Popen` that starts the worker without the parent's main module: the preparation data a
    new process reads (`multiprocessing.spawn.get_preparation_data`, looked up when the process starts) has no
    `init_main_from_path` or `init_main_from_name` for the time of the start."""
    def popen(process_obj):
        with _launching:
            full = spawn.get_preparation_data

            def data(name):
                d = full(name)
                d.pop("init_main_from_path", None)
                d.pop("init_main_from_name", None)
                return d

            spawn.get_preparation_data = data
            try:
                return start(process_obj)
            finally:
                spawn.get_preparation_data = full

    return staticmethod(popen)


class _SpawnProcess(mp_context.SpawnProcess):
    _Popen = _without_main(mp_context.SpawnProcess._Popen)


class _SpawnContext(mp_context.SpawnContext):
    Process = _SpawnProcess


if forked():
    class _ForkServerProcess(mp_context.ForkServerProcess):
        _Popen = _without_main(mp_context.ForkServerProcess._Popen)

    class _ForkServerContext(mp_context.ForkServerContext):
        Process = _ForkServerProcess


def context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context of the workers: the forkserver with PRELOAD imported, else spawn; either starts
    its workers without the parent's main module."""
    if not forked():
        return _SpawnContext()
    ctx = _ForkServerContext()
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start() -> None:
    """Start the server now (it imports PRELOAD beside the caller's work); nothing if it runs or is not used."""
    if forked():
        context()
        _server_running()


def _server_running() -> None:
    """Start the server if it is not running, with SIGINT ignored: a process started with SIGINT ignored keeps it
    ignored (Python installs its handler only over the default), so a Ctrl-C during the server's imports leaves it
    alone; the caller's own handler is back at once."""
    from multiprocessing import forkserver

    if threading.current_thread() is not threading.main_thread():  # signal handlers are the main thread's
        forkserver.ensure_running()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


_ready: set[int] = set()  # the servers (pids) that have forked a process since they started


def _nothing() -> None:
    """The trivial job of `_server_ready`'s process."""


def _server_ready(ctx: multiprocessing.context.BaseContext) -> None:
    """Start the server if it is not running (`_server_running`) and wait until it has imported PRELOAD: it forks a
    process only then, so a trivial process is started and waited for, once per server."""
    from multiprocessing import forkserver

    _server_running()
    pid = forkserver._forkserver._forkserver_pid
    if pid in _ready:
        return
    process = ctx.Process(target=_nothing, name="poslens-server-ready")
    process.start()
    process.join()
    _ready.add(pid)


def cpu_seconds() -> float:
    """CPU seconds of the jobs finished in forked workers of this process's pools (spawned workers are this process's
    children: `RUSAGE_CHILDREN` counts them)."""
    return sum(c.value for c in _counters)


class Pool(ProcessPoolExecutor):
    """A process pool of `jobs` workers (`initializer(*initargs)` run in each), forked from the server where it
    runs; each job runs under the environment of its submission and counts its CPU seconds (`cpu_seconds`)."""

    def __init__(self, jobs: int, initializer: Callable[..., Any] | None = None, initargs: tuple = ()) -> None:
        ctx = context()
        self._counter = None
        if ctx.get_start_method() == "forkserver":
            _server_ready(ctx)  # before any semaphore of the pool exists (module docstring)
            self._counter = ctx.Value("d", 0.0)
            _counters.append(self._counter)
        super().__init__(max_workers=jobs, mp_context=ctx, initializer=_init,
                         initargs=(self._counter, os.getpid(), initializer, initargs))

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        return super().submit(_call, dict(os.environ), fn, args, kwargs)


_COUNTER: Any = None  # in a worker: its pool's CPU-seconds counter (None: spawned)


def _init(counter: Any, owner: int, initializer: Callable[..., Any] | None, initargs: tuple) -> None:
    global _COUNTER
    _COUNTER = counter
    if counter is not None:  # forked from the server, which ignores SIGINT: a job is interrupted as a spawned one
        signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=_end_with, args=(owner,), daemon=True, name="poslens-owner-watch").start()
    if initializer is not None:
        initializer(*initargs)


def _end_with(owner: int) -> None:
    """In a worker: end it as soon as the process that made its pool is gone. Killed without a word (SIGKILL, or a
    SIGTERM, which runs no exit handler), that process cannot stop its workers, and a forked worker is not its child:
    it would go on with its job (a sweep part: minutes of training) for nobody, holding the job's cache locks, so that
    a rerun would wait for it. Linux: the process's pidfd becomes readable when it exits; elsewhere, a poll a second."""
    try:
        fd = os.pidfd_open(owner)
    except (AttributeError, OSError):  # no pidfd (not Linux, or an old kernel): poll
        fd = None
    if fd is not None:
        select.select([fd], [], [])
    else:
        while True:
            time.sleep(1.0)
            try:
                os.kill(owner, 0)
            except ProcessLookupError:
                break
            except PermissionError:
                continue
    os._exit(1)


def process_seconds() -> float:
    """CPU seconds of this process and of its children that have ended and been waited for."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _call(env: dict[str, str], fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """In a worker: fn(*args, **kwargs) under the submitting process's environment; its CPU seconds counted."""
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    t0 = process_seconds()
    try:
        return fn(*args, **kwargs)
    finally:
        if _COUNTER is not None:
            with _COUNTER.get_lock():
                _COUNTER.value += process_seconds() - t0


def _stop_server() -> None:
    """At exit: stop the server and wait for it (its children's CPU time then reaches this process's parent)."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) is not None:
        try:
            server._stop()
        except OSError:
            pass


atexit.register(_stop_server)  # (nothing to do where no server was started)
