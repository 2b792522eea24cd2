"""Answer extraction and equivalence: a table of cases, adversarial inputs, and batches in worker processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from fasttnt.verify import (
    MAX_ANSWER_CHARS,
    VerifierPool,
    extract_answer,
    fast_equivalent,
    is_equivalent,
    verify_batch,
)

# (prediction, gold, expected): integers and formatting; fractions; radicals and symbolic forms; percentages;
# units and \text; intervals, tuples and sets; multiple choice; and wrong-but-close answers of every kind.
CASES = [
    # integers, signs, thousands separators, decimals
    ("42", "42", True),
    (" 42 ", "42", True),
    ("042", "42", True),
    ("1,000", "1000", True),
    ("1000", "1,000", True),
    ("-7", "-7", True),
    ("+7", "7", True),
    ("7.0", "7", True),
    ("3.50", "3.5", True),
    ("42", "43", False),
    ("-7", "7", False),
    ("1,000", "100", False),
    ("0.5", "0.05", False),
    # fractions
    ("\\frac{1}{2}", "0.5", True),
    ("\\dfrac{1}{2}", "\\frac12", True),
    ("\\tfrac{3}{4}", "3/4", True),
    ("1/2", "\\frac{2}{4}", True),
    ("-\\frac{1}{3}", "\\frac{-1}{3}", True),
    ("\\frac{1}{3}", "0.33", False),
    ("\\frac{2}{3}", "\\frac{3}{2}", False),
    ("\\frac{1}{2}", "-\\frac{1}{2}", False),
    # radicals, pi, symbolic forms
    ("\\sqrt{8}", "2\\sqrt{2}", True),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}", True),
    ("2\\pi", "\\pi \\cdot 2", True),
    ("\\sqrt{2}/2", "\\frac{1}{\\sqrt{2}}", True),
    ("10^{3}", "1000", True),
    ("2^{10}", "1024", True),
    ("x^2+2x+1", "(x+1)^2", True),
    ("\\sqrt{3}", "\\sqrt{2}", False),
    ("3.14", "\\pi", False),
    ("x^2+1", "(x+1)^2", False),
    ("2\\sqrt{3}", "3\\sqrt{2}", False),
    # percentages
    ("50\\%", "50", True),
    ("50\\%", "0.5", True),
    ("12.5%", "12.5", True),
    ("50\\%", "5", False),
    # units, \text, degrees, assignments
    ("5\\text{ cm}", "5", True),
    ("\\text{5}", "5", True),
    ("30^\\circ", "30", True),
    ("30^{\\circ}", "30", True),
    ("x = 3", "3", True),
    ("k=12", "12", True),
    ("5\\text{ cm}", "6", False),
    ("x = 4", "3", False),
    # intervals
    ("[0,1)", "[0, 1)", True),
    ("(-\\infty, 2]", "(-\\infty,2]", True),
    ("[0,1]", "[0,1)", False),
    ("(1, 2)", "(1, 3)", False),
    # tuples and sets
    ("(1,2)", "(1, 2)", True),
    ("\\{1,2\\}", "\\{2,1\\}", True),
    ("\\left( 3, 4 \\right)", "(3,4)", True),
    ("\\{1,2\\}", "\\{1,3\\}", False),
    ("(2,1)", "(1,2)", False),
    # multiple choice (GPQA-style letters)
    ("C", "C", True),
    ("(C)", "C", True),
    ("\\text{(B)}", "B", True),
    ("\\textbf{D}", "D", True),
    ("A. 42 kg", "A", True),
    ("C", "B", False),
    ("(A)", "D", False),
    # text answers
    ("\\text{even}", "even", True),
    ("odd", "even", False),
    # near misses, both ways round, next to their true twins: a tolerance of any size on decimals (within 1%,
    # within 0.1%) turns one of these wrong answers right
    ("3.15", "3.14", False),
    ("3.14", "3.15", False),
    ("3.140", "3.14", True),
    ("0.334", "\\frac{1}{3}", False),
    ("\\frac{1}{3}", "0.334", False),
    ("\\frac{1}{3}", "0.333", False),
    ("\\frac{2}{6}", "\\frac{1}{3}", True),
    ("1.001", "1", False),
    ("1", "1.001", False),
    ("1.000", "1", True),
    ("100.5", "100", False),
    ("99.9", "100", False),
    ("100.0", "100", True),
    # percent near misses: 50.1% is neither 0.5 nor 50, 49.9% is not 50%
    ("50.1\\%", "0.5", False),
    ("0.501", "50\\%", False),
    ("49.9\\%", "50\\%", False),
    ("0.5", "50\\%", True),
    ("50.0\\%", "50\\%", True),
]


def test_the_table_is_big_enough():
    assert len(CASES) >= 60
    assert sum(1 for *_, expected in CASES if not expected) >= 20


@pytest.mark.parametrize(("pred", "gold", "expected"), CASES)
def test_is_equivalent(pred, gold, expected):
    assert is_equivalent(pred, gold) is expected


def test_verify_batch_agrees_with_the_table():
    responses = [f"</think> so the result is \\boxed{{{pred}}}." for pred, _, _ in CASES]
    verdicts = verify_batch(responses, [gold for _, gold, _ in CASES], timeout=20)
    assert list(verdicts) == [expected for *_, expected in CASES]
    assert verdicts.timeouts == 0 and verdicts.crashes == 0
    assert verdicts.fast + verdicts.symbolic == len(CASES)
    assert verdicts.symbolic > 0


EXTRACTION = [
    ("\\boxed{42}", "42"),
    ("Thus \\boxed{\\frac{1}{\\sqrt{2}}} is it.", "\\frac{1}{\\sqrt{2}}"),
    ("\\boxed{1} then \\boxed{2}", "2"),  # the last one
    ("\\fbox{7}", "7"),
    ("\\boxed 5$.", "5"),
    ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are content
    ("\\boxed{a^{b^{c}}}", "a^{b^{c}}"),  # nested braces
    ("\\boxed{3} and a truncated \\boxed{4", "3"),  # an unclosed box falls back to the one before
    ("The answer is $\\frac{3}{4}$.", "\\frac{3}{4}"),
    ("Final answer: 17", "17"),
    ("**Answer:** 9", "9"),
    ("no answer here", None),
    ("\\boxed{}", None),
    ("<think>draft \\boxed{1}</think> final \\boxed{2}", "2"),
    ("<think>only a draft \\boxed{1}</think> and nothing boxed after", None),  # only after </think>
    ("</think>\\boxed{5}", "5"),
    # only the first </think> ends the think block: a second one later is part of the answer's text
    ("</think>So \\boxed{3}. </think> and some words", "3"),
]


@pytest.mark.parametrize(("text", "expected"), EXTRACTION)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_the_fast_path_decides_percentages_itself():
    # a percentage is its number or its hundredth: decided without the symbolic path (which agrees, more slowly)
    assert fast_equivalent("50\\%", "0.5") is True and fast_equivalent("50\\%", "50") is True
    assert fast_equivalent("0.5", "50\\%") is True


def test_fast_path_decides_integers_without_symbolic_work():
    assert fast_equivalent("12", "12") is True
    assert fast_equivalent("12", "13") is False
    assert fast_equivalent("\\sqrt{4}", "2") is None  # needs the symbolic path


def test_synthetic_batch_is_fast_and_stays_in_process():
    # 8,192 integer answers (the synthetic task's shape): all decided by the fast path, no worker started
    n = 8192
    responses = [f"{i}+{i}={2 * i}\n</think>\\boxed{{{2 * i}}}" for i in range(n)]
    golds = [str(2 * i + (i % 3 == 0)) for i in range(n)]  # every third one wrong
    verdicts = verify_batch(responses, golds)
    assert list(verdicts) == [i % 3 != 0 for i in range(n)]
    assert verdicts.symbolic == 0 and verdicts.fast == n  # (its speed: benchmarks/verify_speed.py)


ADVERSARIAL = [
    "\\boxed{9^{9^{9^{9}}}}",  # a power tower sympy would try to evaluate
    "\\boxed{" + "{" * 5000 + "1" + "}" * 5000 + "}",  # deep nesting
    "\\boxed{" + "(" * 400 + "1" + ")" * 400 + "}",
    "\\boxed{__import__('os').system('touch /tmp/fasttnt_pwned')}",  # looks like Python
    "\\boxed{eval(\"open('/tmp/fasttnt_pwned','w')\")}",
    "x" * 1_000_000 + "\\boxed{1}",  # a 1 MB response
    "\\boxed{" + "1+" * 200_000 + "1}",  # a 400 KB answer
    "\\boxed{\\frac{1}{0}}",
    "\\boxed{10^{10^{10^{10}}} - 10^{10^{10^{10}}}}",
]


def test_adversarial_inputs_return_within_the_timeout(tmp_path):
    marker = tmp_path / "never"
    responses = [r.replace("/tmp/fasttnt_pwned", str(marker)) for r in ADVERSARIAL]
    with VerifierPool(workers=2, timeout=3.0) as pool:
        verdicts = verify_batch(responses, ["1"] * len(responses), pool=pool)
    assert len(verdicts) == len(ADVERSARIAL)
    assert verdicts[5] is True  # the answer at the end of 1 MB of text is still found
    assert not any(v for i, v in enumerate(verdicts) if i != 5)
    assert not marker.exists(), "model text was executed"
    # returning at all is the point (a hang fails the suite); that the power tower was cut off by the timeout,
    # not finished, is what the counts show (how long it took depends on the machine, so it is not asserted)
    assert verdicts.timeouts >= 1, "the power tower should have hit the timeout and been counted"


def test_pool_survives_a_timeout_and_keeps_working():
    with VerifierPool(workers=1, timeout=2.0) as pool:
        first = verify_batch(["\\boxed{9^{9^{9^{9}}}}", "\\boxed{\\sqrt{4}}"], ["1", "2"], pool=pool)
        assert list(first) == [False, True] and first.timeouts == 1
        second = verify_batch(["\\boxed{\\sqrt{9}}"], ["3"], pool=pool)
        assert list(second) == [True] and second.timeouts == 0


def test_verls_per_response_score_is_bounded_by_the_timeout():
    # verl calls compute_score once per response, in its own process: a power tower the symbolic verifier would chew
    # on for minutes is cut off at the trainer's default timeout and scores 0, and the next answer is judged as usual
    import time

    from fasttnt.integrations.verl import _score_pool, compute_score
    from fasttnt.verify.answers import DEFAULT_TIMEOUT

    # the bound itself, exactly (an elapsed time has no upper bound that holds on a loaded machine)
    assert _score_pool().timeout == DEFAULT_TIMEOUT
    start = time.monotonic()
    assert compute_score("math", "\\boxed{9^{9^{9^{9}}}}", "1") == 0.0
    assert time.monotonic() - start >= DEFAULT_TIMEOUT  # decided by the timeout, not by a fast path
    assert compute_score("math", "\\boxed{\\sqrt{4}}", "2") == 1.0  # symbolic, in the same (restarted) worker
    assert compute_score("math", "</think> \\boxed{7}", 7) == 1.0


def test_long_answers_skip_the_symbolic_parser():
    long = "x+" * MAX_ANSWER_CHARS + "1"
    verdicts = verify_batch([f"\\boxed{{{long}}}"], ["1"])
    assert list(verdicts) == [False] and verdicts.symbolic == 0


def test_mismatched_lengths_are_an_error():
    with pytest.raises(ValueError, match="2 responses but 1 gold"):
        verify_batch(["a", "b"], ["1"])


def test_enormous_numbers_do_not_crash_the_fast_path():
    huge = "7" * 10_000  # int() refuses 4,300+ digits by default
    verdicts = verify_batch([f"\\boxed{{{huge}}}", f"\\boxed{{{huge}}}"], [huge, "7"])
    assert list(verdicts) == [True, False]


def test_a_response_that_never_closes_its_think_block_has_no_answer():
    draft = "let me add 2+2=4 so \\boxed{4}"  # still thinking when the budget ran out
    assert extract_answer(draft) == "4"
    assert extract_answer(draft, require_think_end=True) is None
    assert list(verify_batch([draft, draft + "</think>\\boxed{4}"], ["4", "4"], require_think_end=True)) == [
        False,
        True,
    ]


def test_many_unclosed_boxes_cost_little(monkeypatch):
    # a rescan of the text for each of 20,000 unclosed boxes would be quadratic: count the scans, not the seconds
    import fasttnt.verify.answers as verify

    scans = []
    real = verify._braced
    monkeypatch.setattr(verify, "_braced", lambda text, at: scans.append(at) or real(text, at))
    text = "\\boxed{" * 20_000 + "\\boxed{3}"
    assert extract_answer(text) == "3"
    assert len(scans) <= verify._MAX_BOX_CANDIDATES


def test_a_worker_that_died_while_idle_is_replaced():
    with VerifierPool(workers=1, timeout=5.0) as pool:
        assert list(verify_batch(["\\boxed{\\sqrt{4}}"], ["2"], pool=pool)) == [True]
        worker = pool._workers[0].process
        worker.kill()
        worker.join()
        assert list(verify_batch(["\\boxed{\\sqrt{9}}"], ["3"], pool=pool)) == [True]
        processes = [w.process for w in pool._workers]
    assert not any(p.is_alive() for p in processes), "close() left a worker running"


UNGUARDED = """
from fasttnt.verify import verify_batch

