"""A torch module run as a JAX function of its weights (torchax): the weights live on the device as arguments,
never baked into a compiled program, so new weights of the same shapes (a LoRA switch) compile nothing."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager


def host_array(tensor):
    """A host torch tensor as the numpy array JAX takes, converted on the host (never an op on the device):
    bfloat16 as ml_dtypes' bfloat16, 64-bit types as 32-bit ones (JAX runs without 64-bit types)."""
    import ml_dtypes
    import numpy as np
    import torch

    tensor = tensor.detach().contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    array = tensor.numpy()
    if array.dtype == np.int64:
        return array.astype(np.int32)
    if array.dtype == np.float64:
        return array.astype(np.float32)
    return array


def _host_dtype(tensor):
    """The dtype `host_array` gives a host torch tensor (without converting it)."""
    import ml_dtypes
    import numpy as np
    import torch

    if tensor.dtype == torch.bfloat16:
        return ml_dtypes.bfloat16
    dtype = torch.empty((), dtype=tensor.dtype).numpy().dtype
    return {np.dtype(np.int64): np.dtype(np.int32), np.dtype(np.float64): np.dtype(np.float32)}.get(dtype, dtype)


def to_jax(tensor, sharding=None):
    """A host torch tensor as a JAX array: a transfer, never a compile. On the default device, or laid out by
    `sharding` (a jax.sharding.Sharding: copies on every device of a mesh, or split over them)."""
    import jax

    return jax.device_put(host_array(tensor), sharding)


def to_torch(arrays: list) -> list:
    """JAX arrays read back to the host as torch tensors (one read of them all)."""
    import jax
    import ml_dtypes
    import numpy as np
    import torch

    out = []
    for array in jax.device_get(arrays):
        array = np.asarray(array)
        if array.dtype == ml_dtypes.bfloat16:
            out.append(torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16))
        else:
            out.append(torch.from_numpy(array.copy()))
    return out


class JaxModule:
    """`module`'s weights (parameters and buffers) on the device, and its methods as JAX functions of them:
    `call` from host torch tensors (a jitted function per signature, outputs read back), `traced` inside another
    JAX function (the whole denoising loop)."""

    def __init__(self, runtime, module, label: str, layout: Callable | None = None) -> None:
        self.runtime = runtime
        self.module = module
        self.label = label
        # How each weight lies on the devices: layout(name) gives its jax.sharding.Sharding (None: all of them on
        # the default device).
        self.layout = layout or (lambda name: None)
        # Tied weights (one tensor under several names) are one device array.
        self._alias: dict[str, str] = {}
        first: dict[int, str] = {}
        self.weights: dict = {}
        tensors = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        for name, tensor in tensors:
            if tensor is None:
                continue
            canonical = first.setdefault(id(tensor), name)
            self._alias[name] = canonical
            if canonical == name:
                self.weights[name] = to_jax(tensor, self.layout(name))
        self._jitted: dict = {}
        self._lock = threading.Lock()
        self._patched: dict[str, Callable | None] = {}  # method -> what the module had on itself before
        # While set, `call` computes nothing: it answers with zeros of its outputs' shapes (found by tracing).
        self.shapes_only = False

    def patch(self, method: str, hooks) -> None:
        """Calls of `module.method` from host code (diffusers' glue) go to JAX (`call`), as the named hook
        "<component> <method> on JAX", whose removal puts back what the module had (its class's method, or one a
        family's hook set on it, which is what JAX traces)."""
        module = self.module
        previous = module.__dict__.get(method)

        def on_jax(*args, **kwargs):
            return self.call(method, *args, **kwargs)

        module.__dict__[method] = on_jax
        self._patched[method] = previous

        def remove() -> None:
            if previous is None:
                module.__dict__.pop(method, None)
            else:
                module.__dict__[method] = previous
            self._patched.pop(method, None)

        hooks.add(f"{self.label} {method} on JAX", remove)

    @contextmanager
    def _own_methods(self):
        """The module's own methods while it is traced (a patched one would call back to the host), without the
        hooks on its own calls (which tend to diffusers' glue on the host: a family's timesteps moved to the
        device at the door, where a trace's are there already)."""
        from collections import OrderedDict

        module = self.module
        taken = {}
        for name, previous in self._patched.items():
            taken[name] = module.__dict__.pop(name, None)
            if previous is not None:
                module.__dict__[name] = previous
        hooks = ("_forward_pre_hooks", "_forward_hooks")
        held = {name: getattr(module, name) for name in hooks}
        for name in hooks:
            setattr(module, name, OrderedDict())
        try:
            yield
        finally:
            for name, value in held.items():
                setattr(module, name, value)
            for name, patched in taken.items():
                if patched is not None:
                    module.__dict__[name] = patched

    def description(self) -> tuple:
        """What a trace of the module reads besides its weights (tpugen.backends.jax.store), as it is now."""
        from tpugen.backends.jax.store import module_description

        with self._own_methods():  # as traced: the module's own methods, not the hooks that send calls to JAX
            return module_description(self.module)

    @property
    def bytes(self) -> int:
        return sum(array.nbytes for array in self.weights.values())

    def put(self, name: str, host) -> None:
        """New data for one weight (a LoRA fused on the host): a transfer, never a compile."""
        canonical = self._alias.get(name, name)
        old = self.weights[canonical]
        new = to_jax(host.to(dtype=self._torch_dtype(old)), self.layout(canonical))
        if new.shape != old.shape:
            raise ValueError(f"{self.label}: {name} is {tuple(old.shape)}, the new data {tuple(new.shape)}")
        self.weights[canonical] = new

    @staticmethod
    def _torch_dtype(array):
        import torch

        return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(
            str(array.dtype), torch.float32
        )

    def traced(self, weights: dict, method, *args, **kwargs):
        """`module.method(*args, **kwargs)` (`method` a name, or a function of the module's own code that reads the
        module) with `weights` (JAX arrays, tracers inside a jitted function) as the module's parameters; the
        arguments are torchax tensors. Call it inside the torchax environment."""
        with self.as_traced(weights):
            run = getattr(self.module, method) if isinstance(method, str) else method
            return run(*args, **kwargs)

    @contextmanager
    def as_traced(self, weights: dict):
        """Inside: the module's own methods, with `weights` as its parameters (what `traced` calls in; also for a
        module another calls, as diffusers' multi-ControlNet calls each of its ControlNets)."""
        from torch.nn.utils import stateless

        env = self.runtime.env
        state = {name: env.j2t_iso(weights[canonical]) for name, canonical in self._alias.items()}
        kept = _tensor_attributes(self.module)
        try:
            with self._own_methods(), stateless._reparametrize_module(self.module, state, tie_weights=False):
                yield
        finally:
            _put_back(kept)

    def call(self, method: str, *args, **kwargs):
        """`module.method(*args, **kwargs)` from host torch tensors, computed by JAX on the device, its tensors
        read back to the host: a jitted program per signature (which arguments are tensors, and every other
        argument's value), JAX's own cache per shape."""
        import numpy as np
        import torch
        from torch.utils import _pytree as pytree

        leaves, spec = pytree.tree_flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        fixed = tuple(None if i in positions else leaf for i, leaf in enumerate(leaves))
        key = (method, spec, _hashable(fixed))
        with self._lock:
            if key not in self._jitted:
                self._jitted[key] = self._program(method, spec, fixed, positions)
        program, output = self._jitted[key]
        if self.shapes_only:
            import jax

            structs = [jax.ShapeDtypeStruct(tuple(leaves[i].shape), _host_dtype(leaves[i])) for i in positions]
            shapes = program.eval_shape(self.weights, structs)
            return output.rebuild(to_torch([np.zeros(x.shape, x.dtype) for x in shapes]))
        arrays = program(self.weights, [to_jax(leaves[i]) for i in positions])
        self.runtime.executed()
        host = to_torch(arrays)
        self.runtime.read()
        return output.rebuild(host)

    def _program(self, method: str, spec, fixed: tuple, positions: list[int]) -> tuple[Callable, _Outputs]:
        jax = self.runtime.jax
        env = self.runtime.env
        output = _Outputs()

        def program(weights, arrays):
            leaves = list(fixed)
            for i, array in zip(positions, arrays, strict=True):
                leaves[i] = env.j2t_iso(array)
            from torch.utils import _pytree as pytree

            args, kwargs = pytree.tree_unflatten(leaves, spec)
            with env:
                result = self.traced(weights, method, *args, **kwargs)
            return output.flatten(result, env)

        program.__name__ = f"{self.label}_{method}".replace(" ", "_").lstrip("_")
        return jax.jit(program), output


