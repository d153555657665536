"""TorchRL's hash modules (``torchrl.data.map.hash``): ``BinaryToDecimal``, ``SipHash`` and
``RandomProjectionHash``, which turn rows of a tensor into one integer per row.

Their outputs are keys that users store (a :class:`~functional_rb.adapters.TensorDictMap`'s
index, a tree's node hashes), so they are TorchRL's values exactly: ``SipHash`` hashes the bytes
of each row with Python's builtin ``hash`` (SipHash-1-3, seeded by ``PYTHONHASHSEED``: set it to
get the same values in another process), and ``RandomProjectionHash`` draws its projection from
torch's global generator with the same calls as TorchRL, so the same seed gives the same hashes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["N_COMPONENTS_DEFAULT", "BinaryToDecimal", "RandomProjectionHash", "SipHash"]

# RandomProjectionHash's default width, and the entry width above which
# TensorDictMap.from_tensordict_pair projects an entry before hashing it
N_COMPONENTS_DEFAULT = 16


class BinaryToDecimal(nn.Module):
    """Reads groups of ``num_bits`` binary digits as numbers and sums the groups of each row
    (TorchRL's ``BinaryToDecimal``): ``[[0, 0, 1, 1]]`` gives ``[3]``.

    Args:
      num_bits: digits per group, most significant first. The last dim of the input must be a
        multiple of it (groups beyond the first are summed).
      device: where the bases table lives (the inputs' device).
      dtype: the output dtype (also the dtype the digits are read in).
      convert_to_binary: when True, inputs are first mapped to digits with
        ``torch.heaviside(x, 0)`` (positive -> 1, zero and negative -> 0).

    As TorchRL's, the output is one dimensional: inputs of shape ``[..., F]`` give
    ``prod(...)`` values.
    """

    def __init__(
        self,
        num_bits: int,
        device: torch.device,
        dtype: torch.dtype,
        convert_to_binary: bool = False,
    ):
        if isinstance(num_bits, bool) or not isinstance(num_bits, int) or num_bits < 1:
            raise ValueError(f"BinaryToDecimal: num_bits must be a positive int, got {num_bits!r}.")
        super().__init__()
        self.convert_to_binary = convert_to_binary
        # most significant digit first: 2**(num_bits-1), ..., 2, 1
        self.bases = 2 ** torch.arange(num_bits - 1, -1, -1, device=device, dtype=dtype)
        self.num_bits = num_bits
        self.zero_tensor = torch.zeros((1,), device=device)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        num_features = features.shape[-1]
        fix = (
            f"BinaryToDecimal.forward: the last dim of the input (shape "
            f"{tuple(features.shape)}) must be a multiple of num_bits={self.num_bits}; "
            "build the module with a num_bits that divides it."
        )
        if self.num_bits > num_features:
            raise ValueError(f"{num_features=} is less than {self.num_bits=}. {fix}")
        if num_features % self.num_bits != 0:
            raise ValueError(f"{num_features=} is not divisible by {self.num_bits=}. {fix}")
        digits = features
        if self.convert_to_binary:
            # heaviside needs both arguments in one dtype (TorchRL's fails on float64 inputs)
            digits = torch.heaviside(features, self.zero_tensor.to(features.dtype))
        groups = digits.reshape(-1, self.num_bits).to(self.bases.dtype)
        values = (groups * self.bases).sum(-1)
        return values.reshape(-1, num_features // self.num_bits).sum(-1)


class SipHash(nn.Module):
    """One hash per row of a ``[batch, ...]`` tensor (TorchRL's ``SipHash``): the builtin
    ``hash`` of the row's bytes, so equal rows (same dtype) hash equally.

    Args:
      as_tensor: True: an int64 tensor of shape ``[batch]``; False: the list of each row's
        bytes (no hashing).

    The builtin ``hash`` is seeded per process: set ``PYTHONHASHSEED`` before starting Python
    to get the same values in every run. bfloat16 rows are hashed as float16, as TorchRL does.
    """

    def __init__(self, as_tensor: bool = True):
        super().__init__()
        self.as_tensor = as_tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor | list[bytes]:
        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"{type(self).__name__}.forward: expected a torch.Tensor of shape "
                f"[batch, ...], got {type(x).__name__}."
            )
        if x.dtype == torch.bfloat16:  # numpy has no bfloat16
            x = x.to(torch.float16)
        rows = [row.tobytes() for row in x.detach().cpu().numpy()]
        if not self.as_tensor:
            return rows
        return torch.tensor([hash(row) for row in rows], dtype=torch.int64)


class RandomProjectionHash(SipHash):
    """Projects rows onto ``n_components`` random directions, casts them to ``dtype_cast``
    and hashes the result with :class:`SipHash` (TorchRL's ``RandomProjectionHash``): near
    rows that round to the same projection share a hash, and wide rows hash quickly.

    Keyword Args:
      n_components: the projection's width (16 when None).
      dtype_cast: the dtype rows are cast to before the projection (bfloat16).
      as_tensor: as :class:`SipHash`'s.
      init_method: fills the ``[features, n_components]`` projection in place when it is
        built (``torch.nn.init.normal_``, from torch's global generator).

    The projection is built at the first call (or by :meth:`fit`) from the input's width; it
    is a buffer, so it is saved in ``state_dict`` and a loaded one hashes as the saved one
    (TorchRL's cannot load into an unfitted module).
    """

    _N_COMPONENTS_DEFAULT = N_COMPONENTS_DEFAULT  # TorchRL's name

    def __init__(
        self,
        *,
        n_components: int | None = None,
        dtype_cast=torch.bfloat16,
        as_tensor: bool = True,
        init_method: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    ):
        if n_components is None:
            n_components = self._N_COMPONENTS_DEFAULT
        if isinstance(n_components, bool) or not isinstance(n_components, int) or n_components < 1:
            raise ValueError(
                f"RandomProjectionHash: n_components must be a positive int or "
                f"None, got {n_components!r}."
            )
        super().__init__(as_tensor=as_tensor)
        self.register_buffer("_n_components", torch.as_tensor(n_components))
        self._init = False
        self.init_method = torch.nn.init.normal_ if init_method is None else init_method
        self.dtype_cast = dtype_cast
        self.register_buffer("transform", nn.UninitializedBuffer())

    @property
    def n_components(self) -> int:
        return self._n_components.item()

    def fit(self, x: torch.Tensor) -> None:
        """Builds the projection for rows of ``x``'s width (drawn by ``init_method``)."""
        self.transform.materialize(
            (x.shape[-1], self.n_components), dtype=self.dtype_cast, device=x.device
        )
        self.init_method(self.transform)
        self._init = True

    def forward(self, x: torch.Tensor) -> torch.Tensor | list[bytes]:
        if not self._init:
            self.fit(x)
        elif x.shape[-1] != self.transform.shape[0]:
            raise RuntimeError(
                f"RandomProjectionHash.forward: the projection was built for rows "
                f"of {self.transform.shape[0]} features, got rows of "
                f"{x.shape[-1]} (input shape {tuple(x.shape)}). Use one module "
                "per input width."
            )
        return super().forward(x.to(self.dtype_cast) @ self.transform)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a saved projection is the hash's identity: an unfitted module takes its shape first
        saved = state_dict.get(prefix + "transform")
        if saved is not None and isinstance(self.transform, nn.parameter.UninitializedBuffer):
            self.transform.materialize(saved.shape, dtype=saved.dtype, device=saved.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if saved is not None:
            self._init = True
