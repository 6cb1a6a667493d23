"""Repeated transformer blocks through torch_xla's scan, weights stacked once: one block compiled per stack."""

from __future__ import annotations


def scan_repeated_blocks(transformer, attributes: dict[str, tuple[str, ...]]) -> int:
    """Run a DiT's repeated blocks through torch_xla's scan, weights stacked once at load time.

    `attributes`: the transformer's block lists (its family's `scan_attributes`), each with the names of the
    arguments its blocks return new values of, in the order they return them (Flux.1's blocks return
    (encoder_hidden_states, hidden_states); Z-Image's return x).

    Consecutive blocks of the same structure (same parameter names and shapes) form one stack: Flux.1's
    19 double and 38 single blocks are two stacks; SD3's joint blocks are one stack and its last block, which
    differs (context_pre_only), stays as it is; SD 3.5's blocks with and without dual attention are separate
    stacks. The compiler then sees one block per stack instead of every block unrolled. The stacked weights
    replace the blocks' own, so memory does not grow. Returns how many blocks now run inside a scan.
    """
    from torch import nn

    def structure(block) -> tuple:
        return tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters())

    scanned = 0
    for attribute, returns in attributes.items():
        blocks = list(getattr(transformer, attribute, None) or [])
        runs: list[list] = []
        for block in blocks:
            if runs and structure(runs[-1][0]) == structure(block):
                runs[-1].append(block)
            else:
                runs.append([block])
        if all(len(run) == 1 for run in runs):
            continue
        stacks = [ScannedBlocks(run, returns) if len(run) > 1 else run[0] for run in runs]
        setattr(transformer, attribute, nn.ModuleList(stacks))
        scanned += sum(len(run) for run in runs if len(run) > 1)
    return scanned


def _scanned_blocks_class():
    import inspect

    import torch
    from torch import nn
    from torch.func import functional_call
    from torch.utils._pytree import tree_flatten, tree_unflatten
    from torch_xla.experimental.scan import scan

    class ScannedBlocks(nn.Module):
        """A stack of identical blocks called once, like one block: `scan` runs the template block with each
        block's weights in turn. Every tensor the block is given rides in the carry (scan cannot trace captured
        tensors), the ones it returns replaced by its outputs; other arguments (None, flags, dicts) are fixed
        per call shape."""

        def __init__(self, blocks, returns: tuple[str, ...]) -> None:
            super().__init__()
            self.template = blocks[0]
            self.returns = returns
            self.context_pre_only = getattr(blocks[0], "context_pre_only", None)  # SD3's loop reads it
            self.names = [name for name, _ in self.template.named_parameters()]
            params = [dict(block.named_parameters()) for block in blocks]
            for i, name in enumerate(self.names):
                self.register_buffer(f"stacked_{i}", torch.stack([p[name].detach() for p in params]))
            self._signature = inspect.signature(self.template.forward)
            self._steps: dict[tuple, object] = {}

        def _step(self, key: tuple, spec, fixed: list, carried: list[int], dtypes: list):
            # One long-lived function per call shape, so scan does not trace it again on every call.
            if key not in self._steps:
                template, names, returns = self.template, self.names, self.returns

                def step(carry, weights):
                    leaves = list(fixed)
                    for position, value, dtype in zip(carried, carry, dtypes, strict=True):
                        leaves[position] = value if dtype is None else value.to(dtype)
                    arguments = tree_unflatten(leaves, spec)
                    out = functional_call(template, dict(zip(names, weights, strict=True)), (), arguments)
                    out = out if isinstance(out, tuple) else (out,)
                    arguments.update(zip(returns, out, strict=True))
                    new, _ = tree_flatten(arguments)
                    # A mask or ids ride on unchanged: a round trip through their own dtype has no gradient path,
                    # which scan's backward trace needs.
                    new = [new[p] if d is None else c for p, d, c in zip(carried, dtypes, carry, strict=True)]
                    # scan traces a backward pass it never runs, so each step's output must depend on the inputs.
                    return tuple(new), out[0].sum()

                self._steps[key] = step
            return self._steps[key]

        def forward(self, *args, **kwargs):
            arguments = dict(self._signature.bind(*args, **kwargs).arguments)
            leaves, spec = tree_flatten(arguments)
            carried = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
            # Masks and ids ride as floats (scan's trace wants floating-point carries) and go back in the step.
            dtypes = [
                None if leaves[i].is_floating_point() or leaves[i].is_complex() else leaves[i].dtype for i in carried
            ]
            fixed = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
            key = (str(spec), repr(fixed), tuple(str(d) for d in dtypes))
            carry = tuple(
                leaves[i] if d is None else leaves[i].to(torch.float32) for i, d in zip(carried, dtypes, strict=True)
            )
            weights = [getattr(self, f"stacked_{i}") for i in range(len(self.names))]
            final, _ = scan(self._step(key, spec, fixed, carried, dtypes), carry, weights, is_fn_pure=True)
            leaves = list(fixed)
            for position, value, dtype in zip(carried, final, dtypes, strict=True):
                leaves[position] = value if dtype is None else value.to(dtype)
            done = tree_unflatten(leaves, spec)
            out = tuple(done[name] for name in self.returns)
            return out if len(out) > 1 else out[0]

    return ScannedBlocks


def ScannedBlocks(blocks, returns: tuple[str, ...]):  # noqa: N802 - builds the module class on first use
    """A stack of identical blocks as one module (torch and torch_xla are imported only when one is made)."""
    global _SCANNED
    if _SCANNED is None:
        _SCANNED = _scanned_blocks_class()
    return _SCANNED(blocks, returns)


_SCANNED = None
