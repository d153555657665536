"""Random TED streams and naive (full-item) references for the TED tests."""

import numpy as np


def ted_stream(
    rng,
    num_envs,
    steps,
    *,
    frame_shape=(2,),
    p_end=0.2,
    p_trunc=0.1,
    p_glitch=0.0,
    values=4,
    dtype=np.uint8,
):
    """[num_envs, steps] TED items as numpy: single-frame observations. Small value ranges make
    reset observations coincide with final ones now and then; p_glitch makes a step whose
    successor's observation differs without an episode end."""
    e, t = num_envs, steps
    obs = np.zeros((e, t) + frame_shape, dtype)
    nxt = np.zeros((e, t) + frame_shape, dtype)
    done = rng.random((e, t)) < p_end
    trunc = (rng.random((e, t)) < p_trunc) & ~done
    term = done.copy()
    done = done | trunc
    glitch = rng.random((e, t)) < p_glitch
    for i in range(e):
        cur = rng.integers(0, values, frame_shape).astype(dtype)
        for j in range(t):
            obs[i, j] = cur
            nxt[i, j] = rng.integers(0, values, frame_shape).astype(dtype)
            if done[i, j] or glitch[i, j]:
                cur = rng.integers(0, values, frame_shape).astype(dtype)
            else:
                cur = nxt[i, j]
    return {
        "observation": obs,
        "action": rng.integers(0, 3, (e, t)).astype(np.int32),
        "done": np.zeros((e, t, 1), bool),
        "next": {
            "observation": nxt,
            "reward": rng.normal(size=(e, t, 1)).astype(np.float32),
            "done": done[..., None],
            "terminated": term[..., None],
            "truncated": trunc[..., None],
        },
    }


def naive_stacks(data, k, pad="first"):
    """The same stream with observation / next observation replaced by k-frame stacks, as a
    FrameStack wrapper fills them (episode starts after any done or truncated)."""
    obs, nxt = data["observation"], data["next"]["observation"]
    end = data["next"]["done"][..., 0] | data["next"]["truncated"][..., 0]
    e, t = end.shape
    so = np.zeros((e, t, k) + obs.shape[2:], obs.dtype)
    sn = np.zeros_like(so)
    for i in range(e):
        start = 0
        for j in range(t):
            if j > 0 and end[i, j - 1]:
                start = j
            for m in range(k):  # m: position in the stack, oldest first
                back = k - 1 - m
                if j - back >= start:
                    so[i, j, m] = obs[i, j - back]
                elif pad == "first":
                    so[i, j, m] = obs[i, start]
            sn[i, j, :-1] = so[i, j, 1:]
            sn[i, j, -1] = nxt[i, j]
    out = dict(data)
    out["observation"] = so
    out["next"] = dict(data["next"], observation=sn)
    return out
