"""Repeated transformer blocks through torch_xla's scan, weights stacked once: one block compiled per stack."""

from __future__ import annotations


def scan_repeated_blocks(transformer, attributes: tuple[str, ...]) -> int:
    """Run a DiT's repeated blocks through torch_xla's scan, weights stacked once at load time.

    Consecutive blocks of the same structure (same parameter names and shapes) form one stack: Flux.1's
    19 double and 38 single blocks are two stacks; SD3's joint blocks are one stack and its last block, which
    differs (context_pre_only), stays as it is; SD 3.5's blocks with and without dual attention are separate
    stacks. The compiler then sees one block per stack instead of every block unrolled. The stacked weights
    replace the blocks' own, so memory does not grow. Returns how many blocks now run inside a scan.
    """
    import torch
    from torch import nn
    from torch.func import functional_call
    from torch_xla.experimental.scan import scan

    class ScannedBlocks(nn.Module):
        # Called once, like one block; `scan` runs the template block with each block's weights in turn.
        def __init__(self, blocks) -> None:
            super().__init__()
            self.template = blocks[0]
            self.context_pre_only = getattr(blocks[0], "context_pre_only", None)  # SD3's loop reads it
            self.names = [name for name, _ in self.template.named_parameters()]
            params = [dict(block.named_parameters()) for block in blocks]
            for i, name in enumerate(self.names):
                self.register_buffer(f"stacked_{i}", torch.stack([p[name].detach() for p in params]))
            self._steps: dict[bool, object] = {}

        def _step(self, rotary: bool):
            # One long-lived function per call shape, so scan does not trace it again on every call.
            if rotary not in self._steps:
                template, names = self.template, self.names

                def step(carry, weights):
                    # Everything the block reads rides in the carry: scan cannot trace captured tensors.
                    hidden, encoder, temb, *cos_sin = carry
                    inputs = {"hidden_states": hidden, "encoder_hidden_states": encoder, "temb": temb}
                    if rotary:
                        inputs["image_rotary_emb"] = tuple(cos_sin)
                    encoder, hidden = functional_call(template, dict(zip(names, weights, strict=True)), (), inputs)
                    # scan traces a backward pass it never runs, so each step's output must depend on the inputs.
                    return (hidden, encoder, temb, *cos_sin), hidden.sum()

                self._steps[rotary] = step
            return self._steps[rotary]

        def forward(
            self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, joint_attention_kwargs=None
        ):
            weights = [getattr(self, f"stacked_{i}") for i in range(len(self.names))]
            rotary = image_rotary_emb is not None
            carry = (hidden_states, encoder_hidden_states, temb, *(image_rotary_emb if rotary else ()))
            (hidden, encoder, *_), _ = scan(self._step(rotary), carry, weights, is_fn_pure=True)
            return encoder, hidden

    def structure(block) -> tuple:
        return tuple((name, tuple(p.shape), p.dtype) for name, p in block.named_parameters())

    scanned = 0
    for attribute in attributes:
        blocks = list(getattr(transformer, attribute, None) or [])
        runs: list[list] = []
        for block in blocks:
            if runs and structure(runs[-1][0]) == structure(block):
                runs[-1].append(block)
            else:
                runs.append([block])
        if all(len(run) == 1 for run in runs):
            continue
        setattr(transformer, attribute, nn.ModuleList([ScannedBlocks(r) if len(r) > 1 else r[0] for r in runs]))
        scanned += sum(len(r) for r in runs if len(r) > 1)
    return scanned
