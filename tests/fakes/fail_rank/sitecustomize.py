"""A test fake loaded at start-up (PYTHONPATH): rank TPUGEN_TEST_FAIL_RANK of a multi run fails after writing
its first batch, as a rank that crashes mid-run would. Production code knows nothing of it."""

import os

_RANK = os.environ.get("TPUGEN_TEST_FAIL_RANK")

if _RANK is not None:
    import tpugen.outputs.writers as _writers

    _write = _writers.BatchWriter.__call__

    def _fail_after_the_first_batch(self, batch, pixels, seconds):
        if self.extra.get("rank") == int(_RANK) and getattr(self, "_wrote_a_batch", False):
            raise RuntimeError(f"failed on purpose after its first batch (TPUGEN_TEST_FAIL_RANK={_RANK})")
        names = _write(self, batch, pixels, seconds)
        self._wrote_a_batch = True
        return names

    _writers.BatchWriter.__call__ = _fail_after_the_first_batch
