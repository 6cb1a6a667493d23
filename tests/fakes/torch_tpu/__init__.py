"""A fake TorchTPU for a machine without a TPU: "tpu" tensors live on the host CPU, "tpu_dist" is gloo.

It does what tpugen relies on the real one for: importing it imports torch, registers the device "tpu"
and the process-group backend "tpu_dist", and makes torch.accelerator report FAKE_TORCH_TPU_CHIPS chips
(default 2). What tpugen asks of it is appended, one JSON line per event, to FAKE_TORCH_TPU_LOG. The one
TorchTPU fake of the tests: subprocesses import it by PYTHONPATH, pytest's own process through a fixture.
"""

import json
import os
import sys
import types

# Recorded before torch is imported here: the variables TorchTPU reads when torch is imported.
_IMPORTED = {
    "event": "import",
    "torch_already_imported": "torch" in sys.modules,
    "TORCH_TPU_DEFER_AND_FUSE": os.environ.get("TORCH_TPU_DEFER_AND_FUSE"),
    "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": os.environ.get("TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"),
}

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _log(event: dict) -> None:
    path = os.environ.get("FAKE_TORCH_TPU_LOG")
    if path:
        line = {**event, "pid": os.getpid(), "local_rank": os.environ.get("LOCAL_RANK")}
        with open(path, "a", encoding="utf-8") as log:
            log.write(json.dumps(line) + "\n")


_log(_IMPORTED)


def _host(device):
    """A "tpu" device as the CPU that stands in for it."""
    if isinstance(device, str) and device.split(":")[0] == "tpu":
        return "cpu"
    if isinstance(device, torch.device) and device.type == "tpu":
        return torch.device("cpu")
    return device


_tensor_to = torch.Tensor.to


def _to(self, *args, **kwargs):
    if "device" in kwargs:
        kwargs["device"] = _host(kwargs["device"])
    return _tensor_to(self, *(_host(a) for a in args), **kwargs)


_current = {"index": 0}
# What torch cannot unregister (the device module) asks this, so an undone install looks like no TPU again.
_state = types.SimpleNamespace(installed=False)


def _set_device_index(index) -> None:
    _current["index"] = index
    _log({"event": "set_device_index", "index": index})


def _process_group(store, rank, size, timeout):
    _log({"event": "process_group", "backend": "tpu_dist", "rank": rank, "size": size})
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def install(patch=setattr) -> None:
    """Make this process look like a TPU VM with TorchTPU. `patch(owner, name, value)` sets each attribute
    (a test passes monkeypatch.setattr to undo them); what torch cannot unregister is registered once."""
    if not hasattr(torch, "tpu"):
        torch.utils.rename_privateuse1_backend("tpu")
        # torch.tpu, as the real one registers it (diffusers empties the accelerator's cache through it).
        device_module = types.ModuleType("torch.tpu")
        device_module.is_available = lambda: _state.installed
        device_module.device_count = lambda: int(os.environ.get("FAKE_TORCH_TPU_CHIPS", "2")) if _state.installed else 0
        device_module.current_device = lambda: _current["index"]
        device_module.set_device = _set_device_index
        device_module.synchronize = lambda device=None: None
        device_module.empty_cache = lambda: None
        # The persistent cache's counts, as torch.tpu._get_cache_stats() gives them: nothing is compiled here.
        device_module._get_cache_stats = lambda: {"hits": 0, "requests": 0}
        torch._register_device_module("tpu", device_module)
        dist.Backend.register_backend("tpu_dist", _process_group, devices=["cpu"])
    patch(_state, "installed", True)
    patch(torch.Tensor, "to", _to)
    patch(torch.accelerator, "is_available", lambda: True)
    patch(torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("tpu"))
    # torch.distributed asks the C++ side; the real TorchTPU registers its hooks there, this fake cannot.
    patch(torch._C, "_get_accelerator", lambda: torch.device("tpu"))
    patch(torch.accelerator, "device_count", torch.tpu.device_count)
    patch(torch.accelerator, "set_device_index", _set_device_index)
    patch(torch.accelerator, "current_device_index", lambda: _current["index"])
    patch(torch.accelerator, "synchronize", lambda device=None: None)


# Imported as torch_tpu by a process (PYTHONPATH=tests/fakes), it installs itself, as the real one would;
# a test in pytest's own process loads it with FAKE_TORCH_TPU_MANUAL=1 and installs it undoably.
if os.environ.get("FAKE_TORCH_TPU_MANUAL") != "1":
    install()
