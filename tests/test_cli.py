"""The `pdserve` command line on the real default model, as a user runs it."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def pdserve(*args, stdin=None, timeout=180):
    return pdserve_at_once((args, stdin), timeout=timeout)[0]


def pdserve_at_once(*runs, timeout=180) -> list[subprocess.CompletedProcess]:
    """Each run, (args, stdin), as its own `pdserve` process, all started at once (their start-ups,
    mostly imports on one core, overlap); their results in order."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, "-m", "pdserve", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for args, _ in runs]
    out = []
    try:
        for p, (args, stdin) in zip(procs, runs):
            stdout, stderr = p.communicate(stdin, timeout=timeout)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def test_generate_prints_only_the_text(smollm):
    r = pdserve("generate", "What is the capital of France?", "--chat", "--max-tokens", "24",
                "--kv-cache-memory", "64MiB")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "The capital of France is Paris."
    assert r.stdout.count("\n") == 1  # no logs on stdout


def test_generate_seeded_sampling_is_reproducible(smollm):
    args = ("generate", "Once upon a time", "--max-tokens", "16", "--temperature", "0.9", "--seed", "7",
            "--kv-cache-memory", "64MiB")
    a, b = pdserve_at_once((args, None), (args, None))
    assert a.returncode == 0 and a.stdout == b.stdout and a.stdout.strip()


def test_bad_arguments_fail_with_a_message(smollm):
    tokens, memory, model = pdserve_at_once(
        (("generate", "hi", "--max-tokens", "0", "--kv-cache-memory", "64MiB"), None),
        (("generate", "hi", "--kv-cache-memory", "lots"), None),
        (("generate", "hi", "--model", "/nonexistent.gguf"), None))
    assert tokens.returncode == 2 and "max_tokens" in tokens.stderr and tokens.stdout == ""
    assert memory.returncode == 2 and "memory size" in memory.stderr
    assert model.returncode == 2 and "does not exist" in model.stderr


def test_interactive_chat_keeps_history_until_reset(smollm):
    q1, q2 = "My name is Ada and I love astronomy.", "What should I read next?"
    args = ("chat", "--max-tokens", "24", "--kv-cache-memory", "64MiB")
    # a fresh session asked q2; one asked q1, then q2 with q1 in its history, then /reset and q2 again
    runs = pdserve_at_once((args, q2 + "\n"), (args, f"{q1}\n{q2}\n/reset\n{q2}\n"))
    for r in runs:
        assert r.returncode == 0, r.stderr  # EOF ends the session cleanly
    fresh, session = (r.stdout for r in runs)
    assert fresh.strip()
    # greedy replies: after /reset the answer to q2 is the fresh one; with history it is not
    assert session.endswith(fresh) and len(session) > len(fresh)
    with_history = session[:-len(fresh)]  # the replies to q1 and to q2 after it, before the reset
    assert not with_history.endswith(fresh)
