"""The engine leaves when its parent is killed, even after the parent forked a child that
holds the engine's stdin pipe."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

PARENT = textwrap.dedent('''
    import os, sys, threading, time
    from schedkit.config import Config
    from schedkit.llm import LLM
    from schedkit.core.request import SamplingParams

    box = {}
    if sys.argv[1] == "worker-thread":  # no parent-death signal: the pid check must do it
        t = threading.Thread(target=lambda: box.update(llm=LLM(Config())))
        t.start()
        t.join()  # the spawning thread has exited; the engine must stay
    else:
        box["llm"] = LLM(Config())
    llm = box["llm"]
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
    child = os.fork()
    if child == 0:  # inherits the engine's stdin pipe
        time.sleep(60)
        os._exit(0)
    print(llm.engine.pid, child, flush=True)
    time.sleep(60)
''')


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" in f.read().lower()
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("spawned_from", ["main-thread", "worker-thread"])
def test_engine_exits_when_a_forking_parent_is_killed(tmp_path, spawned_from):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script), spawned_from], stdout=subprocess.PIPE,
                              text=True)
    engine_pid = child_pid = None
    try:
        engine_pid, child_pid = map(int, parent.stdout.readline().split())
        assert not _gone(engine_pid)
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not _gone(engine_pid):
            time.sleep(0.05)
        assert _gone(engine_pid), "the engine outlived its killed parent"
        assert not _gone(child_pid), "the forked child must still be running"
    finally:
        parent.kill()
        for pid in (child_pid, engine_pid):
            if pid is not None and not _gone(pid):
                os.kill(pid, signal.SIGKILL)
