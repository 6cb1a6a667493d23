"""execution.mode: ray: one run over a Ray cluster, batches handed to host workers (actors) as they finish them."""

# The driver (`tpugen generate`) owns the run session: it connects (join), checks what the cluster has
# (resources), starts one worker per host (worker), hands out batches from one queue, appends each batch's records
# to the manifest once its worker returns them, and puts the batches of a lost worker back in the queue (driver).
# The only package that imports ray, and only inside functions, so that nothing else (tpugen.cli above all) pays
# for it; `import ray` in its modules is Ray itself (imports are absolute).

from tpugen.modes.ray.driver import run_cluster
from tpugen.modes.ray.resources import plan_lines

__all__ = ["plan_lines", "run_cluster"]