class _Outputs:
    """How a traced call's result was laid out (its tensors go back as a flat list)."""

    def __init__(self) -> None:
        self.spec = None
        self.fixed: tuple = ()
        self.positions: list[int] = []

    def flatten(self, result, env) -> list:
        import torch
        from torch.utils import _pytree as pytree

        leaves, self.spec = pytree.tree_flatten(result)
        self.positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.fixed = tuple(None if i in self.positions else leaf for i, leaf in enumerate(leaves))
        return [env.t2j_iso(leaves[i]) for i in self.positions]

    def rebuild(self, tensors: list):
        from torch.utils import _pytree as pytree

        leaves = list(self.fixed)
        for i, tensor in zip(self.positions, tensors, strict=True):
            leaves[i] = tensor
        return pytree.tree_unflatten(leaves, self.spec)


def _holds_tensors(value) -> bool:
    import torch

    if isinstance(value, torch.Tensor):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value)


def _tensor_attributes(module) -> dict:
    """Each submodule's plain attributes that hold tensors (not its parameters or buffers), and those of the
    plain objects it holds (diffusers' Z-Image RopeEmbedder): what a module may set for itself as it runs (the
    rotary tables move themselves to the input's device)."""
    import torch

    owners = []
    for sub in module.modules():
        owners.append(sub)
        for value in vars(sub).values():
            if hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, torch.Tensor, type)):
                owners.append(value)
    return {id(owner): (owner, {k: v for k, v in vars(owner).items() if _holds_tensors(v)}) for owner in owners}


def _put_back(kept: dict) -> None:
    """The attributes `_tensor_attributes` saw, as they were: one a trace set holds that trace's values, which
    the next trace would find (an escaped tracer, or a program compiled with more inputs than it is given)."""
    for owner, before in kept.values():
        for name, value in list(vars(owner).items()):
            if name in before:
                if value is not before[name]:
                    setattr(owner, name, before[name])
            elif _holds_tensors(value):
                delattr(owner, name)


def _hashable(values: tuple) -> tuple:
    """The non-tensor arguments as a key: hashable ones as they are, others by their repr."""
    out = []
    for value in values:
        try:
            hash(value)
            out.append(value)
        except TypeError:
            out.append(("repr", repr(value)))
    return tuple(out)
