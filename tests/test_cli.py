"""The `pdserve` command line on the real default model, as a user runs it."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def pdserve(*args, stdin=None, timeout=180):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "pdserve", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_generate_prints_only_the_text(smollm):
    r = pdserve("generate", "What is the capital of France?", "--chat", "--max-tokens", "24",
                "--kv-cache-memory", "64MiB")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "The capital of France is Paris."
    assert r.stdout.count("\n") == 1  # no logs on stdout


def test_generate_seeded_sampling_is_reproducible(smollm):
    args = ("generate", "Once upon a time", "--max-tokens", "16", "--temperature", "0.9", "--seed", "7",
            "--kv-cache-memory", "64MiB")
    a, b = pdserve(*args), pdserve(*args)
    assert a.returncode == 0 and a.stdout == b.stdout and a.stdout.strip()


def test_bad_arguments_fail_with_a_message(smollm):
    r = pdserve("generate", "hi", "--max-tokens", "0", "--kv-cache-memory", "64MiB")
    assert r.returncode == 2 and "max_tokens" in r.stderr and r.stdout == ""
    r = pdserve("generate", "hi", "--kv-cache-memory", "lots")
    assert r.returncode == 2 and "memory size" in r.stderr
    r = pdserve("generate", "hi", "--model", "/nonexistent.gguf")
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_interactive_chat_keeps_history_until_reset(smollm):
    def chat(stdin):
        r = pdserve("chat", "--max-tokens", "24", "--kv-cache-memory", "64MiB", stdin=stdin)
        assert r.returncode == 0, r.stderr  # EOF ends the session cleanly
        return r.stdout

    q1, q2 = "My name is Ada and I love astronomy.", "What should I read next?"
    fresh = chat(q2 + "\n")
    # one session: q1, then q2 with q1 in its history, then /reset and q2 again
    session = chat(f"{q1}\n{q2}\n/reset\n{q2}\n")
    assert fresh.strip()
    # greedy replies: after /reset the answer to q2 is the fresh one; with history it is not
    assert session.endswith(fresh) and len(session) > len(fresh)
    with_history = session[:-len(fresh)]  # the replies to q1 and to q2 after it, before the reset
    assert not with_history.endswith(fresh)
