"""SB3's ``[buffer_size, n_envs]`` grid as a core buffer: one step in, rows out.

Stable-Baselines3 keeps each field as a NumPy array ``[buffer_size, n_envs, ...]`` written one
step (all envs) at a time at ``pos``. Here the same data lives in one core
:class:`functional_rb.ReplayBuffer` with ``ndim=2``: rows are envs, time is the ring of
``buffer_size`` slots, and its :class:`~functional_rb.RoundRobinWriter` is the ring SB3's
``pos`` and ``full`` describe (``pos`` = its cursor, ``full`` = every slot written). Reads
are the core's gathers at flat positions ``env * buffer_size + t``.

JAX stores 32-bit numbers (x64 off). Leaves of 8-byte dtypes (SB3's ``int64`` discrete actions,
``float64`` observations) are stored bit for bit as two ``uint32`` words and viewed back on
the host, so every dtype SB3 accepts comes back as it went in.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import functional_rb as frb
from functional_rb.protocol import WriteRecord
from functional_rb.storages.device import PackedStorage
from functional_rb.storages.host import HostStorage
from functional_rb.writers import RoundRobinState

PyTree = Any


def _wide(dtype: np.dtype) -> bool:
    return np.dtype(dtype).itemsize == 8


def encode(tree: PyTree) -> PyTree:
    """8-byte leaves as ``uint32[..., 2]`` views (bit-exact); the others unchanged."""

    def one(x):
        x = np.ascontiguousarray(x)
        return x.view(np.uint32).reshape(*x.shape, 2) if _wide(x.dtype) else x

    return jax.tree_util.tree_map(one, tree)


def _decode_leaf(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return np.ascontiguousarray(x).view(dtype)[..., 0]


def decode(tree: PyTree, dtypes: PyTree) -> PyTree:
    """The inverse of :func:`encode` on NumPy arrays read back from the device."""

    def one(x, dtype):
        x = np.asarray(x)
        return _decode_leaf(x, dtype) if _wide(dtype) else x

    return jax.tree_util.tree_map(one, tree, dtypes)


def decode_on_device(tree: PyTree, dtypes: PyTree) -> PyTree:
    """:func:`decode` for JAX arrays, kept on their device: 8-byte integers become their
    32-bit JAX dtype (the low word: exact below 2**31), 8-byte floats go through the host
    (JAX holds no float64 without x64)."""

    def one(x, dtype):
        if not _wide(dtype):
            return x
        if np.dtype(dtype).kind in "iu":
            return jax.lax.bitcast_convert_type(x[..., 0], jnp.dtype(dtype.kind + "4"))
        return jnp.asarray(decode(jax.device_get(x), dtype))

    return jax.tree_util.tree_map(one, tree, dtypes)


# Compiled once per core buffer configuration (ReplayBuffer is frozen and hashable: equal
# buffers share these), not once per Grid.
def _select(data, fields):
    return data if fields is None else {k: data[k] for k in fields}


@functools.partial(jax.jit, static_argnums=(0, 1))
def _gather(rb, fields, state, idx):
    return _select(rb.get(state, idx), fields)


# The sampler's draw and update as one compiled call each, the state donated: the core's
# eager calls check their arguments on the host first (~50 us a call), which here the
# callers' own checks make redundant.
@functools.partial(jax.jit, static_argnums=(0, 1), donate_argnums=2)
def _draw(rb, batch_size, state, seed, options):
    sample, state = rb.sample(state, jax.random.key(seed), batch_size=batch_size, **options)
    return (sample.indices, sample.weights, sample.data), state


@functools.partial(jax.jit, static_argnums=0, donate_argnums=1)
def _update(rb, state, idx, priorities):
    return rb.update(state, idx, priorities)


class Grid:
    """The core buffer holding SB3's fields; ``example`` is one step (leaves ``[n_envs, ...]``).

    ``storage`` and ``sampler`` are core components (default: :class:`frb.DeviceStorage` and
    :class:`frb.RandomSampler`). The host mirrors ``pos`` and ``full`` are what SB3 users read
    and set; :meth:`sync` writes a changed pair into the core writer before the next call.

    With a :class:`~functional_rb.storages.HostStorage` the rows are NumPy arrays: a step is
    written into them as it is added (one NumPy assignment per leaf, SB3's own cost) and rows
    are gathered from them, with no compiled call; the core writer's counters follow at the
    next call that uses the core (:meth:`flush`).
    """

    STAGE = 256  # steps staged on the host between writes to the core

    def __init__(
        self, example: PyTree, buffer_size: int, n_envs: int, *, storage=None, sampler=None
    ):
        self.buffer_size = buffer_size
        self.n_envs = n_envs
        self.dtypes = jax.tree_util.tree_map(lambda x: np.asarray(x).dtype, example)
        leaves, self._treedef = jax.tree_util.tree_flatten(example)
        self.leaf_shapes = [np.shape(x) for x in leaves]  # in the item's leaf order
        self.leaf_dtypes = [np.asarray(x).dtype for x in leaves]
        self._wide_leaves = [i for i, d in enumerate(self.leaf_dtypes) if _wide(d)]
        self.rb = frb.ReplayBuffer(
            capacity=buffer_size * n_envs,
            ndim=2,
            batch_size=1,
            # the default DeviceStorage() (a DeviceStorage whose __new__ picks the layout)
            storage=storage if storage is not None else PackedStorage(),
            sampler=sampler if sampler is not None else frb.RandomSampler(),
        )
        self.state = self.rb.init(encode(example))
        # rows read on the host (NumPy, no compiled call): a storage with read_host on CPU
        self.host_reads = hasattr(self.rb.storage, "read_host") and all(
            d.platform == "cpu"
            for leaf in jax.tree_util.tree_leaves(self.state.storage)
            for d in leaf.devices()
        )
        self._writes: dict = {}
        self._synced = (0, False)
        # steps added one at a time wait here (leaves [STAGE, n_envs, ...]) and go to the core
        # when STAGE are waiting or a read needs them (reads of NumPy rows take them from
        # here): one compiled call per step would cost more than SB3's whole add
        self._stage_leaves = [
            np.zeros((self.STAGE, *shape), dtype)
            for shape, dtype in zip(self.leaf_shapes, self.leaf_dtypes)
        ]
        self._staged = 0
        self._stage_start = self._stage_next = (0, False)
        self._lengths: set = set()  # the chunk lengths flushed in one call so far
        self._counters = self._synced  # HostStorage: the ring's counters the core is told next
        self._host: list | None = None
        self._host_storage: HostStorage | None = None
        self._host_one: list | None = None
        self._host_tree: dict = {}
        self._host_views()

    def _host_views(self) -> None:
        """With a HostStorage, its live arrays as ``[n_envs, buffer_size, ...]`` views in the
        item's dtypes (8-byte leaves are stored as word pairs: viewed back); a step at ``pos``
        is ``view[:, pos]``. None otherwise."""
        if not isinstance(self.rb.storage, HostStorage):
            return
        self._host_storage = self.rb.storage
        arrays = self.rb.storage.arrays(self.state.storage)
        self._host = [
            (a.view(dtype)[..., 0] if _wide(dtype) else a).reshape(
                self.n_envs, self.buffer_size, *shape[1:]
            )
            for a, shape, dtype in zip(arrays, self.leaf_shapes, self.leaf_dtypes)
        ]
        # one env: [buffer_size, ...] rows, written as view[pos] = x[0] (half the cost)
        self._host_one = [v[0] for v in self._host] if self.n_envs == 1 else None
        self._host_tree = self.unflatten(self._host)  # the same views, by field

    def host_field(self, name: str) -> np.ndarray:
        """With a HostStorage, the live ``[n_envs, buffer_size, ...]`` rows of the top-level
        leaf ``name`` (written in place by the caller, as :meth:`stage` writes steps)."""
        if self._host is None:
            raise TypeError("functional_rb.sb3 Grid.host_field: the rows are not host arrays.")
        return self._host_tree[name]

    def nbytes(self) -> int:
        """Bytes the buffer's state holds (its host arrays included)."""
        held = sum(x.nbytes for x in jax.tree_util.tree_leaves(self.state))
        return held + sum(v.nbytes for v in self._host or ())

    # ------------------------------------------------------------------ the ring's counters
    def sync(self, pos: int, full: bool) -> None:
        """Make the core writer's cursor and fill level say what ``pos`` and ``full`` say (once
        the staged steps are written: counters that follow them leave them staged). With a
        HostStorage the pair is kept for the next call that uses the core."""
        if self._host is not None:
            if (pos, full) != self._counters:
                self._check_pos(pos)
                self._counters = (pos, full)
            return
        if self._staged and (pos, full) == self._stage_next:
            return
        self.flush()
        if (pos, full) == self._synced:
            return
        self._check_pos(pos)
        self._set_writer(pos, full)

    def _check_pos(self, pos: int) -> None:
        if not 0 <= pos < self.buffer_size:
            raise ValueError(
                f"functional_rb.sb3: pos must be in [0, buffer_size) = [0, {self.buffer_size}), "
                f"got {pos}; set it to an index of the ring."
            )

    def _set_writer(self, pos: int, full: bool) -> None:
        filled = self.buffer_size if full else pos
        writer = RoundRobinState.of(pos, filled)
        self.state = dataclasses.replace(self.state, writer=writer)
        self._mark(pos, full)

    def _mark(self, pos: int, full: bool) -> None:
        """The core writer's counters are now ``(pos, full)``."""
        self._synced = self._counters = (pos, full)

    def counters_after(self, pos: int, full: bool, steps: int) -> tuple[int, bool]:
        new_pos = (pos + steps) % self.buffer_size
        return new_pos, full or pos + steps >= self.buffer_size

    # ------------------------------------------------------------------ writes and reads
    def unflatten(self, leaves: list) -> PyTree:
        """The item tree of leaves listed in its order (:attr:`leaf_shapes`)."""
        return jax.tree_util.tree_unflatten(self._treedef, leaves)

    def stage(self, leaves: list, pos: int, full: bool) -> tuple[int, bool]:
        """Add one step at ``pos``: its leaves in the item's order, each ``[n_envs, ...]``
        (cast to the stored dtype here, as NumPy assigns), staged on the host until the next
        read or :meth:`flush` (with a HostStorage: written into its rows); the new
        ``(pos, full)``."""
        if self._host is not None:
            if self._host_one is not None:
                for view, x in zip(self._host_one, leaves):
                    view[pos] = x[0]
            else:
                for view, x in zip(self._host, leaves):
                    view[:, pos] = x
            pos += 1
            if pos == self.buffer_size:
                pos, full = 0, True
            self._counters = (pos, full)
            return pos, full
        k = self._staged
        if k and (pos, full) != self._stage_next:
            self.flush()  # the counters moved under the staged steps: write those first
            k = 0
        if not k:
            self._stage_start = (pos, full)
        for buf, x in zip(self._stage_leaves, leaves):
            buf[k] = x
        self._staged = k + 1
        pos += 1
        if pos == self.buffer_size:
            pos, full = 0, True
        self._stage_next = (pos, full)
        if k + 1 == self.STAGE:
            self.flush()
        return pos, full

    def flush(self) -> None:
        """Write the staged steps to the core, oldest first, with the core's eager ``add``
        (compiled once per configuration, in place; a plain ``jax.jit(rb.add,
        donate_argnums=0)`` is ~25 us faster a call, but its TED programs hold a transient of
        ~30% of the frame table: peak RSS 2.50 GB against 2.05 at 2*10^5 Atari steps).

        One call for all of them when that length was compiled before or few lengths were (a
        loop that samples every ``k`` steps flushes ``k``); otherwise power-of-two chunks, so
        that at most ``log2(STAGE) + 1`` more lengths compile. With a HostStorage: the
        counters :meth:`sync` and :meth:`stage` kept, into the core writer."""
        if self._host is not None:
            if self._counters != self._synced:
                self._set_writer(*self._counters)
            return
        count, start = self._staged, self._stage_start
        if not count:
            return
        self._staged = 0
        if start != self._synced:
            self._set_writer(*start)
        if count in self._lengths or len(self._lengths) < 8:
            self._lengths.add(count)
            sizes = [count]
        else:
            sizes = [1 << b for b in reversed(range(count.bit_length())) if count & (1 << b)]
        offset = 0
        for size in sizes:
            # a copy: JAX may alias host memory it is given, and the stage is reused
            chunk = [
                np.swapaxes(buf[offset : offset + size], 0, 1).copy() for buf in self._stage_leaves
            ]
            steps = encode(self.unflatten(chunk))
            self.state = self.rb.add(self.state, steps)
            offset += size
        self._mark(*self.counters_after(*start, count))

    def add(self, steps: PyTree, pos: int, full: bool) -> tuple[int, bool]:
        """Write ``T`` steps (leaves ``[n_envs, T, ...]``) at ``pos``; the new ``(pos, full)``."""
        self.sync(pos, full)
        self.flush()
        self.state = self.rb.add(self.state, encode(steps))
        count = jax.tree_util.tree_leaves(steps)[0].shape[1]
        self._mark(*self.counters_after(pos, full, count))
        return self._synced

    def flat(self, t, env) -> np.ndarray:
        """Flat core positions of SB3's ``(t, env)`` pairs (any broadcastable shapes)."""
        return np.asarray(env, np.int64) * self.buffer_size + np.asarray(t, np.int64)

    def read(self, t, env, fields: tuple | None = None, *, on_device: bool = False) -> PyTree:
        """The steps at ``(t, env)`` as NumPy arrays of their original dtypes, each new (the
        caller may write into it or hand it on without a copy); ``on_device``: JAX arrays on
        the buffer's device (:func:`decode_on_device`); ``fields``: only these top-level
        fields (the others are not read from the device)."""
        flat = self.flat(t, env)
        read_host = getattr(self.rb.storage, "read_host", None)
        if read_host is not None and not on_device:  # NumPy reads NumPy's way: no compile
            if self._host_storage is not None:
                leaves = self._host_storage.arrays_at(self.state.storage, flat)
            else:
                leaves = jax.tree_util.tree_leaves(read_host(self.state.storage, flat))
            for i in self._wide_leaves:
                leaves[i] = _decode_leaf(leaves[i], self.leaf_dtypes[i])
            if self._staged:  # the staged steps, not yet in the core, read from the stage
                self._merge_staged(leaves, t, env)
            data = self.unflatten(leaves)
            return data if fields is None else {k: data[k] for k in fields}
        # a compiled read sees the core only: the staged steps go first. (Writing them only
        # when the read takes one of them gives the same rows, but flushes of every length
        # then: measured, their compiles and power-of-two chunks cost more than they save)
        self.flush()
        dtypes = self.dtypes if fields is None else {k: self.dtypes[k] for k in fields}
        data = _gather(self.rb, fields, self.state, flat.astype(np.int32))
        if on_device:
            return decode_on_device(data, dtypes)
        return decode(jax.tree_util.tree_map(np.asarray, data), dtypes)

    def _staged_hits(self, t, env):
        """Where ``(t, env)`` reads slots the stage will write: ``(where, step, env)`` (the
        read's positions, as a tuple of index arrays, and the stage's step and env of each),
        or None when it reads none. Step ``j`` of the stage goes to slot ``(start + j) % T``;
        the stage may wrap the ring: the newest such step wins."""
        start, size, count = self._stage_start[0], self.buffer_size, self._staged
        t, env = np.asarray(t), np.asarray(env)
        if t.shape != env.shape:
            shape = np.broadcast_shapes(t.shape, env.shape)
            t, env = np.broadcast_to(t, shape), np.broadcast_to(env, shape)
        j = t.reshape(-1) - start
        j %= size
        hit = np.flatnonzero(j < count)
        if not hit.size:
            return None
        j = j[hit]
        if count > size:  # the stage wrapped the ring: the newest staged step of the slot
            j += size * ((count - 1 - j) // size)
        where = (hit,) if t.ndim == 1 else np.unravel_index(hit, t.shape)
        return where, j, env.reshape(-1)[hit]

    def _merge_staged(self, leaves: list, t, env) -> None:
        """Overwrite, in ``leaves`` read from the core at ``(t, env)``, the steps of slots the
        stage will write with the stage's (:meth:`_staged_hits`)."""
        hits = self._staged_hits(t, env)
        if hits is None:
            return
        where, j, e = hits
        for i in range(len(leaves)):
            if not leaves[i].flags.writeable:
                leaves[i] = np.array(leaves[i])
        if len(j) <= 4:  # the usual few: a step at a time costs less than fancy indexing
            rows = zip(zip(*(w.tolist() for w in where)), j.tolist(), e.tolist())
            for at, step, env_idx in rows:
                for leaf, buf in zip(leaves, self._stage_leaves):
                    leaf[at] = buf[step, env_idx]
            return
        for leaf, buf in zip(leaves, self._stage_leaves):
            leaf[where] = buf[j, e]

    def write(self, t, env, values: dict) -> None:
        """Overwrite top-level fields of stored steps: ``values[field][i]`` goes to the step at
        ``(t[i], env[i])`` (1-D, distinct pairs); the step's other fields are kept.

        One jitted read-modify-write of those rows, the storage donated (in place); NumPy
        assignments with a HostStorage. Only the storage changes: the writer's counters and
        the sampler's state (priorities) are not told, as no step is added. In a TED storage only the fields stored as they are (not
        the observations, stored once, nor the end flag of frame stacks) can be rewritten.
        Rows are padded to a power of two, so few sizes compile.
        """
        if self._host is None:  # (HostStorage rows are read and written as they are)
            self.flush()
        ted = isinstance(self.rb.storage, frb.TEDStorage)
        fixed = {"observations", "next"} | (
            {"dones"}
            if isinstance(self.rb.storage, frb.TEDStorage) and self.rb.storage.frame_stack > 1
            else set()
        )
        if ted and fixed & set(values):
            raise ValueError(
                f"functional_rb.sb3: {sorted(fixed & set(values))} of a buffer built with "
                "optimize_memory_usage=True or frame_stack= cannot be rewritten: observations are "
                "stored once and stacks follow the episode ends as added. Build the buffer "
                "without those options to edit stored steps."
            )
        if not ted and not isinstance(self.rb.storage, (frb.DeviceStorage, HostStorage)):
            raise TypeError(
                "functional_rb.sb3 Grid.write: rewrites rows of a DeviceStorage, HostStorage or "
                f"TEDStorage only, got {type(self.rb.storage).__name__}."
            )
        t, env = np.asarray(t).reshape(-1), np.asarray(env).reshape(-1)
        if len(t) == 0:
            return
        if t.min() < 0 or t.max() >= self.buffer_size or env.min() < 0 or env.max() >= self.n_envs:
            raise ValueError(
                f"functional_rb.sb3 Grid.write: (t, env) must lie in [0, {self.buffer_size}) x "
                f"[0, {self.n_envs}), got t in [{t.min()}, {t.max()}], env in "
                f"[{env.min()}, {env.max()}]."
            )
        flat = self.flat(t, env)
        if len(np.unique(flat)) != len(flat):
            raise ValueError("functional_rb.sb3 Grid.write: the (t, env) pairs must be distinct.")
        if self._host is not None:  # NumPy rows: written where they are
            for k, v in values.items():
                for view, x in zip(
                    jax.tree_util.tree_leaves(self._host_tree[k]), jax.tree_util.tree_leaves(v)
                ):
                    view[env, t] = x
            return
        size = max(8, 1 << (len(flat) - 1).bit_length())

        def padded(x, dtype):
            x = np.asarray(x, dtype)
            return np.concatenate([x, np.zeros((size - len(x), *x.shape[1:]), x.dtype)])

        values = {k: jax.tree_util.tree_map(padded, v, self.dtypes[k]) for k, v in values.items()}
        fields = tuple(sorted(values))
        rest = dataclasses.replace(self.state, storage=None)
        mask = np.arange(size) < len(flat)
        storage = self._writer(fields)(
            self.state.storage, rest, padded(flat, np.int32), mask, encode(values)
        )
        self.state = dataclasses.replace(self.state, storage=storage)

    def _writer(self, fields: tuple):
        if fields not in self._writes:
            rb = self.rb

            def write(storage, rest, idx, mask, values):
                state = dataclasses.replace(rest, storage=storage)
                rows = {**rb.get(state, idx), **values}
                record = WriteRecord(positions=idx, mask=mask)
                return rb.storage.set(storage, record, rows, rb.context(state))

            def write_ted(storage, rest, idx, mask, values):
                # the fields a TED storage keeps as they are
                return rb.storage.rewrite(storage, idx, mask, {k: values[k] for k in fields})

            ted = isinstance(rb.storage, frb.TEDStorage)
            self._writes[fields] = jax.jit(write_ted if ted else write, donate_argnums=0)
        return self._writes[fields]

    def draw(self, seed: int, batch_size: int, *, on_device: bool = False, **options):
        """The core sampler's draw with ``jax.random.key(seed)``: ``(t, env, weights, data)``;
        data as :meth:`read`'s (NumPy arrays read-only). ``options``: the sampler's numbers
        (``beta``). One compiled call (:func:`_draw`)."""
        self.flush()
        (idx, weights, data), self.state = _draw(
            self.rb, batch_size, self.state, np.uint32(seed), options
        )
        env, t = np.divmod(np.asarray(idx), self.buffer_size)
        if on_device:
            return t, env, weights, decode_on_device(data, self.dtypes)
        data = decode(jax.tree_util.tree_map(np.asarray, data), self.dtypes)
        return t, env, np.asarray(weights), data

    def update(self, t, env, priorities) -> None:
        """Set the core sampler's priorities of the steps at ``(t, env)`` (in range, finite
        and >= 0: checked here, as the compiled call would ignore others). Sizes are padded
        to a power of two, so few compile."""
        self.flush()
        flat = self.flat(t, env).reshape(-1)
        p = np.asarray(priorities, np.float32).reshape(-1)
        if not flat.size:  # (padding an empty update would write its filler)
            return
        cap = self.buffer_size * self.n_envs
        if flat.min() < 0 or flat.max() >= cap:
            raise ValueError(
                f"functional_rb.sb3 update_priorities: indices must lie in [0, {cap}), got "
                f"[{flat.min()}, {flat.max()}]; pass the indices of a sample."
            )
        bad = ~(np.isfinite(p) & (p >= 0))
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(
                f"functional_rb.sb3 update_priorities: priorities[{i}] = {float(p[i])!r} is not a "
                "finite number >= 0; pass |TD errors|."
            )
        size = max(8, 1 << (len(flat) - 1).bit_length())
        keep = np.arange(size) < len(flat)
        # the padding repeats the last pair: the last of duplicates wins, so it changes nothing
        idx = np.where(keep, np.resize(flat, size), flat[-1])
        prio = np.where(keep, np.resize(p, size), p[-1])
        self.state = _update(self.rb, self.state, idx.astype(np.int32), prio.astype(np.float32))

    def column(self, fields: tuple | None = None) -> PyTree:
        """Every field (``fields``: these top-level fields) as a read-only NumPy array in SB3's
        layout ``[buffer_size, n_envs, ...]``."""
        if self._host is None:  # (HostStorage rows are read and written as they are)
            self.flush()
        t, env = np.meshgrid(np.arange(self.buffer_size), np.arange(self.n_envs), indexing="ij")
        out = self.read(t, env, fields)

        def frozen(x):
            x = np.array(x)
            x.flags.writeable = False
            return x

        return jax.tree_util.tree_map(frozen, out)

    def reset(self) -> None:
        self.sync(0, False)

    # ------------------------------------------------------------------ whole contents
    def export(self) -> dict:
        """The core state as host arrays (for pickling): exact, priorities and tables included."""
        self.flush()
        return {"state": jax.device_get(self.state), "synced": self._synced}

    def restore(self, saved: dict) -> None:
        """The inverse of :meth:`export`."""
        self._staged = 0
        self.state = jax.tree_util.tree_map(jnp.asarray, saved["state"])
        self._mark(*saved["synced"])
        self._host_views()  # an unpickled state holds arrays of its own

    def save(self, path, pos: int, full: bool, meta: dict, extra: dict | None = None) -> None:
        """:func:`functional_rb.checkpoint.save` of the core state, the staged steps in it;
        ``extra``: NumPy arrays the caller keeps beside the rows, saved with them."""
        self.sync(pos, full)
        self.flush()
        tree = self.state if extra is None else {"buffer": self.state, "extra": extra}
        frb.checkpoint.save(path, tree, meta={"pos": pos, "full": full, **meta})

    def load(self, path, extra: dict | None = None) -> tuple[dict, dict | None]:
        """Replace the state by a checkpoint :meth:`save` wrote (staged steps dropped: they
        belong to the state replaced): its ``meta``, and the ``extra`` arrays saved with it
        (``extra``: arrays of their shapes, as given to :meth:`save`), else None."""
        self._staged = 0
        like = self.state if extra is None else {"buffer": self.state, "extra": extra}
        loaded = frb.checkpoint.load(path, like=like)
        self.state = loaded if extra is None else loaded["buffer"]
        meta = frb.checkpoint.verify(path).meta["user"]
        self._mark(int(meta["pos"]), bool(meta["full"]))
        self._host_views()
        return meta, None if extra is None else loaded["extra"]

    def load_columns(self, columns: PyTree, pos: int, full: bool) -> None:
        """Write SB3-layout arrays (``[buffer_size, n_envs, ...]``) in time order, oldest first,
        so that a storage that reads successors (TED) sees the stream SB3 saw."""
        self.flush()
        order = (
            np.arange(pos, pos + self.buffer_size) % self.buffer_size if full else np.arange(pos)
        )
        if len(order) == 0:
            self.sync(0, False)
            return
        steps = jax.tree_util.tree_map(lambda x: np.swapaxes(np.asarray(x)[order], 0, 1), columns)
        start = pos if full else 0
        writer = RoundRobinState.of(start, 0)
        self.state = dataclasses.replace(self.state, writer=writer)
        self.state = self.rb.add(self.state, encode(steps))
        self._mark(pos, full)
