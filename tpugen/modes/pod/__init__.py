"""`tpugen pod-run`: a run on every worker of a TPU pod through gcloud: shipped, run, gathered, one pod report."""

from tpugen.modes.pod.names import Pod
from tpugen.modes.pod.run import run_pod

__all__ = ["Pod", "run_pod"]
