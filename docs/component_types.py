"""A griffe extension for the API reference: ``ReplayBuffer``'s component fields are annotated
``Any`` in the source (any object with the protocol's methods is accepted, checked in
``__post_init__``), which the reference would print as ``sampler: Any``. Shown instead: the
protocol each one must follow and the rate limiter's type. Only ``Any`` is replaced, so an
annotation written in the source wins."""
from __future__ import annotations

import griffe

_FIELDS = {
    "sampler": griffe.ExprName("Sampler", parent="functional_rb.protocol"),
    "writer": griffe.ExprName("Writer", parent="functional_rb.protocol"),
    "storage": griffe.ExprName("Storage", parent="functional_rb.protocol"),
    "rate_limiter": griffe.ExprBinOp(griffe.ExprName("RateLimiter", parent="functional_rb"), "|",
                                     "None"),
}


def _is_any(annotation) -> bool:
    return annotation is not None and str(annotation) in ("Any", "typing.Any")


class ComponentTypes(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs) -> None:
        del loader, kwargs
        if pkg.name != "functional_rb":
            return
        cls = pkg["buffer"]["ReplayBuffer"]
        for name, annotation in _FIELDS.items():
            if name in cls.members and _is_any(cls.members[name].annotation):
                cls.members[name].annotation = annotation
        init = cls.members.get("__init__")
        if init is not None and init.is_function:
            for param in init.parameters:
                if param.name in _FIELDS and _is_any(param.annotation):
                    param.annotation = _FIELDS[param.name]
