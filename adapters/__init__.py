"""functional_rb.adapters: TorchRL-compatible classes backed by the functional core.

Importing this package requires torch and tensordict (``pip install functional-rb[torch]``).
"""
