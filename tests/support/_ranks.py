"""The ranks of one multi-process program, started as a user starts them: a free loopback
port for their coordinator, and every rank run at once to its end."""

import socket
import subprocess


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_together(commands: list, *, cwd=None, env=None, timeout: float = 600) -> list:
    """Start ``commands`` at once (the ranks of one program), wait for all; their outputs
    (stdout and stderr). Each must exit 0; any left running at the end is killed."""
    procs = [
        subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for cmd in commands
    ]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-6000:]
    return outs
