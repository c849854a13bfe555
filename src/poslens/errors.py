"""User-facing errors: one line, exit status 2, no traceback (the CLI catches `UsageError`)."""

from __future__ import annotations

import math
import numbers
import os


class UsageError(ValueError):
    """Bad input from the user. The message names the argument and says how to fix it.

    `param`: the library parameter the message starts with (the CLI shows it as its flag, `seq_len` -> `--seq-len`).
    `in_file`: the message is about a file's contents (a preset, a matrix), so the names in it are that file's
    fields, which the CLI shows as written (`kv_heads`, not `--kv-heads`). The message is kept on one line: control
    characters in it (a newline in a file name) are shown as escapes.
    """

    def __init__(self, message: str = "", param: str | None = None, in_file: bool = False) -> None:
        super().__init__(one_line(str(message)))
        self.param, self.in_file = param, in_file


def one_line(text: str) -> str:
    """`text` with every character that is not printable (newlines, other line breaks, control characters, the
    surrogates of undecodable file names) shown as its escape, so that it prints as one line on any terminal."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in text)


def require(ok: bool, message: str) -> None:
    """Raise `UsageError(message)` unless `ok`."""
    if not ok:
        raise UsageError(message)


def check_int(name: str, value: int, lo: int, hi: int | None = None) -> int:
    """`lo <= value (<= hi)` for an integer argument, else a one-line UsageError."""
    try:
        whole = not isinstance(value, bool) and int(value) == value
    except (TypeError, ValueError, OverflowError):  # None, "abc", nan, inf
        whole = False
    if not whole:
        raise UsageError(f"{name} must be an integer, got {value!r}", param=name)
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise UsageError(f"{name} must be {rng}, got {value}", param=name)
    return value


def check_float(name: str, value: float, lo: float, hi: float, hi_open: bool = False, lo_open: bool = False) -> float:
    """Range check for a real-number argument (not a string, not a bool); bounds shown the way the math writes them."""
    value = check_real(name, value)
    bad = (
        not math.isfinite(value)
        or (value <= lo if lo_open else value < lo)
        or (value >= hi if hi_open else value > hi)
    )
    if bad:
        rng = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise UsageError(f"{name} must be in {rng}, got {value:g}", param=name)
    return value


def check_real(name: str, value: float) -> float:
    """A finite real number (int or float, numpy scalars included; strings, bools, NaN and infinities refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UsageError(f"{name} must be a number, got {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int too large for a float
        value = math.inf
    if not math.isfinite(value):
        raise UsageError(f"{name} must be a finite number, got {value:g}")
    return value


def available_memory() -> int | None:
    """Bytes this process can still allocate: MemAvailable, capped by a cgroup limit; None if unknown."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f, open(usage_file) as g:
                limit, usage = f.read().strip(), int(g.read().strip())
            if limit.isdigit() and int(limit) < 1 << 60:
                avail = min(avail, max(0, int(limit) - usage))
            break
        except (OSError, ValueError):
            continue
    return avail


def gib(nbytes: float) -> str:
    """A byte count for a message: '3.2 GiB', '512 MiB'."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


def check_memory(need: float, what: str, fix: str, available: int | None = None) -> None:
    """Refuse, before any work, a job whose estimated memory `need` (bytes) exceeds what is available."""
    available = available_memory() if available is None else available
    if available is not None and need > available:
        raise UsageError(f"{what} would need about {gib(need)} of memory but {gib(available)} is available; {fix}")


# Operations per second a job is assumed to run at when its time is estimated: generous for the device (a CPU
# of a few cores reaches about 1e10 float32 operations per second in poslens's small matmuls, an H100 about 1e14
# in large ones), so a job refused by `check_duration` would take longer still.
RATE = {"cpu": 1e11, "cuda": 1e14}
DAYS = 7.0  # a job estimated to take longer than this at RATE is refused before any work


def duration(seconds: float) -> str:
    """Seconds for a message: '40 s', '12 min', '5.0 h', '3.2 days', '1.2e+04 years'."""
    for unit, size in (("years", 365.25 * 86400), ("days", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size * (2 if unit != "years" else 1):
            n = seconds / size
            return f"{n:.3g} {unit}" if n < 1e4 else f"{n:.1e} {unit}"
    return f"{seconds:.0f} s"


def check_duration(operations: float, what: str, fix: str, device: str = "cpu") -> None:
    """Refuse, before any work, a job of about `operations` floating-point operations that would take more than
    `DAYS` days even at the generous `RATE` of its device ("cpu" or "cuda..."); the message gives the estimate."""
    rate = RATE["cuda" if str(device).startswith("cuda") else "cpu"]
    seconds = float(operations) / rate
    if seconds > DAYS * 86400:
        raise UsageError(f"{what} is about {operations:.2g} floating-point operations: {duration(seconds)} even at "
                         f"{rate:.0e} per second on the {'GPU' if rate == RATE['cuda'] else 'CPU'}, more than "
                         f"{DAYS:g} days; {fix}")


def check_choice(name: str, value: str, choices: tuple[str, ...] | list[str]) -> str:
    """`value` must be one of `choices`."""
    if not isinstance(value, str) or value not in choices:
        raise UsageError(f"{name} must be one of {', '.join(choices)}; got {value!r}", param=name)
    return value