# no `if __name__ == "__main__":` guard, as many reward scripts are written
verdicts = verify_batch(["\\\\boxed{\\\\sqrt{4}}", "\\\\boxed{\\\\frac{6}{3}}", "\\\\boxed{\\\\sqrt{9}}"] * 4,
                        ["2", "2", "3"] * 4, workers=2, timeout=30)
print("verdicts", list(verdicts), verdicts.crashes)
"""


def test_an_unguarded_script_gets_right_verdicts_or_a_clear_error(tmp_path):
    # the workers re-import the script they were started from: without the guard they die as they start. Every
    # answer here is right, so a silent wrong verdict would show as a False
    script = tmp_path / "reward.py"
    script.write_text(UNGUARDED)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    if result.returncode == 0:
        assert "verdicts [True, True, True, True, True, True, True, True, True, True, True, True] 0" in result.stdout
    else:
        assert "verification workers die as they start" in result.stderr
        assert 'if __name__ == "__main__":' in result.stderr
        assert "verdicts" not in result.stdout


def test_a_guarded_script_works(tmp_path):
    script = tmp_path / "reward.py"
    body = "\n".join("    " + line for line in UNGUARDED.strip().splitlines()[1:])
    script.write_text(f"from fasttnt.verify import verify_batch\n\nif __name__ == '__main__':\n{body}\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "verdicts [True, True, True, True, True, True, True, True, True, True, True, True] 0" in result.stdout


def test_workers_outlive_a_sigterm_to_the_whole_job():
    # scancel and Ctrl-C signal every process of a job; the trainer finishes its step, so its workers must too
    import os
    import signal

    with VerifierPool(workers=1, timeout=10.0) as pool:
        assert list(verify_batch(["\\boxed{\\sqrt{4}}"], ["2"], pool=pool)) == [True]
        worker = pool._workers[0].process
        for sig in (signal.SIGTERM, signal.SIGINT):
            os.kill(worker.pid, sig)
        verdicts = verify_batch(["\\boxed{\\sqrt{9}}"], ["3"], pool=pool)
        assert list(verdicts) == [True] and verdicts.crashes == 0
        assert pool._workers[0].process is worker and worker.is_alive()
    assert not worker.is_alive()


def test_a_slow_worker_start_is_not_an_answers_timeout():
    # the item's clock starts when its worker has started (math-verify's import takes ~1-2 s here): with a 0.3 s
    # timeout, a fresh pool still judges a quick item, rather than count its worker's start as the item's timeout
    with VerifierPool(workers=1, timeout=0.3) as pool:
        verdicts = verify_batch(["\\boxed{\\sqrt{4}}"], ["2"], pool=pool)
    assert list(verdicts) == [True] and verdicts.timeouts == 0


def _crashing_pool(monkeypatch, workers: int = 1) -> VerifierPool:
    """A real pool whose workers die (os._exit) on the answer "crash": forked, so they run the patched judge."""
    import multiprocessing
    import os

    import fasttnt.verify.pool as verify

    real = verify.is_equivalent
    monkeypatch.setattr(
        verify, "is_equivalent", lambda pred, gold: os._exit(1) if pred == "crash" else real(pred, gold)
    )
    pool = VerifierPool(workers=workers, timeout=30)
    pool._ctx = multiprocessing.get_context("fork")
    return pool


def test_a_worker_that_dies_on_an_item_counts_it_as_a_crash(monkeypatch):
    with _crashing_pool(monkeypatch) as pool:
        verdicts = verify_batch(
            ["\\boxed{\\sqrt{4}}", "\\boxed{crash}", "\\boxed{\\sqrt{9}}"], ["2", "2", "3"], pool=pool
        )
    assert list(verdicts) == [True, False, True] and verdicts.crashes == 1 and verdicts.timeouts == 0


def _wait_for(condition, seconds: float, what: str):
    """Poll ``condition`` until it returns something true (returned) or ``seconds`` pass (an error naming ``what``)."""
    deadline = time.monotonic() + seconds
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {seconds:.0f} s")
        time.sleep(0.1)


def _process_table() -> dict[int, tuple[str, int, int, int]]:
    """pid -> (state, parent pid, CPU clock ticks, start time) of every process, from /proc/<pid>/stat."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:  # it ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after the command's name, which may hold spaces and ")"
        state, ppid, utime, stime, start = fields[0], int(fields[1]), int(fields[11]), int(fields[12]), int(fields[19])
        table[int(entry)] = (state, ppid, utime + stime, start)
    return table


