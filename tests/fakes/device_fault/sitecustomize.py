"""A test fake loaded at start-up (PYTHONPATH): a server's device that breaks while it serves, as a TPU whose
runtime starts failing every call would. With TPUGEN_TEST_DEVICE_FAULT set, a batch of a warm engine whose
prompt holds its value raises the RuntimeError a failing runtime raises (after 3 s if the prompt also says
"slowly"), and one whose prompt holds "bad input here" raises the InputError of a request's own bad input found
only in its batch. Other batches are made as always. Production code knows nothing of it."""

import os

_MARK = os.environ.get("TPUGEN_TEST_DEVICE_FAULT")

if _MARK:
    import time

    import tpugen.engine.engine as _engine
    from tpugen.errors import InputError

    _generate = _engine.Engine.generate

    def _generate_or_fail(self, batch, scheduler=None, loras=None, on_step=None):
        prompts = " | ".join(item.prompt for item in batch.items)
        if _MARK in prompts:
            if "slowly" in prompts:
                time.sleep(3)
            raise RuntimeError(f"INTERNAL: the device stopped answering (TPUGEN_TEST_DEVICE_FAULT={_MARK})")
        if "bad input here" in prompts:
            raise InputError("prompt: bad input found only in its batch (TPUGEN_TEST_DEVICE_FAULT)")
        return _generate(self, batch, scheduler, loras, on_step)

    _engine.Engine.generate = _generate_or_fail
