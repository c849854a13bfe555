"""Worker processes forked from one server (`poslens.engine.workers`): each job under its submitter's environment,
its CPU time counted, the server's imports made once, and the whole tree's CPU time seen by a parent at exit."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

import pytest

from poslens.engine import workers

pytestmark = pytest.mark.skipif(not workers.forked(), reason="no forkserver on this platform (workers are spawned)")


def _env(name: str) -> str | None:
    return os.environ.get(name)


def _burn(seconds: float) -> bool:
    """Spin for `seconds` of this process's CPU time; whether torch was imported before the job ran."""
    imported = "torch" in sys.modules
    t0 = time.process_time()
    while time.process_time() - t0 < seconds:
        pass
    return imported


def _interrupts_raise() -> bool:
    import signal

    return signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _ignores_sigint(pid: int) -> bool:
    """Whether process `pid` ignores SIGINT (bit 2 of /proc/PID/status's SigIgn mask)."""
    import signal
    from pathlib import Path

    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigIgn:"))
    return bool(int(line.split()[1], 16) & (1 << (signal.SIGINT - 1)))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc (Linux)")
def test_the_server_ignores_ctrl_c_from_its_start_and_its_workers_do_not():
    """A Ctrl-C while the server imports torch printed a traceback under the command's one line: the server runs
    with SIGINT ignored from its start (before its imports), and a job still gets Python's KeyboardInterrupt."""
    from multiprocessing import forkserver

    before = _ignores_sigint(os.getpid())  # (a pytest-xdist worker ignores SIGINT itself)
    with workers.Pool(1) as pool:
        assert pool.submit(_interrupts_raise).result()
    assert _ignores_sigint(forkserver._forkserver._forkserver_pid)
    assert _ignores_sigint(os.getpid()) == before  # the caller's handling is back


def test_the_servers_imports_run_with_ctrl_c_ignored(tmp_path):
    """What the server's imports see (a module among them writes SIGINT's handler down as it is imported), in a
    program of its own (one server a program): ignored; Python's KeyboardInterrupt handler before."""
    (tmp_path / "sigprobe.py").write_text(
        "import os, signal\n"
        "open(os.environ['POSLENS_SIGPROBE'], 'w').write(repr(signal.getsignal(signal.SIGINT)))\n")
    probe = tmp_path / "seen.txt"
    script = ("import os, time\n"  # run in tmp_path: the server finds sigprobe there ('' on its sys.path)
              "from poslens.engine import workers\n"
              "workers.PRELOAD = ['sigprobe']\n"
              "workers.start()\n"
              "deadline = time.monotonic() + 60\n"
              f"while not os.path.exists({str(probe)!r}) and time.monotonic() < deadline: time.sleep(0.05)\n")
    env = {**os.environ, "POSLENS_SIGPROBE": str(probe)}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120, cwd=tmp_path)
    assert probe.read_text() == "<Handlers.SIG_IGN: 1>"


def test_a_job_runs_under_the_environment_of_its_submission():
    workers.start()  # the server's environment is fixed now
    os.environ["POSLENS_TEST_WORKERS"] = "after the server started"
    try:
        with workers.Pool(1) as pool:
            assert pool.submit(_env, "POSLENS_TEST_WORKERS").result() == "after the server started"
            del os.environ["POSLENS_TEST_WORKERS"]
            assert pool.submit(_env, "POSLENS_TEST_WORKERS").result() is None  # the same worker, a later job
    finally:
        os.environ.pop("POSLENS_TEST_WORKERS", None)


def test_jobs_count_their_cpu_time_and_find_the_servers_imports():
    before = workers.cpu_seconds()
    with workers.Pool(2) as pool:
        imported = [f.result() for f in [pool.submit(_burn, 0.3) for _ in range(2)]]
    assert imported == [True, True]  # torch came with the fork, not with the job
    assert workers.cpu_seconds() - before >= 0.55  # two jobs of 0.3 s each, counted here (RUSAGE_CHILDREN is not)


