"""Name -> pure function tables for the loss's variants, filled by a decorator (as verl's core_algos):

    IS_CORRECTION = Registry("loss.is_correction")

    @IS_CORRECTION.register("tis")
    def tis(w, log_ratio, mask, nonfinite, cfg):
        "w = min(w, C): truncated IS, token level"
        ...

    IS_CORRECTION["tis"]    # the function; a name that is not registered raises ValueError

A config names an entry and the code calls it by that name, so dispatch is exhaustive: a name without
its function is an error, never another variant. A function's docstring opens with its formula (the
notebooks print it); keyword arguments of `register` become attributes of the function, and those the
registry requires (`Registry("loss.agg", mean_over=("tokens", "sequences"))`) are checked when it registers.
"""

from __future__ import annotations


class Registry(dict):
    """{name: function} in registration order; `key` is the config key that picks an entry; `required`: the
    attributes every entry must register, each with its allowed values."""

    def __init__(self, key: str, **required: tuple):
        super().__init__()
        self.key, self.required = key, required

    def register(self, name: str, **attrs):
        """Decorator adding the function under `name` (once), with `attrs` set on it."""
        def add(fn):
            if name in self:
                raise ValueError(f"{self.key}: {name!r} is registered twice")
            for attr, allowed in self.required.items():
                if attrs.get(attr) not in allowed:
                    raise ValueError(f"{self.key}: {name!r} registers {attr}={attrs.get(attr)!r}; "
                                     f"expected one of {', '.join(map(repr, allowed))}")
            fn.__dict__.update(attrs)
            self[name] = fn
            return fn
        return add

    def choices(self) -> str:
        """The registered names for a message: 'a', 'b', 'c'."""
        return ", ".join(map(repr, self))

    def __missing__(self, name):
        raise ValueError(f"{self.key}={name!r} is not registered; expected one of {self.choices()}")
