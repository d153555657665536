"""flashbax's ``flashbax.vault``: the :class:`~functional_rb.flashbax.vault.vault.Vault` class,
flashbax's on-disk format for buffer experience, built on :mod:`functional_rb.vault`
(tensorstore is needed to create or open a vault: ``pip install "functional-rb[vault]"``).

>>> from functional_rb.flashbax.vault import Vault
>>> Vault.__module__
'functional_rb.flashbax.vault.vault'
"""

from functional_rb.flashbax.vault.vault import Vault

__all__ = ("Vault",)
