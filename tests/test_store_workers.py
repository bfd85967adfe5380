"""Stopping build_store_parallel (SIGTERM, as kill or pkill send) stops its worker processes."""

import os
import signal
import subprocess
import sys
import textwrap
import time

PARENT = textwrap.dedent("""
    import sys
    from mlx_dflash.train import store

    pid_dir = sys.argv[1]
    # Workers that only write their pid and sleep, in place of the generation workers.
    store._worker_command = lambda job, w, n: [sys.executable, "-c",
        f"import os, time; open('{pid_dir}/pid{w}', 'w').write(str(os.getpid())); time.sleep(60)"]
    store.build_store_parallel("unused-model", [], pid_dir + "/store", [1], workers=2)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = f"/proc/{pid}/stat"  # Linux: a zombie (exited, not yet reaped) counts as stopped
    if not os.path.exists(stat):
        return True
    with open(stat) as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_sigterm_stops_the_workers(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)])
    pid_files = [tmp_path / f"pid{w}" for w in range(2)]
    deadline = time.time() + 60
    while not all(f.exists() and f.read_text() for f in pid_files):
        assert time.time() < deadline and parent.poll() is None, "workers did not start"
        time.sleep(0.1)
    pids = [int(f.read_text()) for f in pid_files]
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=30) == 128 + signal.SIGTERM
    time.sleep(0.5)
    assert not any(_alive(p) for p in pids)
