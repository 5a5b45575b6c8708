"""Which layers of a streamed update are complete, as its checkpoint tensors arrive.

Why: a swap commit re-packs every layer (the CPU oneDNN handles) before the version can go
live, and that re-pack is most of an update's staging time on a real model. The tensors
arrive bucket by bucket, in checkpoint order, so the first layers are complete long before
the last bucket lands. Re-packing each layer as soon as the last tensor it reads has been
verified overlaps the re-pack with the rest of the receive, instead of running it after.

A layer is re-packed from its own parameters only (``process_weights_after_loading`` of
one module), which is what lets vLLM's own layerwise reload process a layer as soon as its
weights are loaded; this is the same rule, applied to shadow parameters. Tied parameters
(an LM head sharing the embedding) make a layer wait on another layer's tensors: a layer
waits on every parameter it holds, and a parameter on every tensor whose loader writes it.

Computed once per engine (``Dependencies``); each update walks a fresh ``Countdown``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


class Dependencies:
    def __init__(self, writers: Mapping[str, Iterable[int]], layers: Sequence[Iterable[int]]) -> None:
        """``writers[name]``: the parameter keys ``name``'s loaders write; ``layers[i]``: the
        parameter keys layer ``i`` holds. Every key a layer holds must have a writer."""
        self._keys_of_name = {name: frozenset(keys) for name, keys in writers.items()}
        names_per_key: dict[int, int] = {}
        for keys in self._keys_of_name.values():
            for k in keys:
                names_per_key[k] = names_per_key.get(k, 0) + 1
        self._names_per_key = names_per_key
        self._layers_of_key: dict[int, list[int]] = {}
        self._keys_per_layer: list[int] = []
        for i, keys in enumerate(layers):
            keys = frozenset(keys)
            unwritten = [k for k in keys if k not in names_per_key]
            if unwritten:
                raise ValueError(f"layer {i} holds parameters no checkpoint tensor writes ({len(unwritten)})")
            for k in keys:
                self._layers_of_key.setdefault(k, []).append(i)
            self._keys_per_layer.append(len(keys))

    @property
    def names(self) -> frozenset[str]:
        return frozenset(self._keys_of_name)

    def countdown(self) -> Countdown:
        return Countdown(self)


class Countdown:
    """One update's progress: feed it the tensors that arrived, it names the layers they completed."""

    def __init__(self, deps: Dependencies) -> None:
        self._deps = deps
        self._key_left = dict(deps._names_per_key)
        self._layer_left = list(deps._keys_per_layer)
        self.seen: set[str] = set()

    def ready_at_start(self) -> list[int]:
        """Layers that hold no parameter at all: complete before any tensor."""
        return [i for i, n in enumerate(self._layer_left) if n == 0]

    def arrived(self, names: Iterable[str]) -> list[int]:
        """Mark ``names`` as loaded; return the layers that became complete, in order."""
        done: list[int] = []
        for name in names:
            if name in self.seen:
                raise ValueError(f"checkpoint tensor {name!r} arrived twice in one update")
            keys = self._deps._keys_of_name.get(name)
            if keys is None:
                raise KeyError(f"checkpoint tensor {name!r} is not part of this model's updates")
            self.seen.add(name)
            for k in keys:
                self._key_left[k] -= 1
                if self._key_left[k] == 0:
                    for layer in self._deps._layers_of_key.get(k, ()):
                        self._layer_left[layer] -= 1
                        if self._layer_left[layer] == 0:
                            done.append(layer)
        return sorted(done)

    def missing(self) -> list[str]:
        return sorted(self._deps.names - self.seen)