def test_a_parent_sees_the_workers_cpu_time_after_the_program_exits():
    program = ("from poslens.engine import workers\n"
               "workers.PRELOAD.clear()\n"  # a server that imports nothing: what is waited for does not depend on it
               "with workers.Pool(1) as pool:\n"
               "    pool.submit(sum, range(40_000_000)).result()\n"
               "print(workers.cpu_seconds())\n")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    counted = float(out.stdout)
    assert counted > 0.2  # the job's sum (about 0.5-1 s of CPU)
    seen = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    assert seen >= counted  # the program, its server and the worker all waited for: the job's time included


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_script_without_a_main_guard_runs_its_top_level_once(tmp_path, method):
    """multiprocessing runs the parent's main script again in each worker it starts, unless told otherwise: a script
    without `if __name__ == "__main__":` would start workers from its workers and fail. Here the top level runs once."""
    script = tmp_path / "analysis.py"
    script.write_text("from poslens.engine import workers\n"
                      "workers.PRELOAD.clear()\n"  # a server that imports nothing (fast)
                      + ("workers.forked = lambda: False\n" if method == "spawn" else "")
                      + "print('top level', flush=True)\n"
                      "with workers.Pool(1) as pool:\n"
                      "    print(pool.submit(sum, range(10)).result())\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["top", "level", "45"]


def _gone(pid: int, within: float) -> bool:
    """Whether process `pid` has ended (or is a zombie nobody reaps) within `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGTERM"])
def test_a_worker_ends_when_the_program_that_made_its_pool_is_killed(method, signal_name):
    """A program killed without a word (SIGKILL; SIGTERM runs no exit handler) cannot stop its workers; each worker
    ends by itself within seconds instead of finishing a job of minutes for nobody (it did before: a killed
    `reproduce`'s sweep parts trained on, 10 minutes later, holding their cache locks)."""
    import signal

    program = ("import os, time\n"
               "from poslens.engine import workers\n"
               "workers.PRELOAD.clear()\n"
               + ("workers.forked = lambda: False\n" if method == "spawn" else "")
               + "pool = workers.Pool(1)\n"
               "print(pool.submit(os.getpid).result(), flush=True)\n"
               "pool.submit(time.sleep, 600)\n"
               "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(proc.stdout.readline())
        time.sleep(0.5)  # the worker is in its 600-s job
        assert not _gone(worker, 0.2)
        proc.send_signal(getattr(signal, signal_name))
        proc.wait(timeout=30)
        assert _gone(worker, 15), f"worker {worker} outlived its program"
    finally:
        proc.kill()
        proc.wait()


def test_ctrl_c_while_the_server_imports_leaves_no_traceback_of_a_worker(tmp_path):
    """Ctrl-C while a pool's first worker waits for the server's imports (a module among them, `gate`, holds them
    until the test lets it go): the program exits 130 with nothing on stderr. Before, the worker's start had sent the
    server the pool's semaphores, which the program removed as it exited, and the worker forked after the imports
    printed a traceback of the missing semaphore (FileNotFoundError)."""
    import signal

    (tmp_path / "gate.py").write_text(
        "import os, time\n"
        "open('importing', 'w').close()\n"
        "while not os.path.exists('release'): time.sleep(0.05)\n")
    program = ("import os, sys\n"  # run in tmp_path: the server finds gate there ('' on its sys.path)
               "from poslens.engine import workers\n"
               "workers.PRELOAD = ['gate']\n"
               "pool = None\n"
               "try:\n"
               "    pool = workers.Pool(1)\n"
               "    pool.submit(os.getpid).result()\n"
               "except KeyboardInterrupt:\n"  # as the sweep stops its workers on Ctrl-C
               "    if pool is not None:\n"
               "        for p in list(pool._processes.values()): p.terminate()\n"
               "        pool.shutdown(wait=True, cancel_futures=True)\n"
               "    sys.exit(130)\n")
    proc = subprocess.Popen([sys.executable, "-c", program], cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,  # Ctrl-C as in a terminal (a pytest-xdist worker ignores it)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "importing").exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.05)
        time.sleep(0.5)  # the program is in the pool's first start, waiting for the server
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal sends Ctrl-C: to the whole process group
        time.sleep(0.5)
        (tmp_path / "release").touch()  # the server finishes its imports (the program's exit waits for it)
        assert proc.wait(timeout=60) == 130
        while time.monotonic() < deadline + 60:  # the group's last process (a forked worker) gone
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        assert proc.stderr.read() == ""
    finally:
        (tmp_path / "release").touch()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