def _descendants(pid: int, table: dict[int, tuple[str, int, int, int]]) -> set[int]:
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, (_, ppid, _, _) in table.items() if ppid in frontier} - found
        found |= frontier
    return found


def _still_running(processes: dict[int, int]) -> list[int]:
    """Which of ``processes`` (pid -> start time) still run: a zombie has ended, and a reused pid is another's."""
    table = _process_table()
    running = []
    for pid, start in processes.items():
        state, _, _, started = table.get(pid, ("X", 0, 0, start))
        if started == start and state not in "ZX":
            running.append(pid)
    return running


def _command(pid: int) -> str:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline") as f:
        return f.read().replace("\0", " ")[:150]
    return "(ended)"


KILLED_TRAINER = """
import pathlib
import sys

from fasttnt.verify import VerifierPool, verify_batch

if __name__ == "__main__":
    # a timeout (and so a CPU limit) far longer than the test waits: only the trainer's death can end the worker
    pool = VerifierPool(workers=1, timeout=600.0)
    assert list(verify_batch(["\\\\boxed{\\\\sqrt{4}}"], ["2"], pool=pool)) == [True]
    pathlib.Path(sys.argv[1]).write_text("judging")
    verify_batch(["\\\\boxed{9^{9^{9^{9}}}}"], ["1"], pool=pool)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process tree from /proc")
def test_no_process_outlives_a_trainer_killed_mid_item(tmp_path):
    # kill -9 of the trainer runs none of its clean-up: its workers, forkserver and resource tracker must end by
    # themselves, the worker even while a power tower holds it in one long C call (SIGTERM it ignores)
    script, marker = tmp_path / "trainer.py", tmp_path / "judging"
    script.write_text(KILLED_TRAINER)
    trainer = subprocess.Popen([sys.executable, str(script), str(marker)], cwd=tmp_path, stderr=subprocess.PIPE)
    processes: dict[int, int] = {}
    try:
        _wait_for(lambda: marker.exists() or trainer.poll() is not None, 300, "the trainer's first verdict")
        assert trainer.poll() is None, trainer.stderr.read().decode()[-2000:]

        def busy_worker():
            table = _process_table()
            # the worker is a grandchild of the trainer (a child of the forkserver)
            workers = [pid for pid in _descendants(trainer.pid, table) if table[pid][1] != trainer.pid]
            return workers and table

        table = _wait_for(busy_worker, 60, "the verification worker")
        processes = {pid: table[pid][3] for pid in _descendants(trainer.pid, table)}
        (worker,) = (pid for pid in processes if table[pid][1] != trainer.pid)
        ticks = table[worker][2]
        enough = os.sysconf("SC_CLK_TCK") // 2  # half a second of CPU: it is working on the power tower

        def working():  # a worker that ended shows no more CPU time: the wait fails, naming what it waited for
            return _process_table().get(worker, ("X", 0, ticks, 0))[2] - ticks >= enough

        _wait_for(working, 120, "the worker's work on the item")
        assert len(processes) >= 2, processes  # the worker and the forkserver at least

        trainer.kill()
        trainer.wait()
        with contextlib.suppress(AssertionError):
            _wait_for(lambda: not _still_running(processes), 30, "the trainer's processes to end")
        survivors = [f"{pid}: {_command(pid)}" for pid in _still_running(processes)]
        assert not survivors, f"still running after the trainer's death: {survivors}"
    finally:
        trainer.kill()
        trainer.wait()
        for pid in _still_running(processes):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not hasattr(signal, "SIGXCPU"), reason="no CPU limit (RLIMIT_CPU) on this platform")
def test_the_cpu_limit_ends_an_item_without_the_pools_timeout():
    # a CPU limit of 3-4 s (room for the first LaTeX parse on a busy machine) and a pool's timeout of 60 s: the
    # kernel ends the worker at its CPU limit, the pool counts the item as a timeout (not a crash, which can stop a
    # run) and judges the next item in a new worker
    with VerifierPool(workers=1, timeout=60.0) as pool:
        pool.cpu_seconds = 3
        assert list(verify_batch(["\\boxed{\\sqrt{4}}"], ["2"], pool=pool)) == [True]
        worker = pool._workers[0].process
        assert worker.is_alive()
        verdicts = verify_batch(["\\boxed{9^{9^{9^{9}}}}", "\\boxed{\\sqrt{9}}"], ["1", "3"], pool=pool)
        assert worker.exitcode == -signal.SIGXCPU
        assert list(verdicts) == [False, True]
        assert verdicts.timeouts == 1 and verdicts.crashes == 0
        assert pool._workers[0].process is not worker and pool._workers[0].process.is_alive()


WATCHED = """
import pathlib
import sys

from fasttnt.verify.pool import _exit_with_trainer

_exit_with_trainer(int(sys.argv[1]))
pathlib.Path(sys.argv[2]).write_text("watching")
while True:  # Python code that never ends by itself, as a slow symbolic simplification
    pass
"""


def test_the_watchdog_ends_a_busy_worker_whose_trainer_is_gone(tmp_path):
    # the watchdog thread needs no prctl and no forkserver: it covers other platforms and a forkserver kept up by
    # other processes, for a worker running Python code
    marker = tmp_path / "watching"
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    worker = subprocess.Popen([sys.executable, "-c", WATCHED, str(trainer.pid), str(marker)], cwd=tmp_path)
    try:
        _wait_for(lambda: marker.exists() or worker.poll() is not None, 120, "the watchdog's start")
        assert worker.poll() is None
        trainer.kill()
        trainer.wait()  # reaped: its pid is gone
        assert worker.wait(timeout=30) == 1
    finally:
        for process in (trainer, worker):
            process.kill()
            process.wait()
