"""TorchRL's ``QueryModule`` and ``HashToInt`` (``torchrl.data.map.query``): from a few entries
of a TensorDict to one integer per row, the row's slot in a storage.

A :class:`QueryModule` hashes each of its ``in_keys`` (one hash module per key), combines the
hashes of a row with its ``aggregator`` when there are several keys, and numbers the distinct
hashes in the order they are first seen with :class:`HashToInt`: the first new key gets slot
0, the next slot 1, and so on, which is how a :class:`~functional_rb.adapters.TensorDictMap`
fills its storage from the front.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from copy import deepcopy

import torch
from tensordict import NestedKey, TensorDictBase
from tensordict.nn.common import TensorDictModuleBase
from torch import nn

from functional_rb.adapters.map.hash import SipHash

__all__ = ["HashToInt", "QueryModule"]


class HashToInt(nn.Module):
    """Numbers hash values in the order they are first seen (TorchRL's ``HashToInt``).

    ``hash_to_int(hashes, extend=True)`` gives each new hash the next free number and returns
    every row's number; with ``extend=False`` nothing is recorded and unknown hashes all get
    the next free number (``len`` of the table), one past the last slot in use. Its
    ``state_dict`` holds the table (``keys``, ``values``), so a saved map reloads its numbering.
    """

    def __init__(self):
        super().__init__()
        self._index_to_index: dict = {}

    def forward(self, key: torch.Tensor, extend: bool = False) -> torch.Tensor:
        table = self._index_to_index
        if extend:
            result = [table.setdefault(k, len(table)) for k in key.tolist()]
        else:
            free = len(table)
            result = [table.get(k, free) for k in key.tolist()]
        return torch.tensor(result, device=key.device, dtype=key.dtype)

    def __len__(self) -> int:
        return len(self._index_to_index)

    def clear(self) -> None:
        """Forgets every hash (what :meth:`TensorDictMap.clear` calls)."""
        self._index_to_index = {}

    # the table is saved under the module's prefix, so a QueryModule (or a map) holding this
    # module saves and loads it with its own state_dict
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "keys"] = torch.tensor(
            list(self._index_to_index.keys()), dtype=torch.int64
        )
        destination[prefix + "values"] = torch.tensor(
            list(self._index_to_index.values()), dtype=torch.int64
        )

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        keys, values = state_dict.get(prefix + "keys"), state_dict.get(prefix + "values")
        if keys is None or values is None:
            missing_keys.extend(
                prefix + k for k in ("keys", "values") if state_dict.get(prefix + k) is None
            )
            return
        self._index_to_index = dict(zip(keys.tolist(), values.tolist()))


class QueryModule(TensorDictModuleBase):
    """Writes each row's storage slot (and hash) into a TensorDict (TorchRL's
    ``QueryModule``).

    Args:
      in_keys: the entries whose values identify a row (a single key is taken as ``[key]``).
      index_key: where the slot (int64) is written. Defaults to ``"_index"``.
      hash_key: where the row's hash is written. Defaults to ``"_hash"``.

    Keyword Args:
      hash_module: a hash module (:class:`SipHash` by default) or one per in-key. A single
        module is deep-copied for each key when there are several.
      hash_to_int: numbers the hashes (a new :class:`HashToInt` by default); called as
        ``hash_to_int(hashes, extend=...)``.
      aggregator: hashes the ``[batch, n_keys]`` stack of per-key hashes into one per row, when
        there are several in-keys. Defaults to the single ``hash_module`` when one was given,
        else a :class:`SipHash`. With one in-key it is not used (a warning says so).
      clone: write into a shallow copy of the input instead of the input itself (overridden
        by ``forward``'s ``clone``).
    """

    def __init__(
        self,
        in_keys: list[NestedKey],
        index_key: NestedKey = "_index",
        hash_key: NestedKey = "_hash",
        *,
        hash_module: Callable | list[Callable] | None = None,
        hash_to_int: Callable | None = None,
        aggregator: Callable | None = None,
        clone: bool = False,
    ):
        if len(in_keys) == 0:
            raise ValueError(
                "`in_keys` cannot be empty. QueryModule: pass the entries that "
                "identify a row, e.g. in_keys=['observation']."
            )
        super().__init__()
        self.in_keys = in_keys if isinstance(in_keys, list) else [in_keys]
        self.out_keys = [index_key, hash_key]
        self.index_key, self.hash_key = self.out_keys  # as unravelled by the setter
        n_keys = len(self.in_keys)
        if aggregator is not None and n_keys == 1:
            warnings.warn(
                "An aggregator was provided but there is only one in-key to be "
                "read. This module will be ignored. (QueryModule: the aggregator "
                "combines the hashes of several in_keys; leave it out.)",
                stacklevel=2,
            )
        elif aggregator is None:
            single = hash_module is not None and not isinstance(hash_module, list)
            aggregator = hash_module if single else SipHash()
        self.aggregator = aggregator
        self.hash_module = dict(zip(self.in_keys, self._hash_modules(hash_module, n_keys)))
        self.hash_to_int = HashToInt() if hash_to_int is None else hash_to_int
        self.clone = clone

    @staticmethod
    def _hash_modules(hash_module, n_keys: int) -> list:
        if hash_module is None:
            return [SipHash() for _ in range(n_keys)]
        if isinstance(hash_module, list):
            if len(hash_module) != n_keys:
                raise ValueError(
                    "The number of hash_modules must match the number of in_keys. "
                    f"Got {len(hash_module)} hash modules but {n_keys} in_keys."
                )
            return hash_module
        if n_keys == 1:
            return [hash_module]
        try:  # one module per key: a stateful hash (a fitted projection) is per input
            return [deepcopy(hash_module) for _ in range(n_keys)]
        except Exception as err:
            raise RuntimeError(
                "failed to deepcopy the hash module. Please provide a list of hash modules instead."
            ) from err

    def forward(
        self,
        tensordict: TensorDictBase,
        *,
        extend: bool = True,
        write_hash: bool = True,
        clone: bool | None = None,
    ) -> TensorDictBase:
        """Writes the rows' slots at ``index_key`` (and hashes at ``hash_key`` when
        ``write_hash``). ``extend=False`` leaves unknown rows unnumbered (they get the next
        free slot); ``clone`` writes into a shallow copy instead of ``tensordict``."""
        hashes = [self.hash_module[k](tensordict.get(k)) for k in self.in_keys]
        if len(hashes) > 1:
            hash_values = self.aggregator(torch.stack(hashes, dim=-1))
        else:
            hash_values = hashes[0]
        index = self.hash_to_int(hash_values, extend=extend)
        output = tensordict.copy() if (self.clone if clone is None else clone) else tensordict
        output.set(self.index_key, index)
        if write_hash:
            output.set(self.hash_key, hash_values)
        return output
