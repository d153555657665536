"""DeepMind Reverb as a peer of ``benchmarks/ray_service.py``, run in Reverb's own venv.

Reverb (dm-reverb 0.14.0, tensorflow-cpu 2.15, NumPy < 2) cannot share the project's venv,
so ``ray_service.py --reverb-python PATH`` starts this file under that venv's python, once,
with the job's parameters, and drives it over stdin and stdout, one line each way:

  peer -> driver   {"event": "ready", ...}            once the server and writers are warm
  driver -> peer   round                              run one round; the peer answers with
  peer -> driver   {"event": "round", "row": {...}}   the round's row (see ``_round``)
  driver -> peer   quit                               stop the writers and the server

Anything else the peer prints (TensorFlow's and Reverb's logs) goes to stderr. The peer is
built once, like the Ray peers, so its rounds interleave with theirs.

The server: one table, ``Uniform`` sampler, ``Fifo`` remover, ``MinSize(1)`` rate limiter,
``max_size`` = every item of a round, a signature for the item. Reverb's gRPC server listens
on ``[::]:port`` (its C++ server takes no host), so the driver starts this process in a
network namespace of its own (``unshare --net``) holding only the loopback device: the
clients dial 127.0.0.1, and nothing else can reach the port.

A round, each phase timed on its own (items per second):
  insert     ``--writers`` writer processes each append ``--items`` steps through
             ``client.trajectory_writer``, one item per step, and after every ``--chunk``
             steps wait until at most ``--chunk`` items are unconfirmed (``flush(
             block_until_num_items=chunk)``: Reverb warns of unbounded pending items
             otherwise); the clock runs from the start signal to the last writer's flush.
  sample     ``--sample-batches`` batches of ``--batch`` from the filled table, through
             ``TrajectoryDataset`` (``--in-flight`` samples in flight per worker, the clock
             starts after its first batch) and through plain ``client.sample``.
  both       the table emptied, the writers insert again while the driver samples through
             ``TrajectoryDataset`` until the last writer is done (at most ``--both-rate``
             items a second, when given: :func:`pace`).
After each of ``insert`` and ``both`` the table is read back (sampled and each item deleted
until it is empty, outside the clock) to check that every item was stored exactly once.

This module's top level needs only the standard library, so that ``ray_service.py`` and
the tests import ``exactly_once`` and ``parse_args`` from it without Reverb.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

TABLE = "items"
HOST = "127.0.0.1"  # loopback only: every client dials this address
KEYS = ("obs", "reward", "w", "seq")
DTYPES = ("float32", "uint8")


def obs_shape(text: str) -> tuple[int, ...]:
    """``"84,84"`` -> ``(84, 84)``; every dimension a positive integer."""
    try:
        shape = tuple(int(d) for d in text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise argparse.ArgumentTypeError(
            f"--obs-shape: expected positive integers separated by commas (e.g. 84,84), "
            f"got {text!r}"
        )
    return shape


def job_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The job's parameters, the same on every peer (``ray_service.py`` adds its own)."""
    p = p or argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--writers", type=int, default=4)
    p.add_argument("--items", type=int, default=4096, help="items per writer per round")
    p.add_argument("--chunk", type=int, default=64, help="items per extend (Ray peers)")
    p.add_argument("--batch", type=int, default=256, help="learner's sample size")
    p.add_argument("--obs-dim", type=int, default=64, help="obs f32[obs-dim]")
    p.add_argument(
        "--obs-shape",
        type=obs_shape,
        default=None,
        help="obs of this shape instead (e.g. 84,84), uint8 unless --obs-dtype",
    )
    p.add_argument("--obs-dtype", choices=DTYPES, default=None)
    p.add_argument("--sample-batches", type=int, default=64, help="batches per sample phase")
    p.add_argument(
        "--in-flight",
        type=int,
        default=None,
        help="Reverb TrajectoryDataset's max_in_flight_samples_per_worker (default --batch)",
    )
    p.add_argument(
        "--both-rate",
        type=float,
        default=0.0,
        help="in 'both', the learner samples at most this many items a second (0: as fast as "
        "it can): every peer's writers then insert beside the same sampling",
    )
    return p


def pace(start: float, sampled: int, rate: float) -> float:
    """Seconds the learner waits before its next batch so that, ``sampled`` items after
    ``start`` (``time.perf_counter()``), it has drawn at most ``rate`` items a second; 0 when
    it may draw now or when ``rate`` is 0 (no limit).

    >>> pace(0.0, 10, 0.0)
    0.0
    >>> pace(time.perf_counter(), 1000, 100.0) > 9
    True
    """
    if rate <= 0:
        return 0.0
    return max(0.0, start + sampled / rate - time.perf_counter())


