"""The patches tpugen puts on a loaded pipeline, each under a name, so each can be removed again."""

from __future__ import annotations

from collections.abc import Callable


class Hooks:
    """Named, removable patches on one pipeline (forward hooks, wrapped methods, swapped classes or attention
    processors). Removing all of them leaves the pipeline as it was loaded."""

    def __init__(self) -> None:
        self._removers: dict[str, Callable[[], None]] = {}

    def add(self, name: str, remove: Callable[[], None]) -> None:
        """Record a patch already made, with the call that undoes it."""
        if name in self._removers:
            raise ValueError(f"a hook named {name!r} is already installed")
        self._removers[name] = remove

    def wrap(self, owner, attribute: str, name: str, make: Callable) -> None:
        """Replace owner.attribute with make(current value); removal puts the current value back."""
        own = attribute in vars(owner)  # an instance attribute, or a method found on the class
        original = getattr(owner, attribute)
        wrapper = make(original)
        setattr(owner, attribute, wrapper)

        def remove() -> None:
            if getattr(owner, attribute) is not wrapper:
                raise RuntimeError(f"hook {name!r}: {attribute} was wrapped again after it; remove that hook first")
            if own:
                setattr(owner, attribute, original)
            else:
                delattr(owner, attribute)

        self.add(name, remove)

    def names(self) -> list[str]:
        return list(self._removers)

    def remove(self, name: str) -> None:
        self._removers.pop(name)()

    def remove_all(self) -> None:
        """Every patch undone, the last one first."""
        for name in reversed(list(self._removers)):
            self.remove(name)