def finish_job_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on other arguments, and refuse impossible jobs."""
    for name in ("writers", "items", "chunk", "batch", "obs_dim", "sample_batches"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.both_rate >= 0:
        p.error(f"--both-rate must be >= 0 (0: no limit), got {args.both_rate}")
    if args.items % args.chunk:
        p.error(f"--items ({args.items}) must be a multiple of --chunk ({args.chunk})")
    if args.obs_shape is None:
        args.obs_shape = (args.obs_dim,)
        args.obs_dtype = args.obs_dtype or "float32"
    else:
        args.obs_dtype = args.obs_dtype or "uint8"
    args.in_flight = args.in_flight or args.batch
    return args


def parse_args(argv=None) -> argparse.Namespace:
    p = job_parser()
    return finish_job_args(p, p.parse_args(argv))


def job_argv(args: argparse.Namespace) -> list[str]:
    """The command line that gives this peer the same job as ``args``."""
    return [
        f"--writers={args.writers}",
        f"--items={args.items}",
        f"--chunk={args.chunk}",
        f"--batch={args.batch}",
        f"--obs-shape={','.join(map(str, args.obs_shape))}",
        f"--obs-dtype={args.obs_dtype}",
        f"--sample-batches={args.sample_batches}",
        f"--in-flight={args.in_flight}",
        f"--both-rate={args.both_rate}",
    ]


def exactly_once(pairs, writers: int, items: int) -> dict:
    """Whether the stored (writer id, sequence number) ``pairs`` are every item of a round,
    each once: ``{"ok", "stored", "missing", "duplicates"}``.

    >>> exactly_once([(0, 0), (0, 1), (1, 0), (1, 1)], 2, 2)["ok"]
    True
    >>> exactly_once([(0, 0), (0, 0), (1, 0), (1, 1)], 2, 2)
    {'ok': False, 'stored': 4, 'missing': 1, 'duplicates': 1}
    """
    counts: dict = {}
    for w, s in pairs:
        counts[(int(w), int(s))] = counts.get((int(w), int(s)), 0) + 1
    expected = {(w, s) for w in range(writers) for s in range(items)}
    missing = len(expected - counts.keys())
    duplicates = sum(c - 1 for c in counts.values()) + len(counts.keys() - expected)
    return {
        "ok": missing == 0 and duplicates == 0,
        "stored": len(pairs),
        "missing": missing,
        "duplicates": duplicates,
    }


# ---------------------------------------------------------------- under Reverb's venv
def numpy_items(np, w, start, n, shape, dtype):
    """``n`` items of writer ``w`` from sequence number ``start`` (``np``: the caller's NumPy,
    this venv's or the driver's): the same item on every peer."""
    if dtype == "uint8":
        obs = np.random.randint(0, 256, (n, *shape), dtype=np.uint8)
    else:
        obs = np.random.randn(n, *shape).astype(np.float32)
    return {
        "obs": obs,
        "reward": np.random.randn(n).astype(np.float32),
        "w": np.full(n, w, np.int64),
        "seq": np.arange(start, start + n, dtype=np.int64),
    }


def _writer(address, w, shape, dtype, pipe):
    """A writer process: on ("run", n, chunk) append n steps, one item each, then answer."""
    import numpy as np
    import reverb

    client = reverb.Client(address)
    while True:
        msg = pipe.recv()
        if msg == "quit":
            return
        _, n, chunk = msg
        with client.trajectory_writer(num_keep_alive_refs=1) as writer:
            for start in range(0, n, chunk):
                data = numpy_items(np, w, start, chunk, shape, dtype)
                for i in range(chunk):
                    writer.append({k: data[k][i] for k in KEYS})
                    writer.create_item(TABLE, 1.0, {k: writer.history[k][-1] for k in KEYS})
                writer.flush(block_until_num_items=chunk)  # at most a chunk unconfirmed
            writer.flush()
        pipe.send(n)


class Peer:
    """The server, its writers and the driver's client, built once."""

    def __init__(self, args):
        import multiprocessing as mp

        import numpy as np
        import reverb
        import tensorflow as tf

        self.args, self.np, self.reverb = args, np, reverb
        total = args.writers * args.items
        signature = {
            "obs": tf.TensorSpec(args.obs_shape, getattr(tf, args.obs_dtype)),
            "reward": tf.TensorSpec([], tf.float32),
            "w": tf.TensorSpec([], tf.int64),
            "seq": tf.TensorSpec([], tf.int64),
        }
        table = reverb.Table(
            name=TABLE,
            sampler=reverb.selectors.Uniform(),
            remover=reverb.selectors.Fifo(),
            max_size=total,
            rate_limiter=reverb.rate_limiters.MinSize(1),
            signature=signature,
        )
        self.server = reverb.Server(tables=[table])
        self.address = f"{HOST}:{self.server.port}"
        self.client = reverb.Client(self.address)
        self.dataset = reverb.TrajectoryDataset.from_table_signature(
            self.address, TABLE, max_in_flight_samples_per_worker=args.in_flight
        ).batch(args.batch)
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for w in range(args.writers):
            here, there = ctx.Pipe()
            proc = ctx.Process(
                target=_writer, args=(self.address, w, args.obs_shape, args.obs_dtype, there)
            )
            proc.start()
            self.pipes.append(here)
            self.procs.append(proc)
        self._insert(args.chunk)  # warm-up: every writer connected and one flush done
        next(iter(self.dataset))
        list(self.client.sample(TABLE, 1, emit_timesteps=False))
        self.client.reset(TABLE)

    def _insert(self, n):
        for pipe in self.pipes:
            pipe.send(("run", n, self.args.chunk))
        return [pipe.recv() for pipe in self.pipes]

    def size(self) -> int:
        return self.client.server_info()[TABLE].current_size

    def read_back(self) -> dict:
        """Sample every stored item and delete it, until the table is empty (outside the
        clock): the (writer, sequence) pairs by item key, checked with ``exactly_once``."""
        seen: dict = {}
        size = self.size()
        while size:
            got = self.client.sample(
                TABLE, min(size, 4096), emit_timesteps=False, unpack_as_table_signature=True
            )
            new = {}
            for s in got:
                if s.info.key not in seen:
                    new[s.info.key] = (int(s.data["w"]), int(s.data["seq"]))
            seen.update(new)
            self.client.mutate_priorities(TABLE, deletes=list(new))
            size = self.size()
        a = self.args
        return exactly_once(list(seen.values()), a.writers, a.items)

    def round(self) -> dict:
        a, total = self.args, self.args.writers * self.args.items
        self.client.reset(TABLE)
        start = time.perf_counter()
        self._insert(a.items)
        inserted = total / (time.perf_counter() - start)
        size_after_insert = self.size()

        sampled = {}
        it = self.dataset.as_numpy_iterator()
        next(it)  # (the stream is open and its first samples are in)
        start = time.perf_counter()
        for _ in range(a.sample_batches):
            next(it)
        sampled["TrajectoryDataset"] = a.sample_batches * a.batch / (time.perf_counter() - start)
        del it
        start = time.perf_counter()
        for _ in range(a.sample_batches):
            list(self.client.sample(TABLE, a.batch, emit_timesteps=False))
        sampled["client.sample"] = a.sample_batches * a.batch / (time.perf_counter() - start)
        check_insert = self.read_back()

        self.client.reset(TABLE)
        it = self.dataset.as_numpy_iterator()
        start = time.perf_counter()
        for pipe in self.pipes:
            pipe.send(("run", a.items, a.chunk))
        both_sampled, done, ready = 0, 0, False
        while done < len(self.pipes):
            ready = ready or self.size() >= a.batch  # (no item leaves the table in a round)
            wait = pace(start, both_sampled, a.both_rate) if ready else 0.0
            if wait > 0:
                time.sleep(min(wait, 0.002))  # (short: the writers' end is polled below)
            elif ready:
                next(it)
                both_sampled += a.batch
            done = sum(pipe.poll() for pipe in self.pipes)
        for pipe in self.pipes:
            pipe.recv()
        elapsed = time.perf_counter() - start
        del it
        check_both = self.read_back()
        return {
            "inserted": inserted,
            "sampled": sampled,
            "both_inserted": total / elapsed,
            "both_sampled": both_sampled / elapsed,
            "both_path": "TrajectoryDataset",
            "exactly_once": check_insert["ok"] and check_both["ok"],
            "checks": {"insert": check_insert, "both": check_both},
            "size_after_insert": size_after_insert,
        }

    def close(self):
        for pipe in self.pipes:
            pipe.send("quit")
        for proc in self.procs:
            proc.join(timeout=30)
        self.server.stop()


def _say(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    from importlib.metadata import version

    peer = Peer(args)
    _say(
        "ready",
        address=peer.address,
        versions={n: version(n) for n in ("dm-reverb", "tensorflow-cpu", "numpy")},
        python=sys.version.split()[0],
        pid=os.getpid(),
    )
    for line in sys.stdin:
        if line.strip() == "round":
            _say("round", row=peer.round())
        elif line.strip() == "quit":
            break
    peer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
